"""What every rank of a Megatron run does for its launcher: die with it, and hand it bad input
as one line.

* Under torchrun (``TORCHELASTIC_RUN_ID``; also ``python -m megatron_bytescale.torchrun``) or an
  srun step (``SLURM_STEP_ID``) a rank's parent is its launcher (torchrun's agent, slurmstepd).
  ``die_with_launcher`` gives the rank ``process_lifetime.die_with_launcher``: the kernel kills
  it when that parent exits (PR_SET_PDEATHSIG), and a watchdog thread kills its process group
  (torchrun starts each rank as a session leader; anything it spawned goes too) when the parent
  is gone. A SIGKILLed launcher so leaves no rank training or saving behind.
* ``destroy_process_groups_at_exit()``: at exit the rank destroys torch.distributed's process
  groups while the interpreter is still whole (see there why).
* ``report(message)``: a rank that refuses its input exits with status 2. Under
  ``megatron_bytescale.torchrun`` it writes the line to ``$BYTESCALE_RANK_ERRORS/rank<R>`` and
  prints nothing (the launcher prints it once); otherwise rank 0 prints it.
"""

from __future__ import annotations

import atexit
import os
import sys
from pathlib import Path
from typing import NoReturn

from ..process_lifetime import die_with_launcher as _die_with

LAUNCHED_BY = ("TORCHELASTIC_RUN_ID", "SLURM_STEP_ID")
ERRORS_ENV = "BYTESCALE_RANK_ERRORS"
# set by a program that starts megatron_bytescale.torchrun itself (bytescale demo --megatron-lm):
# the launcher then ends with that program, and its ranks with it
DIE_WITH_PARENT = "BYTESCALE_LAUNCHER_DIES_WITH_PARENT"
_installed = False
_exit_hook = False


def die_with_launcher() -> bool:
    """In a rank started by torchrun or srun: end with the launcher (idempotent). True if installed."""
    global _installed
    if _installed or not any(os.environ.get(name) for name in LAUNCHED_BY):
        return _installed
    _die_with(os.getppid())
    _installed = True
    return True


def destroy_process_groups_at_exit() -> None:
    """Destroy the process groups at exit, before the interpreter is torn down (idempotent).
    Megatron's ``pretrain`` returns with them alive; gloo's worker threads may then still hold
    finished asynchronous work whose tensors have Python references, and freeing those during
    interpreter finalization aborts the rank (SIGABRT, "terminate called without an active
    exception") after a run that trained to the end. Not after an uncaught error: the groups
    are left as they are then (destroying one joins its workers, which may wait on a peer)."""
    global _exit_hook
    if not _exit_hook:
        atexit.register(_destroy_process_groups)
        _exit_hook = True


def _destroy_process_groups() -> None:
    import torch.distributed as dist

    if getattr(sys, "last_value", None) is not None:
        return  # an uncaught error ends the rank: a collective may still wait on a peer, leave it to the launcher
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - exiting anyway (e.g. after a peer died): no second traceback
            pass


def report(message: str) -> NoReturn:
    """Exit this rank with status 2 after handing ``message`` (one line) to the launcher."""
    folder = os.environ.get(ERRORS_ENV)
    rank = int(os.environ.get("RANK", "0"))
    if folder and os.path.isdir(folder):
        tmp = Path(folder) / f".rank{rank}.tmp"
        tmp.write_text(message.replace("\n", " ") + "\n")
        os.replace(tmp, Path(folder) / f"rank{rank}")
    elif rank == 0:
        print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def reported(folder: str | Path) -> list[tuple[int, str]]:
    """(rank, line) of each rank that reported, by rank (the launcher's side)."""
    out = []
    for path in Path(folder).glob("rank*"):
        if path.name[4:].isdigit():
            out.append((int(path.name[4:]), path.read_text().strip()))
    return sorted(out)
