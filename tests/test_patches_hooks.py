"""pretrain_hooks: the functions the patch series and the launcher wire into pretrain_gpt.py.

Megatron-LM's training package is not installed here, so ``get_args`` is replaced by the
validated namespace of tests/test_arguments.py; everything below it is real: megatron-core's
GPTModel on gloo ranks, the HDP step, the planner, the data loader, the offloader.
"""

from __future__ import annotations

import argparse

import pytest
import torch
from test_arguments import HDP, parse

from megatron_bytescale.data.indexed import DocumentDataset
from megatron_bytescale.errors import ConfigError
from megatron_bytescale.local_world import preload, run_local_world
from megatron_bytescale.megatron import pretrain_hooks as hooks
from megatron_bytescale.megatron.arguments import validate_hdp_args
from megatron_bytescale.planner.contract import MicroBatch, Plan, ring_pieces, whole_piece
from megatron_bytescale.runtime.batch import MicroBatchData

from data_support import build_corpus
from hdp_helpers import step_batch

preload(["megatron.core.models.gpt.gpt_model", "megatron_bytescale.megatron.local_run"])


def hdp_args(*flags, **megatron):
    return validate_hdp_args(parse(HDP + list(flags), **megatron))


@pytest.fixture
def megatron_args(monkeypatch):
    """Make the hooks see ``args`` as Megatron's get_args() would return it."""

    def use(args):
        monkeypatch.setattr(hooks, "_megatron_args", lambda: args)
        return args

    return use


# ---------------------------------------------------------------- arguments and dispatch
def test_validation_runs_right_after_megatron_s_and_wraps_once(tmp_path, capsys):
    calls = []

    def megatron_validate(args, defaults={}):
        calls.append("megatron")
        args.data_parallel_size = 8  # derived by Megatron, read by ours

    wrapped = hooks.validate_args_then_hdp(megatron_validate)
    assert hooks.validate_args_then_hdp(wrapped) is wrapped
    for name in ("corpus", "valid"):  # the wrapper checks that the dataset files exist
        for ext in (".bin", ".idx"):
            (tmp_path / f"{name}{ext}").write_bytes(b"")
    paths = dict(train_data_path=[str(tmp_path / "corpus")], valid_data_path=[str(tmp_path / "valid")])
    args = parse(HDP, data_parallel_size=None, **paths)
    wrapped(args, {})
    assert calls == ["megatron"] and args.hdp_size == 8
    # a wrong launch stops with one line, before any worker trains
    for bad, message in (
        (dict(calculate_per_token_loss=False), "--calculate-per-token-loss"),
        (dict(train_data_path=[str(tmp_path / "missing")]), "missing.bin not found"),
        (dict(world_size=6, tensor_model_parallel_size=4), "world size 6 does not divide"),
    ):
        with pytest.raises(SystemExit) as stop:
            wrapped(parse(HDP, **{**paths, **bad}), {})
        err = capsys.readouterr().err.strip().splitlines()
        assert stop.value.code == 2 and len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


def test_forward_backward_dispatch(megatron_args):
    megatron_schedule = lambda **kw: "megatron"  # noqa: E731
    get = hooks.get_forward_backward_func_or_hdp(lambda: megatron_schedule)
    assert hooks.get_forward_backward_func_or_hdp(get) is get
    megatron_args(parse([]))
    assert get() is megatron_schedule
    megatron_args(hdp_args())
    assert get() is hooks.megatron_forward_backward


def test_extra_args_provider_keeps_the_base_flags():
    def base(parser):
        parser.add_argument("--modelopt-flag", action="store_true")
        return parser

    parser = hooks.extra_args_provider(base)(argparse.ArgumentParser())
    args = parser.parse_args(["--modelopt-flag", "--hybrid-data-parallel"])
    assert args.modelopt_flag and args.hybrid_data_parallel
    assert hooks.extra_args_provider(None)(argparse.ArgumentParser()).parse_args([]).hdp_plan_ahead == 2


# ---------------------------------------------------------------- forward step and loss
def micro_batch(n=5) -> MicroBatchData:
    mb = MicroBatch((whole_piece(0, n, 0),))
    mask = torch.ones(n)
    mask[-1] = 0
    return MicroBatchData(mb, torch.arange(10, 10 + n), torch.arange(11, 11 + n), mask, torch.arange(n))


def test_per_token_loss_is_the_masked_sum_and_its_count():
    losses = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0]])
    loss, count, report = hooks.per_token_loss(mask, losses)
    assert loss.item() == 7.0 and count.item() == 3 and count.dtype == torch.int
    assert report[hooks.LOSS_KEY].tolist() == [7.0, 3.0]


def test_hdp_forward_step_feeds_one_packed_row_with_true_positions():
    seen = {}

    def model(tokens, position_ids, attention_mask, labels=None, loss_mask=None):
        seen.update(tokens=tokens, positions=position_ids, mask=attention_mask, labels=labels, loss_mask=loss_mask)
        return torch.full((1, tokens.shape[1]), 2.0)

    def loss_func(loss_mask, output, model=None):
        return ("pretrain_gpt", loss_mask.sum().item(), output.sum().item(), model is not None)

    output, loss = hooks.hdp_forward_step(iter([micro_batch()]), model, loss_func)
    assert seen["tokens"].tolist() == [[10, 11, 12, 13, 14]] and seen["labels"].tolist() == [[11, 12, 13, 14, 15]]
    assert seen["positions"].tolist() == [[0, 1, 2, 3, 4]] and seen["mask"] is None
    assert loss(output) == ("pretrain_gpt", 4.0, 10.0, True)


def test_forward_step_wrapper_dispatches_and_refuses_schedule_plans(megatron_args):
    base = lambda it, model, return_schedule_plan=False: ("megatron", next(it))  # noqa: E731
    step = hooks.forward_step(base, loss_func=hooks.per_token_loss)
    megatron_args(parse([]))
    assert step(iter(["batch"]), "model") == ("megatron", "batch")
    megatron_args(hdp_args())
    model = lambda tokens, *a, **k: torch.zeros(tokens.shape)  # noqa: E731
    _, loss = step(iter([micro_batch()]), model)
    assert loss(torch.ones(1, 5))[1].item() == 4
    with pytest.raises(ConfigError, match="schedule plans"):
        step(iter([micro_batch()]), model, return_schedule_plan=True)


# ---------------------------------------------------------------- data iterators
@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return build_corpus(tmp_path_factory.mktemp("corpus"))


def data_args(corpus, **megatron):
    settings = dict(
        train_data_path=[corpus],
        valid_data_path=None,
        eval_iters=0,
        seq_length=8192,
        data_parallel_size=2,
        world_size=2,
        seed=5,
    )
    return hdp_args(
        "--hdp-step-tokens", "24K", "--hdp-token-capacity", "4K", "--hdp-plan-ahead", "0", **{**settings, **megatron}
    )


def placement(plan):
    return {k: v for k, v in plan.to_dict().items() if k != "meta"}  # meta holds each rank's planning time


def digest(batch):
    return (batch.step, batch.rank, placement(batch.plan), [mb.tokens.tolist() for mb in batch.micro_batches])


def test_data_iterators_serve_each_rank_its_share_of_one_plan(corpus):
    args = data_args(corpus)
    train0, valid0, test0 = hooks.hdp_data_iterators(args, rank=0)
    train1, _, _ = hooks.hdp_data_iterators(args, rank=1)
    assert valid0 is None and test0 is None
    for _ in range(2):
        a, b = next(train0), next(train1)
        assert (a.rank, b.rank) == (0, 1) and a.step == b.step
        assert placement(a.plan) == placement(b.plan) and a.plan.num_ranks == 2
        assert sum(len(x.micro_batches) for x in (a, b)) == sum(len(a.plan.micro_batches(r)) for r in (0, 1))
        assert sum(s.length for s in a.samples) <= 24 * 1024


def test_resume_fast_forwards_to_the_checkpointed_step(corpus):
    fresh, _, _ = hooks.hdp_data_iterators(data_args(corpus), rank=1)
    expected = [digest(next(fresh)) for _ in range(4)][2:]
    resumed_args = data_args(corpus)
    resumed_args.iteration = 2
    resumed, _, _ = hooks.hdp_data_iterators(resumed_args, rank=1)
    assert [digest(next(resumed)) for _ in range(2)] == expected


def test_plan_ahead_yields_the_same_steps(corpus):
    ahead_args = data_args(corpus)
    ahead_args.hdp_plan_ahead = 2
    ahead, _, _ = hooks.hdp_data_iterators(ahead_args, rank=0)
    plain, _, _ = hooks.hdp_data_iterators(data_args(corpus), rank=0)
    assert [digest(next(ahead)) for _ in range(3)] == [digest(next(plain)) for _ in range(3)]


def test_validation_iterator_and_datasets_provider(corpus, megatron_args, monkeypatch):
    args = megatron_args(data_args(corpus, valid_data_path=[corpus], eval_iters=1))
    monkeypatch.setattr(hooks, "hdp_rank", lambda: 1)
    provider = hooks.datasets_provider(lambda n, vp_stage=None: "megatron datasets")
    assert provider.is_distributed
    train, valid, test = provider([100, 10, 0])
    assert next(train).rank == 1 and next(valid).rank == 1 and test is None
    megatron_args(parse([]))
    assert provider([1, 1, 1]) == "megatron datasets"
    del args


def test_a_blend_reaching_the_loader_takes_tokens_by_weight(corpus):
    """A weighted blend of two prefixes (the same files twice: part 1's documents are numbered
    after part 0's) cut by --split: the training stream takes tokens by weight (within the bound
    of data/blend.py: (parts - 1) x the context length over the run), and a validation stream
    exists where the split gives it a share."""
    args = data_args(corpus, train_data_path=None, data_path=["0.25", corpus, "0.75", corpus], split="90,10,0")
    args.eval_iters = 1
    train, valid, test = hooks.hdp_data_iterators(args, rank=0)
    assert valid is not None and test is None
    first_of_part_1 = round(0.9 * len(DocumentDataset(corpus).lengths))
    taken = [0, 0]
    for _ in range(6):
        for sample in next(train).samples:
            taken[sample.doc_id >= first_of_part_1] += sample.length
    assert abs(taken[1] - 0.75 * sum(taken)) <= args.seq_length, taken
    assert next(valid).samples


# ---------------------------------------------------------------- on gloo ranks
def idle_rank_plan(offload_ratio=0.0) -> Plan:
    """Three ranks, rank 2 with no micro-batch (as tests/test_hdp_step.py)."""
    share = ring_pieces(0, 21, (0, 1))
    ranks = (
        (MicroBatch((share[0],), offload_ratio),),
        (MicroBatch((share[1], whole_piece(1, 6, 1)), offload_ratio),),
        (),
    )
    return Plan(num_ranks=3, capacity=20, num_layers=4, seq_lens=(21, 6), ranks=ranks).validate()


def _megatron_step(rank, world, plan_json, offload):
    """What Megatron's train_step does around forward_backward_func: sum the reported
    [loss, tokens] pairs of this rank's micro-batches, all-reduce them over the DP x CP group."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from test_arguments import HDP, parse

    from megatron_bytescale.megatron import local_run
    from megatron_bytescale.megatron import pretrain_hooks as hooks
    from megatron_bytescale.runtime.step import last_step_stats

    args = parse(
        HDP + (["--hdp-selective-offload"] if offload else []),
        data_parallel_size=world,
        seq_length=20,
        global_batch_size=4 * world,
    )
    hooks._megatron_args = lambda: args
    model, group = local_run.setup_model("tiny", seed=3)
    offloader = hooks._offloader(model)  # what megatron_forward_backward will pass for this model
    if offloader is not None:
        assert len(offloader.layers) == 4 and offloader.keep_last == 2
        offloader.min_tensor_bytes = 0  # the tiny model's activations are below the default threshold
    hdp = parallel_state.get_data_parallel_rank(with_context_parallel=True)
    plan = Plan.from_json(plan_json)
    step = step_batch(plan, hdp)
    fb = hooks.get_forward_backward_func_or_hdp(lambda: None)()
    losses = fb(
        forward_step_func=hooks.forward_step(lambda *a: None, hooks.per_token_loss),
        data_iterator=iter([step]),
        model=[model],
        num_microbatches=1,
        seq_length=20,
        micro_batch_size=1,
        decoder_seq_length=None,
        forward_only=False,
    )
    keys = sorted(losses[0].keys())
    val = torch.vstack([x[hooks.LOSS_KEY].view(-1) for x in losses]).sum(dim=0)
    dist.all_reduce(val, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    grad = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    out = {
        "keys": keys,
        "entries": len(losses),
        "loss": (val[0] / val[1]).item(),
        "tokens": int(val[1].item()),
        "offloaded": last_step_stats().offloaded_bytes,
        "offloader": hooks._offloader(model) is not None,
        "grad": grad,
    }
    local_run.teardown()
    return out


def test_megatron_loss_reduction_holds_with_an_idle_rank():
    outs = run_local_world(_megatron_step, 3, idle_rank_plan().to_json(), False, timeout_s=150)
    assert [o["entries"] for o in outs] == [1, 1, 1]  # the idle rank answers one zero entry
    assert all(o["keys"] == [hooks.LOSS_KEY] for o in outs)
    assert {o["tokens"] for o in outs} == {20 + 5}  # labelled tokens of both sequences
    assert len({round(o["loss"], 6) for o in outs}) == 1
    assert not any(o["offloader"] for o in outs) and not any(o["offloaded"] for o in outs)


def test_selective_offload_is_wired_and_changes_no_gradient():
    plain = run_local_world(_megatron_step, 3, idle_rank_plan(0.5).to_json(), False, timeout_s=150)
    offloaded = run_local_world(_megatron_step, 3, idle_rank_plan(0.5).to_json(), True, timeout_s=150)
    assert all(o["offloader"] for o in offloaded)
    assert offloaded[0]["offloaded"] > 0 and offloaded[2]["offloaded"] == 0
    for a, b in zip(plain, offloaded):
        assert a["loss"] == b["loss"]
        assert all(torch.equal(a["grad"][n], b["grad"][n]) for n in a["grad"])


def _train_from_corpus(rank, world, corpus):
    """Two ranks, each planning for itself from the real loader (as --hdp-dataloader local
    does), run two HDP steps the way Megatron's train_step calls them."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from test_patches_hooks import data_args

    from megatron_bytescale.megatron import local_run
    from megatron_bytescale.megatron import pretrain_hooks as hooks

    args = data_args(corpus)
    args.seq_length, args.hdp_token_capacity, args.hdp_step_tokens = 2048, 1024, 6144
    hooks._megatron_args = lambda: args
    model, group = local_run.setup_model("tiny", seed=3)
    train, _, _ = hooks.hdp_data_iterators(args)  # the rank comes from Megatron's DP x CP group
    fb = hooks.get_forward_backward_func_or_hdp(lambda: None)()
    losses = []
    for _ in range(2):
        out = fb(
            forward_step_func=hooks.forward_step(lambda *a: None, hooks.per_token_loss),
            data_iterator=train,
            model=[model],
            num_microbatches=1,
            seq_length=2048,
            micro_batch_size=1,
            forward_only=False,
        )
        val = torch.vstack([x[hooks.LOSS_KEY].view(-1) for x in out]).sum(dim=0)
        dist.all_reduce(val, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        losses.append((val[0] / val[1]).item())
    local_run.teardown()
    return {"losses": losses}


def test_two_ranks_train_from_independently_planned_deliveries(corpus):
    outs = run_local_world(_train_from_corpus, 2, corpus, timeout_s=300)
    assert outs[0]["losses"] == outs[1]["losses"]
    assert all(5.0 < loss < 7.5 for loss in outs[0]["losses"])  # about ln(512) = 6.2 for an untrained model


# ---------------------------------------------------------------- model provider
def _build(rank, world, position_embedding_type):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.spec_utils import import_module
    from test_arguments import HDP, parse

    from megatron_bytescale.megatron import parallel
    from megatron_bytescale.megatron import pretrain_hooks as hooks
    from megatron_bytescale.megatron.core_attention import HDPCoreAttention
    from megatron_bytescale.megatron.model import load_model, transformer_config
    from megatron_bytescale.megatron.rotary import TruePositionRotaryEmbedding

    args = parse(
        HDP,
        data_parallel_size=1,
        seq_length=8192,
        position_embedding_type=position_embedding_type,
        transformer_impl="local",
    )
    hooks._megatron_args = lambda: args
    parallel.init_parallel()
    spec, arch = load_model("tiny")
    config = transformer_config(spec, arch, dtype=torch.float32, hidden_dropout=0.0)

    def gpt_builder(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
        # what Megatron-LM's gpt_builder does with --spec
        return GPTModel(
            config=config,
            transformer_layer_spec=import_module(args.spec),
            vocab_size=512,
            max_sequence_length=8192,
            position_embedding_type=position_embedding_type,
        )

    model = hooks.model_provider(gpt_builder)(pre_process=True, post_process=True, config=config)
    out = {
        "spec": args.spec,
        "core_attention": {
            type(layer.self_attention.core_attention) is HDPCoreAttention for layer in model.decoder.layers
        },
        "true_rope": isinstance(getattr(model, "rotary_pos_emb", None), TruePositionRotaryEmbedding),
    }
    parallel.destroy_parallel()
    return out


def test_model_provider_builds_hdp_attention_through_megatron_s_spec_hook():
    (out,) = run_local_world(_build, 1, "rope", timeout_s=120)
    assert out == {
        "spec": ["megatron_bytescale.megatron.pretrain_hooks", "HDP_LAYER_SPEC"],
        "core_attention": {True},
        "true_rope": True,
    }
    (out,) = run_local_world(_build, 1, "learned_absolute", timeout_s=120)
    assert out["core_attention"] == {True} and out["true_rope"] is False  # learned positions read position_ids


def test_model_provider_is_megatron_s_own_without_hdp(megatron_args):
    megatron_args(parse([]))
    assert hooks.model_provider(lambda **kw: ("megatron model", kw))(pre_process=True) == (
        "megatron model",
        {"pre_process": True},
    )


def _moe_spec(rank, world):
    from megatron_bytescale.megatron import parallel
    from megatron_bytescale.megatron import pretrain_hooks as hooks
    from megatron_bytescale.megatron.core_attention import HDPCoreAttention
    from megatron_bytescale.megatron.model import load_model, transformer_config

    parallel.init_parallel()
    spec, arch = load_model("tiny")
    config = transformer_config(spec, arch, dtype=torch.float32, num_moe_experts=4, moe_router_topk=2)
    args = hdp_args(num_experts=4, transformer_impl="local", data_parallel_size=1, seq_length=8192)
    block = hooks.hdp_layer_spec(args, config)  # Megatron's MoE decoder block spec, attention swapped
    out = {
        "kind": type(block).__name__,
        "core_attention": [
            layer.submodules.self_attention.submodules.core_attention is HDPCoreAttention for layer in block.layer_specs
        ],
        # a ModuleSpec (core_v0.16) or a functools.partial of the module's class (core_v0.19)
        "mlp": sorted(
            {
                getattr(mlp, "module", getattr(mlp, "func", None)).__name__
                for mlp in (layer.submodules.mlp for layer in block.layer_specs)
            }
        ),
    }
    parallel.destroy_parallel()
    return out


def test_moe_models_get_megatron_s_block_spec_with_hdp_attention():
    (out,) = run_local_world(_moe_spec, 1, timeout_s=120)
    assert out == {"kind": "TransformerBlockSubmodules", "core_attention": [True] * 4, "mlp": ["MoELayer"]}
