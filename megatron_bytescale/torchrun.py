"""``python -m megatron_bytescale.torchrun [torchrun options] -m megatron_bytescale.launch PRETRAIN_GPT_PY [flags]``

torchrun, with what a Megatron HDP launch needs around it (scripts/train_local.sh and
scripts/slurm/train_torchrun.sbatch start it in place of ``torchrun``):

* before any rank starts, and before torch is imported, the command line is checked
  (``megatron.preflight``: validate_hdp_args, the LR schedule, the dataset, the ``--save``
  lock); bad input ends in one line and exit status 2 within a second;
* torch's own launcher (``torch.distributed.run``) then runs in this process: its agent is the
  ranks' parent, so each rank dies with this process (``megatron.rank_guard``);
* what only a rank can know (Megatron's full validation, the ``--save`` lock taken for real, a
  checkpoint that no longer verifies) comes back as one line: the ranks write it to a folder
  this process reads, and this process prints it once, in place of torchrun's failure report.
"""

from __future__ import annotations

import os
import sys
import tempfile

from .errors import ConfigError
from .megatron import preflight, rank_guard

USAGE = (
    "usage: python -m megatron_bytescale.torchrun [torchrun options] "
    "-m megatron_bytescale.launch PRETRAIN_GPT_PY [flags]"
)


def _option(argv: list[str], *names: str) -> str | None:
    """The value of a torchrun option (``--name V`` or ``--name=V``) before the training command."""
    for i, word in enumerate(argv):
        for name in names:
            if word == name and i + 1 < len(argv):
                return argv[i + 1]
            if word.startswith(name + "="):
                return word.split("=", 1)[1]
    return None


def world_size(launcher_argv: list[str]) -> int | None:
    """nnodes x nproc-per-node when both are numbers (``--nnodes 1:4`` counts its maximum)."""
    nproc = _option(launcher_argv, "--nproc-per-node", "--nproc_per_node") or "1"
    nnodes = (_option(launcher_argv, "--nnodes") or "1").split(":")[-1]
    return int(nproc) * int(nnodes) if nproc.isdigit() and nnodes.isdigit() else None


def split(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """(torchrun's own options, the pretrain_gpt.py flags) of a command line."""
    flags = preflight.training_flags(argv)
    return (argv if flags is None else argv[: len(argv) - len(flags)]), flags


def _quiet_agent_failure_logs() -> None:
    """torchrun's agent logs each failed rank and a closing summary at ERROR: the one line says it."""
    import logging

    for name in (
        "torch.distributed.elastic.multiprocessing.api",
        "torch.distributed.elastic.agent.server.api",
        "torch.distributed.elastic.multiprocessing.errors",
    ):
        logging.getLogger(name).setLevel(logging.CRITICAL)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if os.environ.pop(rank_guard.DIE_WITH_PARENT, None) == "1":
        from .process_lifetime import die_with_launcher

        die_with_launcher(os.getppid())
    own, flags = split(argv)
    world = world_size(own)
    try:
        if flags is not None and world is not None:
            args = preflight.check(flags, world)
            local = _option(own, "--nproc-per-node", "--nproc_per_node") or "1"
            if args.hybrid_data_parallel and local.isdigit():  # what the run's shape costs, said before it starts
                from .local_world import shape_warnings

                for line in shape_warnings(int(local), args.hdp_token_capacity, args.seq_length):
                    print(line, file=sys.stderr, flush=True)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    _quiet_agent_failure_logs()
    with tempfile.TemporaryDirectory(prefix="bytescale-rank-errors-") as errors:
        os.environ[rank_guard.ERRORS_ENV] = errors
        try:
            run(parse_args(argv))
        except ChildFailedError as exc:
            lines = rank_guard.reported(errors)
            if lines:
                print(f"error: {lines[0][1]}", file=sys.stderr, flush=True)
                return 2
            rank, failure = min(exc.failures.items())
            print(
                f"error: rank {rank} (pid {failure.pid}) exited with code {failure.exitcode}; its output is above "
                f"({len(exc.failures)} rank(s) failed)",
                file=sys.stderr,
                flush=True,
            )
            return 1
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
