"""Worker processes that never outlive their launcher, and the launcher's view of their health.

Three mechanisms, because each covers a case the others miss:

* ``PR_SET_PDEATHSIG`` (Linux): the kernel sends SIGKILL to a worker when the process that forked
  it exits. Our workers are forked by multiprocessing's forkserver, which exits as soon as the
  launcher is gone (its "alive" pipe closes), so a SIGKILLed launcher takes its workers with it;
  it also works on a worker that is stopped (SIGSTOP).
* A watchdog thread in each worker that exits the worker when the launcher's PID is gone or a
  zombie: the fallback where prctl is missing or the forkserver outlives the launcher.
* Each worker leads a process group of its own, which the launcher kills on error, on SIGTERM
  and on SIGINT (``kill_group``), so anything a worker started goes too.

The same watchdog thread writes a heartbeat (a monotonic timestamp in shared memory) every
``HEARTBEAT_INTERVAL_S``; a stopped or wedged worker stops beating, and the launcher names it
(``stalled``). A rank that merely waits in a collective keeps beating: gloo waits without the GIL.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time

HEARTBEAT_INTERVAL_S = 0.5
# How long a silent rank may stay silent before the launcher declares it stalled. Long enough for
# a rank busy in one long C call on an overloaded machine, well inside a minute. Tests shorten it.
HEARTBEAT_TIMEOUT_S = float(os.environ.get("BYTESCALE_HEARTBEAT_TIMEOUT_S", "30"))
_PR_SET_PDEATHSIG = 1


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as gone: it has exited, nobody reaped it yet)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True


def killed_with_parent(parent: int) -> None:
    """The kernel SIGKILLs this process when the thread that started it exits (Linux
    ``PR_SET_PDEATHSIG``): also when this process is stopped (SIGSTOP), where no thread of ours
    could notice. ``parent``: the PID that started us, checked after the call, so a parent that
    died before it took effect ends us too."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the caller's watchdog still ends us
        pass
    if os.getppid() != parent:
        os._exit(1)


def exit_description(returncode: int) -> str:
    """``exited with status 3`` or ``was killed by SIGKILL``, for a child's return code."""
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with status {returncode}"


def state_code(pid: int) -> str | None:
    """The kernel's one-letter state of ``pid`` (R running or runnable, S sleeping, D in I/O, T
    stopped, Z exited), or None where /proc cannot tell."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError):
        return None


def state(pid: int) -> str:
    """A few words on what ``pid`` is doing now (from /proc), for messages about silent processes."""
    code = state_code(pid)
    if code is None:
        return "gone"
    return {
        "T": "stopped (SIGSTOP or a debugger)",
        "t": "stopped by a debugger",
        "D": "waiting on I/O in the kernel",
        "Z": "exited",
        "R": "running",
        "S": "sleeping",
    }.get(code, f"state {code}")


def die_with_launcher(launcher_pid: int, heartbeat=None, index: int = 0) -> None:
    """Call first thing in a worker: die when the forking process or ``launcher_pid`` exits;
    lead a process group of our own; beat ``heartbeat[index]`` (a shared double array)."""
    killed_with_parent(os.getppid())
    try:
        os.setpgid(0, 0)
    except OSError:
        pass

    def watch() -> None:
        while True:
            if heartbeat is not None:
                heartbeat[index] = time.monotonic()
            if not _alive(launcher_pid):
                if os.getpgid(0) == os.getpid():  # our own group only, never the launcher's
                    os.killpg(os.getpid(), signal.SIGKILL)
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(HEARTBEAT_INTERVAL_S)

    if heartbeat is not None:
        heartbeat[index] = time.monotonic()
    threading.Thread(target=watch, name="launcher-watchdog", daemon=True).start()


def stalled(
    heartbeat, pending: list[int], now: float | None = None, timeout_s: float | None = None
) -> list[tuple[int, float]]:
    """(index, seconds silent) of the ``pending`` workers that have beaten at least once and then
    stayed silent longer than ``timeout_s``."""
    now = time.monotonic() if now is None else now
    limit = HEARTBEAT_TIMEOUT_S if timeout_s is None else timeout_s
    out = []
    for i in pending:
        last = heartbeat[i]
        if last > 0 and now - last > limit:
            out.append((i, now - last))
    return out


def kill_group(proc) -> None:
    """SIGKILL a worker's process group (the worker and all it started), or the worker alone
    when it has not yet made its own group."""
    pid = proc.pid
    if pid is None:
        return
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, signal.SIGKILL)
            return
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.kill()
    except (ProcessLookupError, OSError, ValueError):
        pass


class terminate_raises:
    """While active (in the main thread), SIGTERM raises ``SystemExit(143)`` like SIGINT raises
    KeyboardInterrupt, so the launcher's ``finally`` runs and ends its workers."""

    def __enter__(self):
        self._old = None
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGTERM, self._raise)
        return self

    @staticmethod
    def _raise(signum, frame):
        raise SystemExit(128 + signum)

    def __exit__(self, *exc):
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)
        return False
