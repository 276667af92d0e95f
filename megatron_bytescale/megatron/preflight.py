"""The checks a launcher runs once, before any rank starts: ``validate_hdp_args`` on the command
line it is about to hand to torchrun (or srun), without importing torch or Megatron-LM.

Importing Megatron's argument parser costs seconds (it pulls in torch and megatron-core), so the
launcher reads the few Megatron flags the HDP validator needs with a parser of its own:
``MEGATRON_FLAGS`` lists each with Megatron's (core_v0.16.1) type and default, and
tests/test_arguments_megatron.py compares the table with Megatron's real parser. Flags it does
not know are left alone (Megatron's own parser still reads them in the ranks); the values
Megatron's validate_args derives (data-parallel size, default global batch, virtual stages) are
derived here the same way. The ranks still run the full validation: this is the early copy of
what can be known from the command line, so a wrong launch ends in one line within a second.
"""

from __future__ import annotations

import argparse
import sys

from ..errors import ConfigError
from ..folder_lock import HeartbeatLock
from .arguments import (
    add_hdp_arguments,
    check_data_exists,
    check_launch,
    check_schedule,
    validate_hdp_args,
)
from .checkpoint_guard import check_overwrite
from .data_stream import check_before_launch

# (flag, kind, Megatron's default); kind: int, float, str, list (nargs='*'), ints3 (nargs=3), true (store_true)
MEGATRON_FLAGS = (
    ("--tensor-model-parallel-size", "int", 1),
    ("--pipeline-model-parallel-size", "int", 1),
    ("--context-parallel-size", "int", 1),
    ("--sequence-parallel", "true", False),
    ("--max-seqlen-per-dp-cp-rank", "int", None),
    ("--hybrid-context-parallel", "true", False),
    ("--expert-model-parallel-size", "int", 1),
    ("--expert-tensor-parallel-size", "int", None),
    ("--overlap-moe-expert-parallel-comm", "true", False),
    ("--moe-token-dispatcher-type", "str", "allgather"),
    ("--cpu-offloading-num-layers", "int", 0),
    ("--fine-grained-activation-offloading", "true", False),
    ("--num-layers", "int", None),
    ("--mtp-num-layers", "int", None),
    ("--attention-dropout", "float", 0.1),
    ("--calculate-per-token-loss", "true", False),
    ("--multi-latent-attention", "true", False),
    ("--cache-mla-latents", "true", False),
    ("--qk-layernorm", "true", False),
    ("--transformer-impl", "str", "transformer_engine"),
    ("--experimental-attention-variant", "str", None),
    ("--position-embedding-type", "str", "learned_absolute"),
    ("--heterogeneous-layers-config-path", "str", None),
    ("--spec", "list", None),
    ("--enable-cuda-graph", "true", False),
    ("--external-cuda-graph", "true", False),
    ("--cuda-graph-impl", "str", "none"),
    ("--use-megatron-fsdp", "true", False),
    ("--use-torch-fsdp2", "true", False),
    ("--overlap-param-gather", "true", False),
    ("--num-layers-per-virtual-pipeline-stage", "int", None),
    ("--num-virtual-stages-per-pipeline-rank", "int", None),
    ("--pipeline-model-parallel-layout", "str", None),
    ("--microbatch-group-size-per-virtual-pipeline-stage", "int", None),
    ("--micro-batch-size", "int", None),
    ("--global-batch-size", "int", None),
    ("--rampup-batch-size", "ints3", None),
    ("--seq-length", "int", None),
    ("--train-iters", "int", None),
    ("--train-samples", "int", None),
    ("--lr-decay-iters", "int", None),
    ("--lr-warmup-iters", "int", 0),
    ("--lr-warmup-fraction", "float", None),
    ("--lr-warmup-samples", "int", 0),
    ("--dataloader-type", "str", None),
    ("--data-path", "list", None),
    ("--train-data-path", "list", None),
    ("--valid-data-path", "list", None),
    ("--test-data-path", "list", None),
    ("--data-args-path", "str", None),
    ("--per-split-data-args-path", "str", None),
    ("--split", "str", None),
    ("--tokenizer-type", "str", None),
    ("--mock-data", "true", False),
    ("--sft", "true", False),
    ("--fim-data", "true", False),
    ("--eval-iters", "int", 100),
    ("--eval-interval", "int", None),
    ("--skip-train", "true", False),
    ("--full-validation", "true", False),
    ("--multiple-validation-sets", "true", False),
    ("--seed", "int", 1234),
    ("--save", "str", None),
    ("--load", "str", None),
    ("--finetune", "true", False),
)


# the flags whose attribute Megatron names otherwise than argparse would (a config dataclass field)
MEGATRON_DESTS = {"--microbatch-group-size-per-virtual-pipeline-stage": "microbatch_group_size_per_vp_stage"}


class _OneLineParser(argparse.ArgumentParser):
    """argparse, but a refusal is a ConfigError (one line), not usage text and exit 2."""

    def error(self, message):
        raise ConfigError(message)


def parse(flags: list[str]) -> argparse.Namespace:
    """The Megatron flags of ``MEGATRON_FLAGS`` and the HDP group from a pretrain_gpt.py command line."""
    parser = _OneLineParser(prog="pretrain_gpt.py", add_help=False, allow_abbrev=False)
    for flag, kind, default in MEGATRON_FLAGS:
        dest = MEGATRON_DESTS.get(flag, flag[2:].replace("-", "_"))  # argparse's own name, but where Megatron's differs
        if kind == "true":
            parser.add_argument(flag, action="store_true", dest=dest)
        elif kind == "list":
            parser.add_argument(flag, nargs="*", default=default, dest=dest)
        elif kind == "ints3":
            parser.add_argument(flag, nargs=3, type=int, default=default, dest=dest)
        else:
            parser.add_argument(flag, type={"int": int, "float": float, "str": str}[kind], default=default, dest=dest)
    add_hdp_arguments(parser)
    args, _unknown = parser.parse_known_args(flags)
    return args


def derive(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """What Megatron's validate_args sets before validate_hdp_args reads it."""
    args.world_size, args.rank, args.iteration = world_size, 0, 0
    check_launch(args)
    model_parallel = args.tensor_model_parallel_size * args.pipeline_model_parallel_size * args.context_parallel_size
    args.data_parallel_size = max(1, world_size // model_parallel)
    if args.global_batch_size is None and args.micro_batch_size is not None:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
    vpp = args.num_virtual_stages_per_pipeline_rank
    if vpp is None and args.num_layers_per_virtual_pipeline_stage and args.num_layers:
        vpp = args.num_layers // args.pipeline_model_parallel_size // args.num_layers_per_virtual_pipeline_stage
    args.virtual_pipeline_model_parallel_size = vpp
    return args


def check(flags: list[str], world_size: int) -> argparse.Namespace:
    """Everything about ``flags`` that can be known before the ranks start: ConfigError if not."""
    args = derive(parse(flags), world_size)
    if args.hybrid_data_parallel and args.seq_length is None:
        raise ConfigError("--seq-length is required: the longest sequence a step holds, e.g. --seq-length 32768")
    validate_hdp_args(args)
    if not args.hybrid_data_parallel:
        return args
    check_schedule(args)
    check_data_exists(args)
    if args.save:
        lock = HeartbeatLock(args.save, what="training run")
        lock.check_free()
        lock.check_writable()
        check_overwrite(args)
    check_before_launch(args)
    return args


def training_flags(argv: list[str]) -> list[str] | None:
    """The pretrain_gpt.py flags in a launcher's command line: what follows
    ``-m megatron_bytescale.launch SCRIPT`` or ``SCRIPT.py``; None if neither is there."""
    for i, word in enumerate(argv):
        if word == "megatron_bytescale.launch" and i and argv[i - 1] in ("-m", "--module"):
            return argv[i + 2 :]
        if word.endswith(".py") and not word.startswith("-"):
            return argv[i + 1 :]
    return None


def main(argv: list[str] | None = None) -> int:
    """``python -m megatron_bytescale.megatron.preflight --world-size N ENTRY...``: the check alone
    (the srun batch script runs it before srun starts the ranks)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 2 or argv[0] != "--world-size" or not argv[1].isdigit():
        print(
            "usage: python -m megatron_bytescale.megatron.preflight --world-size N PRETRAIN_GPT_COMMAND...",
            file=sys.stderr,
        )
        return 2
    flags = training_flags(argv[2:])
    try:
        check(flags if flags is not None else argv[2:], int(argv[1]))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
