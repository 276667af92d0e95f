"""The ``bytescale`` command. Each subcommand is a module of ``commands/`` exposing
``add_arguments(parser)`` and ``main(args) -> int``; a command's module is imported only when
it runs, and imports the library it drives only inside ``main``, so every ``--help`` stays fast
(no numpy, numba or torch import)."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import warnings
from pathlib import Path

from .errors import BytescaleError, WorkerError

# megatron-core announces at import that GPU-only extras are missing; on CPU that is expected.
# PYTHONWARNINGS carries the filter into the processes the commands spawn.
QUIET = (
    "Transformer Engine and Apex are not installed",
    "Apex is not installed",
    # bf16 runs: megatron-core keeps norm weights in fp32; torch then skips its fused CPU kernel
    "Mismatch dtype between input and weight",
)


def quiet_optional_backend_warnings() -> None:
    for message in QUIET:
        warnings.filterwarnings("ignore", message=message)
    extra = ",".join(f"ignore:{m}" for m in QUIET)
    os.environ["PYTHONWARNINGS"] = ",".join(filter(None, (os.environ.get("PYTHONWARNINGS"), extra)))


# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": (
        "megatron_bytescale.commands.demo",
        "train a tiny GPT under HDP on 4 CPU processes, then on the static mesh, and compare",
    ),
    "verify": ("megatron_bytescale.commands.verify", "check that HDP on N gloo ranks trains exactly like one rank"),
    "plan": ("megatron_bytescale.commands.plan", "plan one step of HDP for a batch of sequence lengths"),
    "simulate": (
        "megatron_bytescale.commands.simulate",
        "compare static CP, Megatron dynamic CP and HDP on a simulated cluster",
    ),
    "prepare-data": (
        "megatron_bytescale.commands.prepare_data",
        "write a Megatron indexed dataset from source trees or text files",
    ),
    "dataloader-bench": (
        "megatron_bytescale.commands.dataloader_bench",
        "time planning and delivery of the local or Ray data loader",
    ),
    "profile": ("megatron_bytescale.commands.profile", "measure the cost model's coefficients on this machine"),
    "patches": (
        "megatron_bytescale.commands.patches",
        "show (or apply) the pretrain_gpt.py patch series for a Megatron-LM checkout",
    ),
}


# Flags naming a file a command writes at its end: checked before the work, so a typo in the
# folder does not cost the whole run. (command -> attributes; "*" applies to every command)
OUTPUT_FILES = {"*": ("json", "plot"), "profile": ("out",)}


def check_output_files(name: str, args: argparse.Namespace) -> None:
    for attr in OUTPUT_FILES["*"] + OUTPUT_FILES.get(name, ()):
        value = getattr(args, attr, None)
        if not value:
            continue
        flag = "--" + attr.replace("_", "-")
        path = Path(value)
        folder = path.parent
        if path.is_dir():
            raise BytescaleError(f"{flag} {value} is a folder; give a file name, e.g. {path / 'out'}")
        if not folder.is_dir():
            raise BytescaleError(f"{flag} {value}: folder {folder} does not exist; create it first or write elsewhere")
        if not os.access(folder, os.W_OK):
            raise BytescaleError(f"{flag} {value}: folder {folder} is not writable; write elsewhere")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bytescale",
        description="Hybrid Data Parallelism for long-context Megatron-LM training.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_module, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    if argv[0] not in SUBCOMMANDS:
        parser.error(f"unknown command {argv[0]!r}; choose one of {', '.join(SUBCOMMANDS)}")
    name, rest = argv[0], argv[1:]
    quiet_optional_backend_warnings()
    module_name, help_text = SUBCOMMANDS[name]
    module = importlib.import_module(module_name)
    sub = argparse.ArgumentParser(prog=f"bytescale {name}", description=help_text)
    module.add_arguments(sub)
    args = sub.parse_args(rest)
    try:
        check_output_files(name, args)
        return int(module.main(args) or 0)
    except BytescaleError as exc:
        print(f"bytescale {name}: error: {exc}", file=sys.stderr)
        return 2
    except WorkerError as exc:  # a rank failed, died or stalled; the launcher has ended the others
        print(f"bytescale {name}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # the launcher has already ended its rank processes
        print(f"bytescale {name}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
