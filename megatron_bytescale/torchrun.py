"""``python -m megatron_bytescale.torchrun [torchrun options] -m megatron_bytescale.launch PRETRAIN_GPT_PY [flags]``

torchrun, with what a Megatron HDP launch needs around it (scripts/train_local.sh and
scripts/slurm/train_torchrun.sbatch start it in place of ``torchrun``):

* before any rank starts, and before torch is imported, the command line is checked
  (``megatron.preflight``: Megatron's own parser, the entry script, the flag table's refusals,
  validate_hdp_args, the LR schedule, the dataset, the ``--save`` lock); bad input ends in one
  line and exit status 2 within a second or two;
* torch's own launcher (``torch.distributed.run``) then runs in this process: its agent is the
  ranks' parent, so each rank dies with this process (``megatron.rank_guard``);
* what only a rank can know (Megatron's full validation, the ``--save`` lock taken for real, a
  checkpoint that no longer verifies, a dead planning process) comes back as one line: the ranks
  write it to a folder this process reads, and this process prints the first one once, in place
  of torchrun's failure report. A rank that fails otherwise is named with why: the rank that
  failed first, not a peer that failed because of it or that torchrun stopped (``first_failure``);
* SIGTERM, SIGINT (and SIGHUP, SIGQUIT, which torchrun's agent also catches) end the ranks and
  then this process with one line, ``interrupted``, and exit status 128 + the signal's number.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile

from .errors import ConfigError
from .megatron import preflight, rank_guard
from .process_lifetime import exit_description

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


# signals a rank dies of on its own (a crash, the kernel's OOM killer, an operator's kill -9),
# not the SIGTERM torchrun's agent stops the other ranks with once one failed
_OWN_DEATHS = {-signal.SIGKILL, -signal.SIGSEGV, -signal.SIGBUS, -signal.SIGILL, -signal.SIGFPE}


def first_failure(failures: dict, errors_folder: str) -> tuple[int, str]:
    """(exit status, one line) naming the rank that failed first and why. ``failures``:
    torchrun's ``ChildFailedError.failures`` (global rank -> ProcessFailure, in the order its agent
    saw them). A rank's own report comes first; then a rank killed by a signal nobody in the launcher
    sent; then the first uncaught exception; then the first rank torchrun did not stop itself."""
    reports = rank_guard.reported(errors_folder)
    if reports:
        return (reports[0].status, reports[0].message)
    uncaught = {r.rank: r for r in rank_guard.uncaught(errors_folder)}
    killed = [rank for rank, f in failures.items() if f.exitcode in _OWN_DEATHS]
    if killed:
        rank = killed[0]
    elif uncaught:
        rank = min(uncaught.values(), key=lambda r: r.time).rank
    else:
        rank = next((r for r, f in failures.items() if f.exitcode != -signal.SIGTERM), min(failures))
    failure = failures.get(rank)
    pid = f" (pid {failure.pid})" if failure is not None else ""
    if rank in uncaught and rank not in killed:
        why = f"failed first: {uncaught[rank].message}; its traceback is above"
    elif failure is not None and failure.exitcode < 0:  # a signal: nothing of its own to read above
        why = f"{exit_description(failure.exitcode)} first"
    elif failure is not None:
        why = f"{exit_description(failure.exitcode)} first; its output is above"
    else:
        why = "failed first; its output is above"
    others = len(failures) - 1
    tail = f" ({others} other rank(s) stopped after it)" if others > 0 else ""
    return (1, f"rank {rank}{pid} {why}{tail}")


class _Interrupted(Exception):
    def __init__(self, signum: int):
        self.signum = signum


def _interrupt(signum, frame):
    raise _Interrupted(signum)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if os.environ.pop(rank_guard.DIE_WITH_PARENT, None) == "1":
        from .process_lifetime import die_with_launcher

        die_with_launcher(os.getppid())
    # until torchrun's agent installs its own handlers (it raises SignalException)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        return _launch(argv)
    except KeyboardInterrupt:
        signum = signal.SIGINT
    except _Interrupted as exc:
        signum = exc.signum
    except Exception as exc:
        api = sys.modules.get("torch.distributed.elastic.multiprocessing.api")
        if api is None or not isinstance(exc, api.SignalException):  # raised by torchrun's agent's handlers
            raise
        signum = int(exc.sigval)
    print("interrupted", file=sys.stderr, flush=True)
    return 128 + signum


def _launch(argv: list[str]) -> int:
    own, _ = split(argv)
    command = preflight.training_command(argv)
    world = world_size(own)
    try:
        if command is not None and world is not None:
            args = preflight.check(command[1], world, command[0])
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
            status, line = first_failure(exc.failures, errors)
            print(f"error: {line}", file=sys.stderr, flush=True)
            return status
    return 0


if __name__ == "__main__":
    sys.exit(main())
