"""The checks a launcher runs once, before any rank starts, on the pretrain_gpt.py command line it
is about to hand to torchrun (or srun), without importing torch or Megatron-LM.

Megatron's own parser judges the command line first: importing it costs seconds (Megatron's
``arguments`` module imports torch and megatron-core), so the launcher builds it from the
parser's spec (``parser_spec``: shipped for each supported tree and compared with the real
parsers by the tests, extracted once and cached for any other tree). Unknown and misspelled
flags end in one line with the nearest flag; values are read with Megatron's types, counts and
choices. Then: the entry script (only pretrain_gpt.py), every refusal of the flag table
(``flag_table``), the global batch's divisibility, ``validate_hdp_args``, Megatron's LR-schedule
rule, the dataset files and the ``--save`` lock. The values Megatron's validate_args derives
(data-parallel size, default global batch, virtual stages) are derived here the same way. The
ranks still run Megatron's full validation: this is the early copy of what can be known from the
command line, so a wrong launch ends in one line within a second or two.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

from ..errors import ConfigError
from ..folder_lock import HeartbeatLock
from . import flag_table, parser_spec
from .arguments import (
    add_hdp_arguments,
    check_data_exists,
    check_global_batch,
    check_launch,
    check_schedule,
    validate_hdp_args,
)
from .checkpoint_guard import check_overwrite
from .data_stream import check_before_launch

# the entry scripts HDP serves (its hooks wrap pretrain_gpt.py's providers); any other is refused by name
SUPPORTED_SCRIPTS = ("pretrain_gpt.py",)


def check_entry_script(script: str | Path) -> None:
    """Only Megatron-LM's pretrain_gpt.py (under any folder) runs under HDP."""
    name = Path(script).name
    if name not in SUPPORTED_SCRIPTS:
        raise ConfigError(
            f"{name}: megatron_bytescale trains GPT models through Megatron-LM's pretrain_gpt.py; {name} "
            f"(its own models, data and steps) is not supported under --hybrid-data-parallel: run pretrain_gpt.py"
        )


class _Parser(parser_spec.OneLineParser):
    """Megatron's parser, rebuilt: an unknown flag is one line that names the nearest known one."""

    def error(self, message):
        if message.startswith("unrecognized arguments:"):
            unknown = next((w for w in message.split()[2:] if w.startswith("--")), None)
            if unknown:
                # a misspelling, not any flag that shares a few words (cutoff above difflib's 0.6)
                near = difflib.get_close_matches(
                    unknown.split("=")[0], list(self._option_string_actions), n=1, cutoff=0.8
                )
                if near:
                    message += f" (did you mean {near[0]}?)"
        raise ConfigError(message)


def parser_for(tree: str | Path) -> argparse.ArgumentParser:
    """Megatron's parser of ``tree`` (from its spec) with the HDP group, as pretrain_gpt.py builds it."""
    parser = _Parser(prog="pretrain_gpt.py", add_help=False, allow_abbrev=False)
    for action in parser_spec.build_parser(parser_spec.load(tree))._actions:
        parser._add_action(action)
    return add_hdp_arguments(parser)


def parse(flags: list[str], tree: str | Path) -> argparse.Namespace:
    """A pretrain_gpt.py command line read as Megatron's parser of ``tree`` reads it."""
    return parser_for(tree).parse_args(flags)


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


def check(flags: list[str], world_size: int, script: str | Path) -> argparse.Namespace:
    """Everything about ``script flags`` that can be known before the ranks start: ConfigError if not.
    Without --hybrid-data-parallel the script is Megatron's (or any torchrun program's) to check:
    only an HDP flag given in vain is refused."""
    if "--hybrid-data-parallel" not in flag_table.given_flags(flags):
        hdp = add_hdp_arguments(parser_spec.OneLineParser(add_help=False, allow_abbrev=False))
        return validate_hdp_args(hdp.parse_known_args(flags)[0])
    check_entry_script(script)
    parser = parser_for(Path(script).resolve().parent)
    args = parser.parse_args(flags)
    flag_table.refuse(args, flag_table.given_flags(flags), set(parser._option_string_actions))
    args = derive(args, world_size)
    check_global_batch(args)
    if args.seq_length is None:
        raise ConfigError("--seq-length is required: the longest sequence a step holds, e.g. --seq-length 32768")
    validate_hdp_args(args)
    check_schedule(args)
    check_data_exists(args)
    if args.save:
        lock = HeartbeatLock(args.save, what="training run")
        lock.check_free()
        lock.check_writable()
        check_overwrite(args)
    check_before_launch(args)
    return args


def training_command(argv: list[str]) -> tuple[str, list[str]] | None:
    """(the entry script, its flags) in a launcher's command line: what follows
    ``-m megatron_bytescale.launch SCRIPT`` or ``SCRIPT.py``; None if neither is there."""
    for i, word in enumerate(argv):
        if word == "megatron_bytescale.launch" and i and argv[i - 1] in ("-m", "--module"):
            return (argv[i + 1], argv[i + 2 :]) if i + 1 < len(argv) else None
        if word.endswith(".py") and not word.startswith("-"):
            return word, argv[i + 1 :]
    return None


def training_flags(argv: list[str]) -> list[str] | None:
    """The pretrain_gpt.py flags of a launcher's command line (``training_command``'s second part)."""
    command = training_command(argv)
    return None if command is None else command[1]


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
    command = training_command(argv[2:])
    if command is None:
        print("error: no entry script (pretrain_gpt.py) in the command line", file=sys.stderr)
        return 2
    try:
        check(command[1], int(argv[1]), command[0])
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
