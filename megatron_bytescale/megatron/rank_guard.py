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
* ``report(message)``: a rank that refuses its input exits with status 2 (``status``: 1 for a
  failure that is not the input's, e.g. a dead planning process). Under
  ``megatron_bytescale.torchrun`` it writes the line to ``$BYTESCALE_RANK_ERRORS/rank<R>`` and
  prints nothing (the launcher prints the first rank's line once); otherwise rank 0 prints it.
* ``record_uncaught()``: an uncaught exception still prints its traceback, and its last line
  and time go to ``$BYTESCALE_RANK_ERRORS/uncaught<R>``, so the launcher can name the rank that
  failed first, and why, rather than a peer that failed because of it; once another rank has
  reported its cause, a rank's own failure (a collective whose peer left) ends it quietly.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
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
    """In a rank started by torchrun or srun: end with the launcher (idempotent), and end at once
    and quietly on the SIGINT a launcher forwards, as on its SIGTERM (Python's KeyboardInterrupt
    would print a traceback per rank under the launcher's one "interrupted" line, and waits for
    a collective the rank is blocked in to return). True if installed."""
    global _installed
    if _installed or not any(os.environ.get(name) for name in LAUNCHED_BY):
        return _installed
    _die_with(os.getppid())
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_DFL)
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


def _write(name: str, message: str, status: int) -> bool:
    """Hand ``message`` to the launcher as ``$BYTESCALE_RANK_ERRORS/<name>``; False without a launcher."""
    folder = os.environ.get(ERRORS_ENV)
    if not folder or not os.path.isdir(folder):
        return False
    record = {"message": " ".join(message.split("\n")), "status": status, "time": time.time()}
    tmp = Path(folder) / f".{name}.tmp"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, Path(folder) / name)
    return True


def report(message: str, status: int = 2) -> NoReturn:
    """Exit this rank with ``status`` after handing ``message`` (one line) to the launcher."""
    rank = int(os.environ.get("RANK", "0"))
    if not _write(f"rank{rank}", message, status) and rank == 0:
        print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(status)


def record_uncaught() -> None:
    """Note each uncaught exception's last line and time for the launcher (idempotent); the
    traceback is printed as before."""
    if getattr(sys.excepthook, "_bytescale", False) or not os.environ.get(ERRORS_ENV):
        return
    previous = sys.excepthook

    def hook(kind, value, tb):
        folder = os.environ.get(ERRORS_ENV, "")
        if os.path.isdir(folder) and reported(folder):
            # another rank reported its cause before ending (the launcher prints it): this rank's
            # failure follows from that (a collective whose peer left), its traceback says nothing more
            return
        try:
            why = f"{kind.__name__}: {value}".strip().splitlines()
            _write(f"uncaught{os.environ.get('RANK', '0')}", why[-1] if why else kind.__name__, 1)
        except OSError:
            pass
        previous(kind, value, tb)

    hook._bytescale = True
    sys.excepthook = hook


@dataclass(frozen=True)
class Report:
    rank: int
    message: str
    status: int
    time: float


def _read(folder: str | Path, prefix: str) -> list[Report]:
    out = []
    for path in Path(folder).glob(f"{prefix}*"):
        rank = path.name[len(prefix) :]
        if rank.isdigit():
            try:
                record = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            out.append(Report(int(rank), record["message"], int(record["status"]), float(record["time"])))
    return sorted(out, key=lambda r: (r.time, r.rank))


def reported(folder: str | Path) -> list[Report]:
    """The ranks' reports (``report``), first reported first (the launcher's side)."""
    return _read(folder, "rank")


def uncaught(folder: str | Path) -> list[Report]:
    """The ranks' uncaught exceptions (``record_uncaught``), first raised first."""
    return _read(folder, "uncaught")
