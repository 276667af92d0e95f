"""Hybrid Data Parallelism flags for Megatron-LM's ``pretrain_gpt.py``.

``add_hdp_arguments(parser)`` is a Megatron ``extra_args_provider``: it adds one argument
group in Megatron's kebab-case. ``validate_hdp_args(args)`` runs after Megatron's own
``validate_args`` (so derived values such as ``data_parallel_size`` exist), runs the checks
that combine several Megatron flags (``CHECKS``; every single-flag refusal is a row of the flag
table, ``flag_table``, applied before Megatron's validation) with a ConfigError that names the
fix, and resolves the defaults that depend on other flags. ``planner_config_from_args`` /
``cost_model_from_args`` turn the validated flags into what the planner needs.

Nothing here imports Megatron-LM's training package: the validator reads plain attributes,
so it is tested with argparse and a namespace carrying the Megatron flags it reads
(``MEGATRON_ARGS_READ`` lists them; a test checks them against Megatron's real parser).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path

from ..errors import BytescaleError, ConfigError
from ..planner.balance import BALANCE_MODES
from ..planner.specs import HARDWARE_DIR, HardwareSpec, ModelSpec, available, moe_layer_count
from ..units import format_size, parse_size

DATALOADER_CHOICES = ("local", "ray")
DEFAULT_HARDWARE = "h100"
# --hdp-hardware cpu: the shipped CPU profile carried to the model (planner/cpu_profile.py);
# the default where the run has no CUDA device
CPU_HARDWARE = "cpu"


def cpu_ranks_per_core() -> float:
    """Ranks this launch starts on this machine (torchrun's LOCAL_WORLD_SIZE) over the cores
    this process may run on: above 1 they share the cores, and each computes that much slower."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or 1)
    return local / max(1, len(os.sched_getaffinity(0)))


def default_hardware() -> str:
    """What the planner's cost model describes unless told: this machine's kind of device. In a
    rank torch answers; the launcher's checks (``preflight``) run before torch is imported and ask
    the NVIDIA driver's device list instead (the same answer wherever the ranks would see CUDA)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        cuda = torch.cuda.is_available()
    else:
        gpus = Path("/proc/driver/nvidia/gpus")
        cuda = gpus.is_dir() and any(gpus.iterdir())
    return DEFAULT_HARDWARE if cuda else CPU_HARDWARE


# Megatron-LM (core_v0.16.1) attributes the validator, the translators below, pretrain_hooks and
# some of the flag table's rules read (the table's own attributes are checked against every tree's
# parser). tests/test_arguments_megatron.py checks each one exists there; tests/test_arguments.py
# gives each the value a valid GPT run has after Megatron's validate_args.
MEGATRON_ARGS_READ = (
    "attention_dropout",
    "calculate_per_token_loss",
    "eval_interval",
    "train_iters",
    "context_parallel_size",
    "hybrid_context_parallel",
    "max_seqlen_per_dp_cp_rank",
    "micro_batch_size",
    "rampup_batch_size",
    "pipeline_model_parallel_size",
    "microbatch_group_size_per_vp_stage",
    "tensor_model_parallel_size",
    "sequence_parallel",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
    "moe_token_dispatcher_type",
    "overlap_moe_expert_parallel_comm",
    "use_megatron_fsdp",
    "use_torch_fsdp2",
    "cuda_graph_impl",
    "spec",
    "mtp_num_layers",
    "moe_layer_freq",
    "moe_ffn_hidden_size",
    "moe_shared_expert_intermediate_size",
    "kv_lora_rank",
    "q_lora_rank",
    "qk_head_dim",
    "qk_pos_emb_head_dim",
    "v_head_dim",
    "seq_length",
    "dataloader_type",
    "sft",
    "fim_data",
    "fine_grained_activation_offloading",
    "cpu_offloading_num_layers",
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "group_query_attention",
    "num_query_groups",
    "kv_channels",
    "ffn_hidden_size",
    "swiglu",
    "num_experts",
    "moe_router_topk",
    "padded_vocab_size",
    "vocab_size",
    "multi_latent_attention",
    "cache_mla_latents",
    "position_embedding_type",
    "experimental_attention_variant",
    "heterogeneous_layers_config_path",
    "global_batch_size",
    "mock_data",
    "data_path",
    "train_data_path",
    "valid_data_path",
    "test_data_path",
    "data_args_path",
    "per_split_data_args_path",
    "eval_iters",
    "split",
    "tokenizer_type",
    "skip_train",
    "full_validation",
    "multiple_validation_sets",
    "transformer_impl",
    "normalization",
    "qk_layernorm",
    "qk_l2_norm",
    "seed",
    "recompute_granularity",
    "recompute_method",
    "recompute_num_layers",
    "recompute_modules",
)
# set by Megatron's validate_args rather than by a flag of the same name
MEGATRON_DERIVED_ARGS = ("data_parallel_size", "virtual_pipeline_model_parallel_size", "world_size", "iteration")

# our flags and their defaults, for "this flag does nothing without --hybrid-data-parallel"
_HDP_DEFAULTS = {
    "hdp_token_capacity": None,
    "hdp_balance": None,
    "hdp_balance_slack": 0.05,
    "hdp_selective_offload": False,
    "hdp_profile": None,
    "hdp_hardware": None,
    "hdp_host_memory_per_gpu": None,
    "hdp_dataloader": "local",
    "hdp_ray_address": None,
    "hdp_plan_ahead": 2,
    "hdp_ranks_per_node": None,
    "hdp_step_tokens": None,
    "hdp_mock_lengths": None,
    "hdp_ray_servers": 2,
    "hdp_mla_ring": "kv",
    "hdp_accept_data_change": False,
}
# the ring transports (planner/contract/transports.py) a user picks from, or "auto": each ring
# the faster of the two by the cost model (planner.with_cheaper_transports)
MLA_RINGS = ("kv", "latent", "auto")


# ------------------------------------------------------------------ argparse types
def token_count(text: str) -> int:
    """argparse type: a positive token count with an optional K/M/G suffix (8K, 1.5M)."""
    try:
        return parse_size(text, "token count")
    except BytescaleError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {value}")
    return value


def _positive_int(text: str) -> int:
    value = _non_negative_int(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be positive, got 0")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {value}")
    return value


# ------------------------------------------------------------------ the flags
def add_hdp_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron ``extra_args_provider``: add the "hybrid data parallel" group; returns the parser.
    Idempotent: a parser that has the group already (a patched pretrain_gpt.py run through the
    launcher) is returned as it is."""
    if "--hybrid-data-parallel" in parser._option_string_actions:
        return parser
    g = parser.add_argument_group(
        title="hybrid data parallel",
        description="ByteScale Hybrid Data Parallelism (megatron_bytescale): DP x CP flattened into one "
        "dimension; each sequence runs on as many ranks as its length needs.",
    )
    g.add_argument(
        "--hybrid-data-parallel",
        action="store_true",
        help="Train with Hybrid Data Parallelism: the DP ranks form one HDP group; each step a planner "
        "places every sequence of the global batch on 1..HDP-size ranks (ring attention for the long "
        "ones). Needs --calculate-per-token-loss and --micro-batch-size 1.",
    )
    g.add_argument(
        "--hdp-token-capacity",
        type=token_count,
        default=None,
        metavar="TOKENS",
        help="Tokens one rank holds per micro-batch (the capacity C), e.g. 8K or 16384. Required with "
        "--hybrid-data-parallel. Shorter sequences are packed up to C; a longer one is split over about "
        "ceil(len / C) ranks.",
    )
    g.add_argument(
        "--hdp-step-tokens",
        type=token_count,
        default=None,
        metavar="TOKENS",
        help="Tokens per training step (the global batch, summed over all HDP ranks), e.g. 4M. A step "
        "takes whole documents (cut at --seq-length) until this budget is reached. Default: "
        "--global-batch-size x --seq-length, the token count of a fixed-length Megatron step.",
    )
    g.add_argument(
        "--hdp-balance",
        choices=BALANCE_MODES,
        default=None,
        help="Balance scheduler: 'dp' (ranks run sequences of one length level at a time), 'pp' (each "
        "pipeline gets micro-batches of similar length: the one for pipeline parallelism) or 'none' "
        "(plain packing). Default: dp (pp with pipeline parallelism).",
    )
    g.add_argument(
        "--hdp-balance-slack",
        type=_fraction,
        default=_HDP_DEFAULTS["hdp_balance_slack"],
        metavar="FRACTION",
        help="Balance tolerance: a rank whose estimated time is within this fraction of the slowest "
        "rank gets no more work (default 0.05).",
    )
    g.add_argument(
        "--hdp-selective-offload",
        action="store_true",
        help="Selective activation offloading: a rank may hold more than C tokens of a long sequence by "
        "copying part of its activations to host memory while attention computes, so the sequence needs "
        "fewer ranks. GPU only (CUDA streams, pinned memory).",
    )
    g.add_argument(
        "--hdp-profile",
        default=None,
        metavar="FILE",
        help="Cost-model profile (YAML/JSON, written by `bytescale profile` on the target GPUs). Default: "
        "an analytic cost model from the model flags and --hdp-hardware.",
    )
    g.add_argument(
        "--hdp-hardware",
        default=None,
        metavar="NAME|FILE",
        help=f"Hardware spec for the analytic cost model: one of {', '.join(available(HARDWARE_DIR, '.yaml'))} "
        f"or a YAML file, or {CPU_HARDWARE} (the shipped CPU profile, configs/profiles/tiny-cpu.json, carried to "
        f"the model). Default: {DEFAULT_HARDWARE} on GPUs, {CPU_HARDWARE} where there is no CUDA device. Not used "
        "with --hdp-profile.",
    )
    g.add_argument(
        "--hdp-host-memory-per-gpu",
        type=token_count,  # the same K/M/G suffixes, read as bytes
        default=None,
        metavar="BYTES",
        help="Pinned host memory per GPU the planner may fill with offloaded activations, e.g. 64G "
        "(default: the profile's or the hardware spec's host_memory_bytes).",
    )
    g.add_argument(
        "--hdp-dataloader",
        choices=DATALOADER_CHOICES,
        default=_HDP_DEFAULTS["hdp_dataloader"],
        help="'local': every rank reads the step's sequence lengths and plans for itself (deterministic, "
        "no extra processes); 'ray': Ray actors read and plan, each rank pulls only its own micro-batches "
        "(needs the `ray` extra). Default local.",
    )
    g.add_argument(
        "--hdp-ray-address",
        default=None,
        metavar="ADDRESS",
        help="Address of a running Ray cluster for --hdp-dataloader ray (passed to ray.init; RAY_ADDRESS "
        "works too). Without one, a single-rank run starts Ray itself; several ranks need a shared cluster.",
    )
    g.add_argument(
        "--hdp-ray-servers",
        type=_positive_int,
        default=_HDP_DEFAULTS["hdp_ray_servers"],
        metavar="N",
        help="Ray document-server actors for --hdp-dataloader ray (each reads a shard of the documents). Default 2.",
    )
    g.add_argument(
        "--hdp-plan-ahead",
        type=_non_negative_int,
        default=_HDP_DEFAULTS["hdp_plan_ahead"],
        metavar="K",
        help="Plan this many steps ahead of training, in a background process (local loader) or in the Ray "
        "scheduler, overlapping planning with compute (0: plan each step when it starts, in the training "
        "process; the Ray loader plans at least one ahead). Default 2.",
    )
    g.add_argument(
        "--hdp-mock-lengths",
        default=None,
        metavar="DISTRIBUTION",
        help="Length distribution of --mock-data documents (cut to --seq-length): 'byted', 'github' (the "
        "simulator's workloads), a workload YAML, or 'lognormal[:mean=1K,sigma=1.5,min=128,max=8K]' (the default, "
        "as Megatron's dynamic-CP benchmark draws its mock lengths).",
    )
    g.add_argument(
        "--hdp-accept-data-change",
        action="store_true",
        help="Resume although what determines the data stream (--hdp-step-tokens, --seq-length, --seed, the "
        "dataset) differs from what the checkpoint recorded, which is otherwise refused: with the same order "
        "(another step size or sequence length) the stream continues where the checkpoint left it; with "
        "another seed or dataset the new stream starts at its beginning.",
    )
    g.add_argument(
        "--hdp-ranks-per-node",
        type=_positive_int,
        default=None,
        metavar="N",
        help="HDP ranks that share a node (rings inside a node use the fast link in the cost model). "
        "Default: min(data-parallel size, LOCAL_WORLD_SIZE / tensor-parallel size).",
    )
    g.add_argument(
        "--hdp-mla-ring",
        choices=MLA_RINGS,
        default=_HDP_DEFAULTS["hdp_mla_ring"],
        help="With --multi-latent-attention, what a long sequence's ring carries: 'kv', each layer's K and V "
        "(heads x (qk + rope + v head dims) values per token, as Megatron's context parallelism sends them), or "
        "'latent', the compressed KV latent and the rotary key (kv-lora-rank + rope dims per token, whatever "
        "the heads; each member re-expands K and V, a GEMM per ring step), or 'auto', each ring the faster of "
        "the two by the cost model. All are exact. Default kv. Two-level rings carry K and V either way.",
    )
    return parser


def chain_extra_args_providers(
    *providers: Callable[[argparse.ArgumentParser], argparse.ArgumentParser] | None,
) -> Callable[[argparse.ArgumentParser], argparse.ArgumentParser]:
    """One ``extra_args_provider`` that applies several (None entries are skipped), e.g.
    ``chain_extra_args_providers(add_modelopt_args, add_hdp_arguments)``."""
    chosen = [p for p in providers if p is not None]

    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        for p in chosen:
            parser = p(parser)
        return parser

    return provider


# ------------------------------------------------------------------ validation
def validate_hdp_args(args: argparse.Namespace) -> argparse.Namespace:
    """Check HDP flags against Megatron's (after Megatron's validate_args) and resolve defaults.

    Without --hybrid-data-parallel it only refuses HDP flags that would have no effect. With it,
    it runs the checks that combine several flags (``CHECKS``, which the flag table names), then
    sets ``hdp_balance``, ``hdp_hardware``, ``hdp_ranks_per_node``, ``hdp_size`` and
    ``hdp_step_tokens`` and ``dataloader_type = 'external'`` (the HDP loader hands Megatron ready
    micro-batches). The flag table's refusals of single flags (``flag_table.refuse``) judge the
    values as given, before Megatron's validate_args fills its own defaults in (it sets --split,
    for one): the launcher and ``pretrain_hooks.validate_args_then_hdp`` run them first.
    """
    if not args.hybrid_data_parallel:
        stray = [name for name, default in _HDP_DEFAULTS.items() if getattr(args, name, default) != default]
        if stray:
            flags = ", ".join("--" + name.replace("_", "-") for name in stray)
            raise ConfigError(f"{flags} only apply with --hybrid-data-parallel: add it, or drop them")
        return args

    for check in CHECKS.values():
        check(args)
    _check_pipeline_balance(args)
    _check_ray(args)
    _resolve(args)
    _check_capacity(args)
    return args


def hdp_option_strings() -> set[str]:
    """The option strings of the HDP group (not Megatron's: the flag table does not list them)."""
    return {o for a in add_hdp_arguments(argparse.ArgumentParser(add_help=False))._actions for o in a.option_strings}


def check_global_batch(args) -> None:
    """What Megatron's micro-batch calculator asserts (num_microbatches_calculator.py:340), as one
    line: under HDP it still counts --global-batch-size / data-parallel-size samples per rank, and
    the LR schedule and consumed samples follow that count. Run before Megatron's validate_args
    (``pretrain_hooks.validate_args_then_hdp``: core_v0.19's asserts the same of its evaluation
    batch) and by the launcher; an elastic restart on fewer ranks meets it."""
    dp = getattr(args, "data_parallel_size", None)
    if not dp:  # before Megatron's validate_args derives it (core_v0.19 asserts on it there)
        world = getattr(args, "world_size", None) or int(os.environ.get("WORLD_SIZE", "1"))
        dp = world // (
            getattr(args, "tensor_model_parallel_size", 1) * getattr(args, "pipeline_model_parallel_size", 1)
        )
    if dp and getattr(args, "global_batch_size", None) and args.global_batch_size % dp:
        raise ConfigError(
            f"--global-batch-size {args.global_batch_size} does not divide by the {dp} HDP ranks: Megatron counts "
            f"global-batch-size / data-parallel-size samples per rank (the LR schedule and consumed samples follow "
            f"it); choose a --global-batch-size that every world you train or restart on divides (e.g. "
            f"{math.lcm(*range(max(1, dp - 2), dp + 1)) if dp > 2 else 2 * dp} for {max(1, dp - 2)}-{dp} ranks)"
        )


def _check_virtual_stage_groups(args) -> None:
    """Megatron's interleaved schedule runs micro-batches in groups of this size per model chunk
    (unused without virtual stages). The HDP step chooses each step's chunk orders itself
    (groups of pp, or slot-aligned orders) and the capacity is sized for what groups of pp hold
    in flight, so another size would silently not be used: it is refused instead."""
    pp, vpp = args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size
    group = getattr(args, "microbatch_group_size_per_vp_stage", None)
    if vpp is not None and vpp > 1 and group is not None and group != pp:
        raise ConfigError(
            f"--microbatch-group-size-per-virtual-pipeline-stage {group}: the HDP step picks each step's "
            f"chunk order itself (Megatron's groups of --pipeline-model-parallel-size {pp} micro-batches, or "
            'a slot-aligned order; docs/design.md, "Virtual pipeline stages"); drop the flag'
        )


def _check_pipeline_balance(args) -> None:
    pp = args.pipeline_model_parallel_size
    if pp > 1 and args.hdp_balance == "dp":
        raise ConfigError(
            f"--hdp-balance dp with --pipeline-model-parallel-size {pp}: DP-balance gives pipelines "
            "micro-batches of different lengths back to back, so stages bubble; use --hdp-balance pp"
        )


def _check_expert_parallel(args) -> None:
    """--expert-model-parallel-size > 1 is supported through aligned micro-batch slots per EP
    group (planner/expert/slots.py): empty slots join the all-to-alls of megatron-core's
    all-to-all token dispatcher (tested) and of the flex dispatcher, whose DeepEP / HybridEP /
    NCCL EP kernels exchange any number of tokens per member as the all-to-all does (CUDA
    only: scripts/gpu/ checks it); the allgather dispatcher is refused. With pipelines the
    slots are numbered over all pipelines (planner/expert/pipelines.py)."""
    ep = args.expert_model_parallel_size
    if ep <= 1:
        return
    # --moe-enable-deepep is Megatron's older spelling of the flex dispatcher with DeepEP
    dispatcher = "flex" if getattr(args, "moe_enable_deepep", False) else args.moe_token_dispatcher_type
    if dispatcher == "allgather":
        raise ConfigError(
            f"--moe-token-dispatcher-type allgather with --expert-model-parallel-size {ep}: that dispatcher gathers "
            "equal-sized token blocks from every expert-parallel member, and HDP micro-batches hold different "
            "numbers of tokens on each: use --moe-token-dispatcher-type alltoall (or flex on GPUs)"
        )
    if dispatcher == "flex":
        _check_flex_backend(args)
    etp = args.expert_tensor_parallel_size
    if etp is not None and etp != args.tensor_model_parallel_size:
        raise ConfigError(
            f"--expert-tensor-parallel-size {etp} differs from --tensor-model-parallel-size "
            f"{args.tensor_model_parallel_size}: HDP's EP groups are blocks of HDP ranks only when they "
            "match; drop --expert-tensor-parallel-size"
        )


def _check_flex_backend(args) -> None:
    """The flex dispatcher runs only where its kernels can: CUDA GPUs with DeepEP (the deep_ep
    package, also HybridEP's) or, for the ncclep backend, Transformer Engine's EP module."""
    backend = getattr(args, "moe_flex_dispatcher_backend", None) or "deepep"
    if default_hardware() == CPU_HARDWARE:
        raise ConfigError(
            f"--moe-token-dispatcher-type flex ({backend}) runs CUDA kernels and this machine has no GPU: use "
            "--moe-token-dispatcher-type alltoall here (HDP aligns the same expert-parallel slots for both)"
        )
    module, package = ("transformer_engine", "Transformer Engine") if backend == "ncclep" else ("deep_ep", "DeepEP")
    if importlib.util.find_spec(module) is None:
        raise ConfigError(
            f"--moe-token-dispatcher-type flex with the {backend} backend needs {package} ({module}) installed: "
            "install it, or use --moe-token-dispatcher-type alltoall"
        )


def _check_mla(args) -> None:
    """Multi-latent attention: what the ring cannot honour, and --hdp-mla-ring without MLA."""
    if not args.multi_latent_attention:
        if args.hdp_mla_ring != _HDP_DEFAULTS["hdp_mla_ring"]:
            raise ConfigError(
                f"--hdp-mla-ring {args.hdp_mla_ring} without --multi-latent-attention: only multi-latent attention "
                "has a latent to carry; drop --hdp-mla-ring"
            )
        return
    fused_norm = getattr(args, "transformer_impl", "transformer_engine") == "transformer_engine" and getattr(
        args, "qk_layernorm", False
    )
    if args.hdp_mla_ring in ("latent", "auto") and fused_norm:
        raise ConfigError(
            f"--hdp-mla-ring {args.hdp_mla_ring} with --qk-layernorm and --transformer-impl transformer_engine: TE "
            "fuses the KV latent's norm into the up-projection, so no member can re-expand the normed latent; use "
            "--hdp-mla-ring kv (or --transformer-impl local)"
        )


def _check_mtp(args) -> None:
    """Multi-token prediction runs with and without pipelines (its layers on the last stage,
    which Megatron gives the input ids); with virtual stages it is refused, untested."""
    chunks = getattr(args, "virtual_pipeline_model_parallel_size", None) or 1
    if args.mtp_num_layers and chunks > 1:
        raise ConfigError(
            f"--mtp-num-layers with {chunks} virtual pipeline stages: HDP runs multi-token prediction with "
            "pipelines of one model chunk per stage; drop --num-layers-per-virtual-pipeline-stage"
        )


def _check_data(args) -> None:
    """Megatron's data flags under HDP: blends (``--data-path W1 P1 ...``, the per-split paths,
    ``--data-args-path``, ``--per-split-data-args-path``), ``--split``, ``--mock-data`` and
    ``--sft`` are read by ``data_config.data_config_from_args`` and honoured; what stays refused
    is refused here (combinations) or by the flag table (single flags), each in one line naming the fix."""
    from .data_config import data_config_from_args

    if args.sft and args.mock_data:
        raise ConfigError("--sft with --mock-data: HDP's mock data are pretraining documents; drop one of them")
    if args.hdp_mock_lengths is not None and not args.mock_data:
        raise ConfigError("--hdp-mock-lengths draws the lengths of --mock-data documents: add --mock-data, or drop it")
    if args.sft and getattr(args, "tokenizer_type", "SFTTokenizer") != "SFTTokenizer":
        raise ConfigError(
            f"--sft with --tokenizer-type {args.tokenizer_type}: Megatron's SFT data are conversations that "
            "SFTTokenizer renders and masks: pass --tokenizer-type SFTTokenizer --tokenizer-model HF_DIR "
            "(and --sft-tokenizer-prompt-format)"
        )
    if args.sft and args.hdp_dataloader == "ray":
        raise ConfigError(
            "--sft runs with the local data loader (it tokenizes on every rank): use --hdp-dataloader local"
        )
    if args.mock_data and (args.data_path or args.train_data_path):
        raise ConfigError("--mock-data with a data path: Megatron's mock data replace the datasets; drop one of them")
    config = data_config_from_args(args)
    if config.train is None and not args.skip_train:
        raise ConfigError(
            "no training data: pass --data-path [W1] PREFIX1 [W2 PREFIX2 ...] (or --train-data-path, "
            "--data-args-path, --per-split-data-args-path), or --mock-data"
        )
    if args.eval_iters > 0 and config.valid is None and not args.skip_train:
        fix = (
            f"--split {config.split} gives validation no share: give it one (e.g. --split 969,30,1)"
            if config.split is not None
            else "pass --valid-data-path VALID (or a valid list in --per-split-data-args-path)"
        )
        raise ConfigError(f"--eval-iters {args.eval_iters} but no validation data: {fix}, or --eval-iters 0")
    if args.eval_interval is None and not args.skip_train and not args.full_validation:
        # core_v0.16.1 training.py:3307 computes train_iters // eval_interval before iteration 1
        raise ConfigError(
            f"--eval-iters {args.eval_iters} without --eval-interval: Megatron divides --train-iters by "
            "--eval-interval when it sizes the validation set (also with --eval-iters 0); add --eval-interval N "
            f"(e.g. --eval-interval {args.train_iters or 1000})"
        )


def _check_eval_batch(args) -> None:
    """core_v0.19's --eval-global-batch-size (absent in core_v0.16: read with a default)."""
    eval_batch = getattr(args, "eval_global_batch_size", None)
    if eval_batch is not None and eval_batch != args.global_batch_size:
        raise ConfigError(
            f"--eval-global-batch-size {eval_batch}: an HDP validation step holds --hdp-step-tokens tokens, as "
            "a training step does: drop it"
        )


# The refusals that combine several flags, by the name megatron_flags.tsv gives them ('check:NAME'
# rules); every other refusal of a Megatron flag is a row's rule and message in the table.
CHECKS = {
    "global_batch": check_global_batch,
    "virtual_stage_groups": _check_virtual_stage_groups,
    "expert_parallel": _check_expert_parallel,
    "data": _check_data,
    "mla": _check_mla,
    "mtp": _check_mtp,
    "eval_batch": _check_eval_batch,
}


def _check_ray(args) -> None:
    if args.hdp_dataloader != "ray" and (
        args.hdp_ray_address is not None or args.hdp_ray_servers != _HDP_DEFAULTS["hdp_ray_servers"]
    ):
        raise ConfigError(
            "--hdp-ray-address / --hdp-ray-servers only apply with --hdp-dataloader ray: add that, or drop them"
        )
    if args.hdp_dataloader == "ray":
        try:
            import ray  # noqa: F401
        except ImportError:
            raise ConfigError(
                "--hdp-dataloader ray needs Ray: pip install 'megatron_bytescale[ray]' (or use --hdp-dataloader local)"
            ) from None
        if args.world_size > 1 and not (args.hdp_ray_address or os.environ.get("RAY_ADDRESS")):
            raise ConfigError(
                "--hdp-dataloader ray with several ranks needs one Ray cluster they all join: start it "
                "(`ray start --head` on one node) and pass --hdp-ray-address HOST:PORT (or set RAY_ADDRESS)"
            )


def _resolve(args) -> None:
    """Fill the defaults that depend on other flags."""
    if args.hdp_token_capacity is None:
        raise ConfigError(
            "--hybrid-data-parallel needs --hdp-token-capacity: the tokens one rank holds per micro-batch "
            "(for example 8K; what fits in GPU memory for this model at this TP/PP)"
        )
    if args.hdp_balance is None:
        args.hdp_balance = "pp" if args.pipeline_model_parallel_size > 1 else "dp"
    if args.hdp_profile is not None:
        if args.hdp_hardware is not None:
            raise ConfigError("--hdp-hardware only builds the analytic cost model; --hdp-profile replaces it: keep one")
        if not Path(args.hdp_profile).is_file():
            raise ConfigError(f"--hdp-profile {args.hdp_profile}: no such file (write one with `bytescale profile`)")
    else:
        args.hdp_hardware = args.hdp_hardware or default_hardware()
        if args.hdp_hardware != CPU_HARDWARE:
            HardwareSpec.load(args.hdp_hardware)  # unknown names and malformed files fail here, with the choices
    args.hdp_size = args.data_parallel_size  # DP x CP with CP = 1 (checked above)
    if args.hdp_step_tokens is None:
        args.hdp_step_tokens = args.global_batch_size * args.seq_length
    if args.hdp_ranks_per_node is None:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
        if not local:
            local = (
                HardwareSpec.load(args.hdp_hardware).gpus_per_node
                if args.hdp_hardware and args.hdp_hardware != CPU_HARDWARE
                else 8
            )
        args.hdp_ranks_per_node = max(1, min(args.hdp_size, local // args.tensor_model_parallel_size))
    args.dataloader_type = "external"


def _check_capacity(args) -> None:
    """--seq-length is the longest sequence the loader yields; it must fit in a step and on the
    HDP group."""
    if args.hdp_step_tokens < args.seq_length:
        raise ConfigError(
            f"--hdp-step-tokens {format_size(args.hdp_step_tokens)} is below --seq-length "
            f"{format_size(args.seq_length)}: a step must hold the longest sequence; raise it or lower --seq-length"
        )
    most = args.hdp_size * args.hdp_token_capacity
    if args.seq_length > most and not args.hdp_selective_offload:
        raise ConfigError(
            f"--seq-length {format_size(args.seq_length)} does not fit on {args.hdp_size} HDP ranks x "
            f"--hdp-token-capacity {format_size(args.hdp_token_capacity)} = {format_size(most)} tokens: raise "
            "the capacity, use more data-parallel ranks, add --hdp-selective-offload, or lower --seq-length"
        )
    if args.seq_length > most:  # offloading: the planner's own memory floor (a restart may bring fewer ranks)
        from ..planner.fields import FieldMessage
        from ..planner.sizing.offload import host_capacity
        from ..planner.sizing.rings import memory_floor

        cost = cost_model_from_args(argparse.Namespace(**{"padded_vocab_size": None, **vars(args)}))
        try:
            memory_floor(
                args.seq_length,
                args.hdp_token_capacity,
                cost,
                True,
                args.hdp_size,
                host_capacity(cost, args.pipeline_model_parallel_size),
            )
        except FieldMessage as exc:  # the planner names its fields: spelled as the HDP flags
            flags = {"capacity": "--hdp-token-capacity", "host_memory_bytes": "--hdp-host-memory-per-gpu"}
            raise ConfigError(
                f"--seq-length {format_size(args.seq_length)} does not fit even with full offload: {exc.named(flags)}"
            ) from None


def check_launch(args) -> None:
    """What Megatron's validate_args asserts about the world size, as a one-line error."""
    world = getattr(args, "world_size", None) or int(os.environ.get("WORLD_SIZE", "1"))
    tp, pp = getattr(args, "tensor_model_parallel_size", 1), getattr(args, "pipeline_model_parallel_size", 1)
    if world < tp * pp:  # e.g. an elastic restart on fewer nodes than one model replica spans
        raise ConfigError(
            f"world size {world} is smaller than one model replica: --tensor-model-parallel-size {tp} x "
            f"--pipeline-model-parallel-size {pp} = {tp * pp} ranks; start at least {tp * pp} ranks (a multiple of "
            f"{tp * pp}) or lower TP/PP"
        )
    if world % (tp * pp):
        raise ConfigError(
            f"world size {world} does not divide by --tensor-model-parallel-size {tp} x "
            f"--pipeline-model-parallel-size {pp}: start a multiple of {tp * pp} ranks or change the sizes"
        )


def check_data_exists(args) -> None:
    """Every file the HDP loader will open exists: each prefix's PREFIX.bin and PREFIX.idx (as
    Megatron's tools/preprocess_data.py or `bytescale prepare-data` write them), each --sft JSONL."""
    from .data_config import data_config_from_args

    for what, path in data_config_from_args(args).paths():
        if getattr(args, "sft", False):
            if not os.path.isfile(path):
                raise ConfigError(f"{what} {path}: no such file (--sft reads a JSONL of conversations)")
            continue
        missing = [ext for ext in (".bin", ".idx") if not os.path.isfile(path + ext)]
        if missing:
            raise ConfigError(
                f"{what} {path}: {path}{missing[0]} not found; give the prefix of a Megatron indexed dataset "
                f"(tools/preprocess_data.py --output-prefix, or `bytescale prepare-data --output {path} ...`)"
            )


def check_schedule(args) -> None:
    """Megatron's learning-rate scheduler asserts warm-up < decay steps (in every rank, a minute in,
    optimizer_param_scheduler.py:157); the same rule as one line."""
    train, warmup = getattr(args, "train_iters", None), getattr(args, "lr_warmup_iters", 0) or 0
    if train is None or getattr(args, "lr_warmup_fraction", None) is not None or getattr(args, "lr_warmup_samples", 0):
        return
    decay = getattr(args, "lr_decay_iters", None) or train
    if warmup >= decay:
        flag = "--lr-decay-iters" if getattr(args, "lr_decay_iters", None) else "--train-iters"
        raise ConfigError(
            f"--lr-warmup-iters {warmup} is not below {flag} {decay}: the learning rate would never decay; "
            f"lower --lr-warmup-iters (e.g. {max(0, decay // 10)}) or raise {flag}"
        )


# ------------------------------------------------------------------ flags -> planner inputs
def model_spec_from_args(args) -> ModelSpec:
    """The model shape as Megatron resolved it (kv_channels and ffn_hidden_size filled in)."""
    heads = args.num_attention_heads
    groups = args.num_query_groups if args.group_query_attention and args.num_query_groups else heads
    kv_channels = args.kv_channels or args.hidden_size // heads
    return ModelSpec(
        name="megatron-args",
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=kv_channels,
        ffn_hidden_size=args.ffn_hidden_size or 4 * args.hidden_size,
        vocab_size=args.padded_vocab_size or args.vocab_size or 0,
        swiglu=bool(args.swiglu),
        num_experts=args.num_experts or 0,
        moe_router_topk=args.moe_router_topk if args.num_experts else 1,
        **_moe_fields(args),
        **_mla_fields(args),
        mtp_num_layers=args.mtp_num_layers or 0,
    )


def _moe_fields(args) -> dict:
    """A MoE model's expert and shared-expert widths and its dense layers (Megatron's parsed
    --moe-layer-freq: an int k, every k-th layer, or a 0/1 list per layer)."""
    if not args.num_experts:
        return {}
    moe_layers = moe_layer_count(args.moe_layer_freq, args.num_layers, "megatron-args")
    return dict(
        moe_ffn_hidden_size=args.moe_ffn_hidden_size or 0,
        moe_shared_expert_size=args.moe_shared_expert_intermediate_size or 0,
        dense_layers=args.num_layers - moe_layers,
    )


def _mla_fields(args) -> dict:
    """Multi-latent attention's sizes: what its ring transports carry (ModelSpec.ring_values_per_token)."""
    if not args.multi_latent_attention:
        return {}
    names = ("kv_lora_rank", "q_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")
    return {name: getattr(args, name) or 0 for name in names}


def cost_model_from_args(args):
    """The profile if given, else the shipped CPU profile (``--hdp-hardware cpu``, the default
    without CUDA) or the analytic model for these flags on --hdp-hardware; either way under
    the run's activation recompute flags (a profile is measured without recompute)."""
    from ..planner.cost_model import CostModel

    if args.hdp_profile is not None:
        cost = CostModel.from_profile(args.hdp_profile)
    elif (args.hdp_hardware or default_hardware()) == CPU_HARDWARE:
        from ..planner.cpu_profile import cpu_cost_model

        cost = cpu_cost_model(
            model_spec_from_args(args),
            tp=args.tensor_model_parallel_size,
            pp=args.pipeline_model_parallel_size,
            ranks_per_core=cpu_ranks_per_core(),
        )
    else:
        cost = CostModel.analytic(
            model_spec_from_args(args),
            HardwareSpec.load(args.hdp_hardware or DEFAULT_HARDWARE),
            tp=args.tensor_model_parallel_size,
            pp=args.pipeline_model_parallel_size,
            sequence_parallel=bool(args.sequence_parallel) or args.tensor_model_parallel_size == 1,
        )
    cost = cost.with_recompute(
        args.recompute_granularity, args.recompute_method, args.recompute_num_layers, args.recompute_modules
    )
    host = getattr(args, "hdp_host_memory_per_gpu", None)
    return cost if host is None else cost.with_overrides(host_memory_bytes=float(host))


def planner_config_from_args(args):
    """The PlannerConfig for validated args (call validate_hdp_args first)."""
    from ..planner.planner import PlannerConfig

    return PlannerConfig(
        num_ranks=args.hdp_size,
        capacity=args.hdp_token_capacity,
        ranks_per_node=args.hdp_ranks_per_node,
        balance=args.hdp_balance,
        slack=args.hdp_balance_slack,
        offload=args.hdp_selective_offload,
        pipeline_stages=args.pipeline_model_parallel_size,
        virtual_stages=args.virtual_pipeline_model_parallel_size or 1,
        expert_parallel=args.expert_model_parallel_size,
        ring_transport=args.hdp_mla_ring if args.multi_latent_attention else "kv",
    )
