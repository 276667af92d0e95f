"""HDP flags: parsing, defaults, and one ConfigError per conflict with Megatron's flags.

Megatron-LM's training package is not installed here, so Megatron's side is a namespace
holding the values its validate_args leaves behind (defaults of core_v0.16.1, plus what a
GPT run sets); tests/test_arguments_megatron.py checks the names against the real parser.
"""

import argparse
import re

import pytest

from megatron_bytescale.errors import ConfigError
from megatron_bytescale.megatron import flag_table
from megatron_bytescale.megatron.arguments import (
    MEGATRON_ARGS_READ,
    MEGATRON_DERIVED_ARGS,
    add_hdp_arguments,
    chain_extra_args_providers,
    check_global_batch,
    cost_model_from_args,
    model_spec_from_args,
    planner_config_from_args,
    validate_hdp_args,
)
from megatron_bytescale.planner.cost_model import CostModel
from megatron_bytescale.planner.specs import HardwareSpec, ModelSpec

# Megatron's values after its own validate_args, for the tiny model on 8 GPUs (TP=1, PP=1)
MEGATRON = dict(
    attention_dropout=0.0,
    calculate_per_token_loss=True,
    context_parallel_size=1,
    hybrid_context_parallel=False,
    max_seqlen_per_dp_cp_rank=None,
    micro_batch_size=1,
    rampup_batch_size=None,
    pipeline_model_parallel_size=1,
    virtual_pipeline_model_parallel_size=None,
    microbatch_group_size_per_vp_stage=None,
    tensor_model_parallel_size=1,
    sequence_parallel=False,
    expert_model_parallel_size=1,
    expert_tensor_parallel_size=None,
    moe_token_dispatcher_type="allgather",
    overlap_moe_expert_parallel_comm=False,
    use_megatron_fsdp=False,
    use_torch_fsdp2=False,
    cuda_graph_impl="none",
    spec=None,
    mtp_num_layers=None,
    moe_layer_freq=1,
    moe_ffn_hidden_size=None,
    moe_shared_expert_intermediate_size=None,
    kv_lora_rank=512,
    q_lora_rank=None,
    qk_head_dim=128,
    qk_pos_emb_head_dim=64,
    v_head_dim=128,
    seq_length=32768,
    dataloader_type="single",
    sft=False,
    fim_data=False,
    fine_grained_activation_offloading=False,
    cpu_offloading_num_layers=0,
    num_layers=4,
    hidden_size=64,
    num_attention_heads=4,
    group_query_attention=True,
    num_query_groups=2,
    kv_channels=16,
    ffn_hidden_size=128,
    swiglu=True,
    num_experts=None,
    moe_router_topk=2,
    padded_vocab_size=512,
    vocab_size=512,
    multi_latent_attention=False,
    cache_mla_latents=False,
    position_embedding_type="rope",
    experimental_attention_variant=None,
    heterogeneous_layers_config_path=None,
    global_batch_size=16,
    mock_data=False,
    data_path=None,
    train_data_path=["data/corpus"],
    valid_data_path=["data/valid"],
    test_data_path=None,
    data_args_path=None,
    per_split_data_args_path=None,
    eval_iters=10,
    split=None,
    tokenizer_type="NullTokenizer",
    eval_interval=500,
    train_iters=1000,
    skip_train=False,
    full_validation=False,
    multiple_validation_sets=False,
    transformer_impl="transformer_engine",
    normalization="RMSNorm",
    qk_layernorm=False,
    qk_l2_norm=False,
    seed=1234,
    recompute_granularity=None,
    recompute_method=None,
    recompute_num_layers=None,
    recompute_modules=None,
    data_parallel_size=8,
    world_size=8,
    iteration=0,
)


def parse(argv, **megatron):
    """Our flags through argparse, Megatron's from the dict above (with overrides)."""
    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_hdp_arguments(parser)
    args = parser.parse_args(argv)
    for name, value in {**MEGATRON, **megatron}.items():
        setattr(args, name, value)
    return args


HDP = ["--hybrid-data-parallel", "--hdp-token-capacity", "8K"]


@pytest.fixture(autouse=True)
def _no_local_world_size(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    # the flags of a GPU run (default cost model: analytic H100); a CPU run's default is
    # test_the_cost_model_follows_the_device's
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)


def test_namespace_covers_every_megatron_arg_the_validator_reads():
    assert set(MEGATRON) == set(MEGATRON_ARGS_READ) | set(MEGATRON_DERIVED_ARGS)


def test_defaults():
    args = parse([])
    assert args.hybrid_data_parallel is False
    assert args.hdp_token_capacity is None
    assert args.hdp_balance is None
    assert args.hdp_balance_slack == 0.05
    assert args.hdp_selective_offload is False
    assert args.hdp_profile is None and args.hdp_hardware is None
    assert args.hdp_dataloader == "local" and args.hdp_ray_address is None
    assert args.hdp_plan_ahead == 2
    assert args.hdp_ranks_per_node is None
    assert args.hdp_step_tokens is None and args.hdp_ray_servers == 2
    # off: nothing changes, Megatron's own loader stays
    assert validate_hdp_args(args).dataloader_type == "single"


def test_enabled_resolves_defaults():
    args = validate_hdp_args(parse(HDP))
    assert args.hdp_token_capacity == 8192
    assert args.hdp_balance == "dp"
    assert args.hdp_hardware == "h100"
    assert args.hdp_size == 8
    assert args.hdp_ranks_per_node == 8  # h100 nodes hold 8 GPUs
    assert args.hdp_step_tokens == 16 * 32768  # --global-batch-size x --seq-length
    assert args.dataloader_type == "external"


@pytest.mark.parametrize("text,tokens", [("8K", 8192), ("16384", 16384), ("1.5K", 1536), ("2M", 2 << 20), ("4k", 4096)])
def test_token_capacity_suffixes(text, tokens):
    assert parse(["--hdp-token-capacity", text]).hdp_token_capacity == tokens


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--hdp-token-capacity", "8X"], "cannot read token count '8X'"),
        (["--hdp-token-capacity", "0"], "must be positive"),
        (["--hdp-token-capacity", "1.3"], "not a whole number"),
        (["--hdp-balance", "tp"], "invalid choice: 'tp'"),
        (["--hdp-balance-slack", "1.5"], r"must be in \[0, 1\)"),
        (["--hdp-balance-slack", "-0.1"], r"must be in \[0, 1\)"),
        (["--hdp-plan-ahead", "-1"], "must not be negative"),
        (["--hdp-plan-ahead", "two"], "expected a whole number"),
        (["--hdp-ranks-per-node", "0"], "must be positive"),
        (["--hdp-ray-servers", "0"], "must be positive"),
        (["--hdp-step-tokens", "lots"], "cannot read token count 'lots'"),
        (["--hdp-dataloader", "spark"], "invalid choice: 'spark'"),
    ],
)
def test_bad_values_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse(argv)
    assert re.search(message, capsys.readouterr().err)


def test_explicit_values_parse():
    args = parse(
        HDP
        + [
            "--hdp-balance",
            "none",
            "--hdp-balance-slack",
            "0.1",
            "--hdp-selective-offload",
            "--hdp-hardware",
            "h200",
            "--hdp-plan-ahead",
            "0",
            "--hdp-ranks-per-node",
            "4",
            "--hdp-step-tokens",
            "1M",
        ]
    )
    validate_hdp_args(args)
    assert args.hdp_step_tokens == 1 << 20
    assert (args.hdp_balance, args.hdp_balance_slack, args.hdp_selective_offload) == ("none", 0.1, True)
    assert (args.hdp_hardware, args.hdp_plan_ahead, args.hdp_ranks_per_node) == ("h200", 0, 4)


def test_pipeline_parallel_is_accepted_with_pp_balance():
    args = validate_hdp_args(parse(HDP, pipeline_model_parallel_size=2, data_parallel_size=4))
    assert args.hdp_balance == "pp"  # the default with pipelines
    assert planner_config_from_args(args).pipeline_stages == 2
    parsed = parse(
        HDP + ["--hdp-balance", "pp"], pipeline_model_parallel_size=4, data_parallel_size=2, seq_length=16384
    )
    args = validate_hdp_args(parsed)
    assert (args.hdp_balance, args.hdp_size) == ("pp", 2)


def test_multi_latent_attention_and_multi_token_prediction_are_accepted_and_planned():
    """MLA with either ring transport (the plan's rings carry what --hdp-mla-ring says; K and V
    by default, and for every model without MLA), and MTP without pipelines."""
    args = validate_hdp_args(parse(HDP, multi_latent_attention=True, mtp_num_layers=1))
    assert (args.hdp_mla_ring, planner_config_from_args(args).ring_transport) == ("kv", "kv")
    mla = dict(multi_latent_attention=True, qk_layernorm=True, transformer_impl="local")
    args = validate_hdp_args(parse(HDP + ["--hdp-mla-ring", "latent"], **mla))
    assert planner_config_from_args(args).ring_transport == "latent"
    args = validate_hdp_args(parse(HDP + ["--hdp-mla-ring", "auto"], **mla))  # each ring the faster one
    assert planner_config_from_args(args).ring_transport == "auto"
    assert planner_config_from_args(validate_hdp_args(parse(HDP))).ring_transport == "kv"


def test_virtual_pipeline_stages_are_accepted_and_planned_with_their_chunk_count():
    args = validate_hdp_args(
        parse(HDP, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, data_parallel_size=4)
    )
    assert (args.hdp_balance, planner_config_from_args(args).virtual_stages) == ("pp", 2)
    validate_hdp_args(
        parse(HDP, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, overlap_grad_reduce=True)
    )
    assert planner_config_from_args(validate_hdp_args(parse(HDP))).virtual_stages == 1
    # Megatron's chunk group size: its default (the pipeline size) is what HDP runs; unused without chunks
    validate_hdp_args(
        parse(
            HDP,
            pipeline_model_parallel_size=2,
            virtual_pipeline_model_parallel_size=2,
            microbatch_group_size_per_vp_stage=2,
            data_parallel_size=4,
        )
    )
    validate_hdp_args(parse(HDP, pipeline_model_parallel_size=2, microbatch_group_size_per_vp_stage=3))


def test_ranks_per_node_from_local_world_size_and_tp(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    args = validate_hdp_args(parse(HDP, tensor_model_parallel_size=2, data_parallel_size=4))
    assert args.hdp_ranks_per_node == 4
    # never more than the HDP group itself
    args = validate_hdp_args(parse(HDP, tensor_model_parallel_size=2, data_parallel_size=2, seq_length=16384))
    assert args.hdp_ranks_per_node == 2


# one case per refused combination: (our flags, Megatron overrides, words the message must hold).
# Each differs from the valid baseline (HDP flags + MEGATRON, see test_enabled_resolves_defaults)
# only in the conflict it names.
CONFLICTS = {
    "per-token loss": (HDP, dict(calculate_per_token_loss=False), "add --calculate-per-token-loss"),
    "micro batch": (HDP, dict(micro_batch_size=2), "use --micro-batch-size 1"),
    "rampup": (HDP, dict(rampup_batch_size=["16", "16", "1000"]), "drop --rampup-batch-size"),
    "static cp": (HDP, dict(context_parallel_size=2), "drop --context-parallel-size"),
    "hybrid cp": (HDP, dict(hybrid_context_parallel=True), "--hybrid-context-parallel"),
    "hybrid cp capacity": (HDP, dict(max_seqlen_per_dp_cp_rank=4096), "--max-seqlen-per-dp-cp-rank"),
    "chunk group size": (
        HDP,
        dict(
            pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, microbatch_group_size_per_vp_stage=3
        ),
        r"^--microbatch-group-size-per-virtual-pipeline-stage 3: .*drop the flag$",
    ),
    "dp balance with pp": (HDP + ["--hdp-balance", "dp"], dict(pipeline_model_parallel_size=2), "use --hdp-balance pp"),
    "expert parallel allgather": (
        HDP,
        dict(num_experts=8, expert_model_parallel_size=2),
        r"^--moe-token-dispatcher-type allgather .*equal-sized token blocks.*use --moe-token-dispatcher-type alltoall",
    ),
    "expert a2a overlap": (
        HDP,
        dict(
            num_experts=8,
            expert_model_parallel_size=2,
            moe_token_dispatcher_type="alltoall",
            overlap_moe_expert_parallel_comm=True,
        ),
        "--overlap-moe-expert-parallel-comm",
    ),
    "expert tensor parallel": (
        HDP,
        dict(
            num_experts=8,
            expert_model_parallel_size=2,
            moe_token_dispatcher_type="alltoall",
            tensor_model_parallel_size=2,
            sequence_parallel=True,
            expert_tensor_parallel_size=1,
        ),
        "drop --expert-tensor-parallel-size",
    ),
    "megatron fsdp": (HDP, dict(use_megatron_fsdp=True), "--use-distributed-optimizer"),
    "torch fsdp2": (HDP, dict(use_torch_fsdp2=True), "--use-distributed-optimizer"),
    "cuda graphs": (HDP, dict(cuda_graph_impl="local"), "CUDA graphs need fixed shapes"),
    "legacy models (0.16)": (HDP, dict(use_legacy_models=True), "drop --use-legacy-models"),
    "custom spec": (HDP, dict(spec=["my.module", "my_spec"]), "drop --spec"),
    "mtp with virtual stages": (
        HDP + ["--hdp-balance", "pp"],
        dict(
            mtp_num_layers=1,
            pipeline_model_parallel_size=2,
            virtual_pipeline_model_parallel_size=2,
            num_layers_per_virtual_pipeline_stage=1,
            num_layers=4,
            data_parallel_size=4,
        ),
        "drop --num-layers-per-virtual-pipeline-stage",
    ),
    "attention dropout": (HDP, dict(attention_dropout=0.1), "add --attention-dropout 0.0"),
    "mla latent ring, TE's fused KV norm": (
        HDP + ["--hdp-mla-ring", "latent"],
        dict(multi_latent_attention=True, qk_layernorm=True, transformer_impl="transformer_engine"),
        "use --hdp-mla-ring kv",
    ),
    "mla latent caching": (HDP, dict(multi_latent_attention=True, cache_mla_latents=True), "--cache-mla-latents"),
    "latent ring without mla": (HDP + ["--hdp-mla-ring", "latent"], {}, "without --multi-latent-attention"),
    "yarn": (HDP, dict(position_embedding_type="yarn"), "rope, learned_absolute or none"),
    "attention variant": (HDP, dict(experimental_attention_variant="gated_delta_net"), "choose their own layer specs"),
    "heterogeneous": (HDP, dict(heterogeneous_layers_config_path="h.json"), "choose their own layer specs"),
    "mock data and a data path": (HDP, dict(mock_data=True), "replace the datasets"),
    "mock lengths without mock data": (HDP + ["--hdp-mock-lengths", "byted"], {}, "add --mock-data"),
    "no data": (HDP, dict(train_data_path=None, valid_data_path=None), "no training data"),
    "full validation": (HDP, dict(full_validation=True), "--full-validation"),
    "eval without valid data": (HDP, dict(valid_data_path=None), "pass --valid-data-path VALID.*or --eval-iters 0"),
    "eval with a split without validation": (
        HDP,
        dict(data_path=["data/a"], train_data_path=None, valid_data_path=None, split="100,0,0"),
        "--split 100,0,0 gives validation no share",
    ),
    "sft without its tokenizer": (HDP, dict(sft=True), "--tokenizer-type SFTTokenizer"),
    "sft on ray": (
        HDP + ["--hdp-dataloader", "ray", "--hdp-ray-address", "head:6379"],
        dict(sft=True, tokenizer_type="SFTTokenizer"),
        "--hdp-dataloader local",
    ),
    "sft with mock data": (HDP, dict(sft=True, mock_data=True, tokenizer_type="SFTTokenizer"), "drop one of them"),
    "no eval interval": (
        HDP,
        dict(eval_interval=None, eval_iters=0, valid_data_path=None),
        "without --eval-interval.*--eval-interval 1000",
    ),
    "step below seq length": (HDP + ["--hdp-step-tokens", "16K"], {}, "below --seq-length 32K"),
    "ray servers without ray": (HDP + ["--hdp-ray-servers", "4"], {}, "--hdp-dataloader ray"),
    "fim": (HDP, dict(fim_data=True), "drop --fim-data"),
    "cyclic loader": (HDP, dict(dataloader_type="cyclic"), "drop --dataloader-type"),
    "ray address without ray": (HDP + ["--hdp-ray-address", "ray://head:10001"], {}, "--hdp-dataloader ray"),
    "megatron's offloading": (HDP, dict(fine_grained_activation_offloading=True), "--hdp-selective-offload: use that"),
    "megatron's offloading (layers)": (HDP, dict(cpu_offloading_num_layers=2), "--hdp-selective-offload: use that"),
    "sliding window": (HDP, dict(window_size=(64, 0)), "no sliding window"),
    "attention sinks": (HDP, dict(softmax_type="learnable"), "no attention sinks"),
    "global aux loss": (HDP, dict(moe_router_load_balancing_type=["global_aux_loss"]), "use aux_loss or seq_aux_loss"),
    "no capacity": (["--hybrid-data-parallel"], {}, "needs --hdp-token-capacity"),
    "unknown hardware": (HDP + ["--hdp-hardware", "tpu-v5"], {}, "unknown hardware 'tpu-v5'.*h100"),
    "profile and hardware": (HDP + ["--hdp-profile", __file__, "--hdp-hardware", "h200"], {}, "keep one"),
    "missing profile": (HDP + ["--hdp-profile", "/nonexistent/profile.yaml"], {}, "no such file"),
    "sequence too long": (HDP, dict(seq_length=128 * 1024), r"128K.*8 HDP ranks.*64K tokens.*--hdp-selective-offload"),
    "flag without hdp": (
        ["--hdp-token-capacity", "8K", "--hdp-balance", "pp"],
        {},
        "--hdp-token-capacity, --hdp-balance only apply",
    ),
    # flags of core_v0.17-0.19 (absent on core_v0.16, where getattr's defaults apply)
    "eval micro batch (0.19)": (HDP, dict(eval_micro_batch_size=4), "--eval-micro-batch-size 4"),
    "eval global batch (0.19)": (HDP, dict(eval_global_batch_size=64), "--hdp-step-tokens"),
    "batch size schedule (0.19)": (HDP, dict(step_batch_size_schedule="0:8 1M:16"), "--step-batch-size-schedule"),
    "paged stash (0.19)": (HDP, dict(moe_paged_stash=True), "HDP step replaces"),
    "rank capacity factor (0.19)": (HDP, dict(moe_expert_rank_capacity_factor=1.5), "HDP step replaces"),
}


@pytest.mark.parametrize("case", sorted(CONFLICTS))
def test_every_conflict_is_a_config_error(case):
    """As the ranks check: the flag table's refusals, then validate_hdp_args."""
    argv, megatron, message = CONFLICTS[case]
    args = parse(argv, **megatron)
    with pytest.raises(ConfigError, match=message):
        if args.hybrid_data_parallel:
            flag_table.refuse(args)
        validate_hdp_args(args)


# Megatron's data flags HDP honours (refused before): (flags, Megatron's values, what each split reads)
ACCEPTED_DATA = {
    "weighted blend, split": (
        HDP,
        dict(data_path=["0.3", "a", "0.7", "b"], train_data_path=None, valid_data_path=None, split="98,2,0"),
        {
            "train": [("a", 0.3, (0, 0.98)), ("b", 0.7, (0, 0.98))],
            "valid": [("a", 0.3, (0.98, 1)), ("b", 0.7, (0.98, 1))],
        },
    ),
    "prefixes without weights, Megatron's default split": (
        HDP,
        dict(data_path=["a", "b"], train_data_path=None, valid_data_path=None),
        {
            "train": [("a", None, (0, 0.969)), ("b", None, (0, 0.969))],
            "valid": [("a", None, (0.969, 0.999)), ("b", None, (0.969, 0.999))],
            "test": [("a", None, (0.999, 1)), ("b", None, (0.999, 1))],
        },
    ),
    "per-split blends": (
        HDP,
        dict(train_data_path=["2", "a", "1", "b"], valid_data_path=["v"], test_data_path=["t"]),
        {
            "train": [("a", 2.0, (0, 1)), ("b", 1.0, (0, 1))],
            "valid": [("v", None, (0, 1))],
            "test": [("t", None, (0, 1))],
        },
    ),
    "mock data": (
        HDP + ["--hdp-mock-lengths", "byted"],
        dict(mock_data=True, train_data_path=None, valid_data_path=None, split="99,1,0"),
        {"train": [(None, None, (0, 1))], "valid": [(None, None, (0, 1))]},
    ),
    "sft": (
        HDP,
        dict(sft=True, tokenizer_type="SFTTokenizer", train_data_path=["c.jsonl"], valid_data_path=["v.jsonl"]),
        {"train": [("c.jsonl", None, (0, 1))], "valid": [("v.jsonl", None, (0, 1))]},
    ),
}


@pytest.mark.parametrize("case", sorted(ACCEPTED_DATA))
def test_megatron_data_flags_are_honoured(case):
    from megatron_bytescale.megatron.data_config import data_config_from_args

    argv, megatron, expected = ACCEPTED_DATA[case]
    config = data_config_from_args(validate_hdp_args(parse(argv, **megatron)))
    got = {}
    for name in ("train", "valid", "test"):
        spec = config.stream(name)
        if spec is not None:
            got[name] = [(p.path, p.weight, tuple(round(x, 6) for x in p.split)) for p in spec.parts]
    assert got == {k: [(p, w, tuple(float(x) for x in r)) for p, w, r in v] for k, v in expected.items()}
    assert config.record()["seed"] == 1234 and "train" in config.record()


def test_data_args_files_read_as_megatron_reads_them(tmp_path):
    from megatron_bytescale.megatron.data_config import data_config_from_args

    (tmp_path / "blend.txt").write_text("0.4 books\n0.6 code\n")
    (tmp_path / "splits.json").write_text('{"train": "1 a 3 b", "valid": ["v"], "test": ["t"]}')
    config = data_config_from_args(
        validate_hdp_args(
            parse(HDP, data_args_path=str(tmp_path / "blend.txt"), train_data_path=None, valid_data_path=None)
        )
    )
    assert [(p.path, p.weight) for p in config.train.parts] == [("books", 0.4), ("code", 0.6)]
    config = data_config_from_args(
        validate_hdp_args(
            parse(
                HDP, per_split_data_args_path=str(tmp_path / "splits.json"), train_data_path=None, valid_data_path=None
            )
        )
    )
    assert [(p.path, p.weight) for p in config.train.parts] == [("a", 1.0), ("b", 3.0)]
    assert [p.path for p in config.test.parts] == ["t"]


def test_data_path_and_no_eval_are_accepted():
    args = validate_hdp_args(
        parse(HDP, data_path=["data/corpus"], train_data_path=None, valid_data_path=None, eval_iters=0)
    )
    assert args.dataloader_type == "external"


def test_sequence_too_long_is_allowed_with_offload():
    # 72K > 8 ranks x 8K: fits on the 8 ranks only with offloading
    args = validate_hdp_args(parse(HDP + ["--hdp-selective-offload"], seq_length=72 * 1024))
    assert args.hdp_selective_offload


def test_sequence_that_does_not_fit_even_with_full_offload_is_refused_in_one_line():
    # 128K needs 12 ranks of 8K even at offload ratio 1 (the planner's memory floor); a world of
    # 8 (say, after an elastic restart on fewer nodes) stops at launch, not at the first step
    with pytest.raises(
        ConfigError, match=r"^--seq-length 128K does not fit even with full offload: .*needs 12 ranks.*only 8 ranks"
    ) as exc:
        validate_hdp_args(parse(HDP + ["--hdp-selective-offload"], seq_length=128 * 1024))
    assert "\n" not in str(exc.value)


def test_global_batch_that_the_hdp_ranks_do_not_divide_is_refused_in_one_line():
    with pytest.raises(
        ConfigError, match=r"^--global-batch-size 8 does not divide by the 3 HDP ranks.*every world"
    ) as exc:
        check_global_batch(
            validate_hdp_args(parse(HDP, world_size=3, data_parallel_size=3, seq_length=8192, global_batch_size=8))
        )
    check_global_batch(
        validate_hdp_args(parse(HDP, world_size=3, data_parallel_size=3, seq_length=8192, global_batch_size=12))
    )
    assert "\n" not in str(exc.value)


def test_ray_dataloader_needs_a_shared_cluster_for_several_ranks(monkeypatch):
    pytest.importorskip("ray")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(ConfigError, match="--hdp-ray-address HOST:PORT"):
        validate_hdp_args(parse(HDP + ["--hdp-dataloader", "ray"]))
    args = validate_hdp_args(parse(HDP + ["--hdp-dataloader", "ray", "--hdp-ray-address", "head:6379"]))
    assert args.hdp_ray_address == "head:6379"
    args = validate_hdp_args(
        parse(HDP + ["--hdp-dataloader", "ray"], world_size=1, data_parallel_size=1, seq_length=8192)
    )
    assert args.hdp_dataloader == "ray"  # one rank may start its own Ray


def test_ray_dataloader_refuses_cleanly_without_ray(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_ray(name, *a, **k):
        if name == "ray":
            raise ImportError("no ray")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    with pytest.raises(ConfigError, match=r"pip install 'megatron_bytescale\[ray\]'"):
        validate_hdp_args(parse(HDP + ["--hdp-dataloader", "ray"]))


def test_chain_extra_args_providers_keeps_both_groups():
    def other(parser):
        parser.add_argument("--other-flag", type=int, default=3)
        return parser

    parser = chain_extra_args_providers(other, None, add_hdp_arguments)(argparse.ArgumentParser())
    args = parser.parse_args(["--other-flag", "5", "--hybrid-data-parallel"])
    assert args.other_flag == 5 and args.hybrid_data_parallel


def test_help_documents_every_flag():
    parser = argparse.ArgumentParser()
    add_hdp_arguments(parser)
    text = parser.format_help()
    for name in [a.dest for a in parser._actions if a.dest.startswith(("hdp_", "hybrid_data"))]:
        assert "--" + name.replace("_", "-") in text


def test_model_spec_and_cost_model_follow_the_flags():
    args = validate_hdp_args(parse(HDP))
    spec = model_spec_from_args(args)
    expected = ModelSpec.load("tiny")
    for field in (
        "num_layers",
        "hidden_size",
        "num_attention_heads",
        "num_query_groups",
        "kv_channels",
        "ffn_hidden_size",
        "vocab_size",
        "swiglu",
        "num_experts",
    ):
        assert getattr(spec, field) == getattr(expected, field), field
    cost = cost_model_from_args(args)
    assert cost == CostModel.analytic(expected, HardwareSpec.load("h100"))


def test_the_model_spec_sees_mla_mtp_and_experts_as_the_planner_costs_them():
    """Multi-latent attention's sizes (so a run's planner costs the latent ring it was asked
    for), MTP depths and a MoE model's expert widths and dense layers reach the spec."""
    args = validate_hdp_args(
        parse(
            HDP,
            multi_latent_attention=True,
            mtp_num_layers=1,
            num_experts=8,
            moe_router_topk=2,
            moe_ffn_hidden_size=32,
            moe_shared_expert_intermediate_size=64,
            moe_layer_freq=[0, 0, 0, 1],  # one 0 or 1 per layer, as Megatron requires
        )
    )
    spec = model_spec_from_args(args)
    assert spec.is_mla and spec.ring_values_per_token() == {"kv": 4 * (128 + 64 + 128), "latent": 512 + 64}
    assert (spec.mtp_num_layers, spec.moe_ffn_hidden_size, spec.moe_shared_expert_size) == (1, 32, 64)
    assert spec.dense_layers == args.num_layers - 1
    assert model_spec_from_args(validate_hdp_args(parse(HDP))).is_mla is False


def test_cost_model_reads_the_profile(tmp_path):
    args = validate_hdp_args(parse(HDP))
    profile = tmp_path / "profile.json"
    cost_model_from_args(args).with_overrides(a1=1.25e-12).to_profile(profile, source="test")
    args = validate_hdp_args(parse(HDP + ["--hdp-profile", str(profile)]))
    assert cost_model_from_args(args).a1 == 1.25e-12


def test_no_gqa_means_one_kv_head_per_query_head():
    args = validate_hdp_args(parse(HDP, group_query_attention=False, num_query_groups=1))
    assert model_spec_from_args(args).num_query_groups == 4


def test_host_memory_flag_overrides_the_budget(tmp_path):
    args = validate_hdp_args(parse(HDP))
    assert cost_model_from_args(args).host_memory_bytes == HardwareSpec.load("h100").host_memory_bytes
    args = validate_hdp_args(parse(HDP + ["--hdp-host-memory-per-gpu", "64G"]))
    assert cost_model_from_args(args).host_memory_bytes == float(64 << 30)
    profile = tmp_path / "profile.json"
    cost_model_from_args(args).with_overrides(host_memory_bytes=1e9).to_profile(profile)
    args = validate_hdp_args(parse(HDP + ["--hdp-profile", str(profile), "--hdp-host-memory-per-gpu", "2G"]))
    assert cost_model_from_args(args).host_memory_bytes == float(2 << 30)  # the flag wins over the profile
    with pytest.raises(ConfigError, match="--hdp-host-memory-per-gpu only apply with --hybrid-data-parallel"):
        validate_hdp_args(parse(["--hdp-host-memory-per-gpu", "64G"]))


def test_activation_recompute_is_accepted_and_costed():
    for flags in (
        dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
        dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2),
        dict(recompute_granularity="selective", recompute_modules=["core_attn"]),
    ):
        args = validate_hdp_args(parse(HDP, **flags))
        cost = cost_model_from_args(args)
        assert cost.recomputed_attention_layers > 0, flags
    block = cost_model_from_args(
        validate_hdp_args(parse(HDP, recompute_granularity="full", recompute_method="block", recompute_num_layers=2))
    )
    assert (block.recomputed_layers, block.activation_layers) == (2, 2)


def test_overlapped_gradient_reduction_and_param_gather_are_accepted():
    validate_hdp_args(parse(HDP, overlap_grad_reduce=True, overlap_param_gather=True))


def test_sequence_parallelism_with_tp_is_accepted_and_divides_activations():
    with_sp = cost_model_from_args(validate_hdp_args(parse(HDP, tensor_model_parallel_size=2, sequence_parallel=True)))
    without = cost_model_from_args(validate_hdp_args(parse(HDP, tensor_model_parallel_size=2)))
    one = cost_model_from_args(validate_hdp_args(parse(HDP)))
    assert with_sp.a2 == pytest.approx(one.a2 / 2)  # every activation divided by TP
    # tiny (h 64, q 64, kv 32, f 128, SwiGLU): whole 4h = 256, sharded 2q+2kv+3f = 576 elements
    assert without.a2 == pytest.approx(2 * (256 + 576 / 2)) and without.a2 > with_sp.a2


def test_expert_parallelism_with_the_all_to_all_dispatcher_is_accepted_and_planned_in_slots():
    args = validate_hdp_args(
        parse(HDP, num_experts=8, expert_model_parallel_size=2, moe_token_dispatcher_type="alltoall")
    )
    config = planner_config_from_args(args)
    assert config.expert_parallel == 2
    assert cost_model_from_args(args).moe_a2a_bytes_per_token == 2 * 64 * 2  # top-2 x hidden 64, bf16
    # with pipelines too: the slots are numbered over all pipelines (planner/expert/pipelines.py)
    moe = dict(num_experts=8, expert_model_parallel_size=2, moe_token_dispatcher_type="alltoall")
    args = validate_hdp_args(parse(HDP + ["--hdp-balance", "pp"], **moe, pipeline_model_parallel_size=2))
    config = planner_config_from_args(args)
    assert (config.expert_parallel, config.pipeline_stages) == (2, 2)


def test_the_cost_model_follows_the_device(monkeypatch):
    # without CUDA the planner predicts CPU seconds: the shipped CPU profile, carried to the
    # model (for the profiled tiny model, the profile itself); with CUDA the analytic H100 model
    import dataclasses

    from megatron_bytescale.megatron.arguments import cost_model_from_args
    from megatron_bytescale.planner.cost_model import CostModel
    from megatron_bytescale.planner.cpu_profile import CPU_PROFILE, cpu_cost_model
    from megatron_bytescale.planner.specs import ModelSpec

    tiny = []  # MEGATRON above is the tiny model's shape
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    args = validate_hdp_args(parse(HDP + tiny))
    assert args.hdp_hardware == "cpu"
    cpu, profile = cost_model_from_args(args), CostModel.from_profile(CPU_PROFILE)
    for f in ("a1", "b1", "g", "a2", "kv_bytes_per_token", "bw_intra_node", "num_layers"):
        assert getattr(cpu, f) == pytest.approx(getattr(profile, f)), f
    # another model: the measured seconds per FLOP carry over (a 7B layer is ~2,000x tiny's linear work)
    big = cpu_cost_model(ModelSpec.load("llama-7b"))
    assert big.b1 / profile.b1 == pytest.approx(big.flops_per_token_linear / profile.flops_per_token_linear)
    assert big.g == profile.g and big.num_layers == 32
    # four ranks on two cores: each second of compute takes two
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    shared = cost_model_from_args(args)
    assert (shared.a1, shared.b1, shared.g) == pytest.approx((2 * cpu.a1, 2 * cpu.b1, 2 * cpu.g))
    assert shared.bw_intra_node == cpu.bw_intra_node
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    gpu_args = validate_hdp_args(parse(HDP + tiny))
    assert gpu_args.hdp_hardware == "h100"
    assert cost_model_from_args(gpu_args).b1 < cpu.b1 / 1000
    # asked for explicitly, on any machine
    assert dataclasses.astuple(
        cost_model_from_args(validate_hdp_args(parse(HDP + tiny + ["--hdp-hardware", "cpu"])))
    ) == dataclasses.astuple(cpu)


def test_the_flex_dispatcher_is_accepted_where_its_kernels_can_run(monkeypatch):
    """On a CUDA machine the flex dispatcher shares the all-to-all's slots; without its
    backend's package it is one line naming the package (deep_ep; TE for ncclep); on a
    machine without a GPU one line says so."""
    import importlib.util

    flex = dict(num_experts=8, expert_model_parallel_size=2, moe_token_dispatcher_type="flex")
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"^--moe-token-dispatcher-type flex \(deepep\) runs CUDA kernels and this"):
        validate_hdp_args(parse(HDP, **flex))
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    found = {"deep_ep": None, "transformer_engine": object()}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: found.get(name))
    with pytest.raises(ConfigError, match=r"with the deepep backend needs DeepEP \(deep_ep\) installed"):
        validate_hdp_args(parse(HDP, **flex))
    with pytest.raises(ConfigError, match=r"with the hybridep backend needs DeepEP"):
        validate_hdp_args(parse(HDP, **flex, moe_flex_dispatcher_backend="hybridep"))
    validate_hdp_args(parse(HDP, **flex, moe_flex_dispatcher_backend="ncclep"))  # TE is there
    found["deep_ep"] = object()
    args = validate_hdp_args(parse(HDP, num_experts=8, expert_model_parallel_size=2, moe_enable_deepep=True))
    assert args.hybrid_data_parallel  # --moe-enable-deepep: Megatron's older spelling of flex with DeepEP
