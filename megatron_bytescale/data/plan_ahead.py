"""Planning the next steps in a background process, off the training loop's critical path.

The local loader plans every step on every rank; at 16K GPUs a step's plan takes up to
seconds. A thread would hold the GIL for those seconds and slow the training loop's own
Python (kernel launches, the ring schedule), so the planning runs in a child process: a fresh
interpreter (``python -m megatron_bytescale.data.plan_ahead``, no fork of a process holding
gloo/NCCL state or CUDA) that imports only numpy and the planner.

The child plans steps ``step, step + 1, ...`` from ``position`` with the loader's sampler and
planning function (the same pure function of seed, lengths and position on every rank, so
every rank's child plans the same steps identically), at most ``depth`` steps ahead of what
the loader took. The loader takes each step's plan in order and checks its step and stream
position: a step whose plan is late is waited for, never skipped or planned twice. The time
the loader waits is the step's exposed planning (``StepBatch.plan_wait_s``).

Protocol over one socket pair (``multiprocessing.connection`` framing): the parent sends its
``sys.path``, then ``(sampler, plan_fn, step, position)``, then one credit per step it
allows ahead; the child answers each credit with ``("plan", step, samples, plan, start, end,
plan_s)`` or ``("error", exception)`` and stops at end of stream (the parent closed its end
or died).

The planning process is watched, so a stopped or dead one is named within seconds, never left
to the collective timeout of the ranks that wait for this one:

* it beats: a thread of the child writes the time, and the step it plans since when, into a
  small shared file every ``BEAT_S``; the loader, while it waits for a plan, names a child
  silent for ``HEARTBEAT_TIMEOUT_S`` (``BYTESCALE_PLAN_HEARTBEAT_TIMEOUT_S``, default 10 s) that
  is not running (stopped, or asleep holding the interpreter: one that runs without beating is
  in one long call, such as a kernel compile), one that exited (with its status or signal), and
  a plan that took longer than ``PLAN_TIMEOUT_S`` (``BYTESCALE_PLAN_TIMEOUT_S``, default 600 s:
  a first plan also compiles the planner's kernels; a planner stuck in a loop beats on);
* it dies with its rank whatever signal the rank got: the kernel kills it when the rank exits
  (``PR_SET_PDEATHSIG``), which also reaches a stopped child, and it reads end of stream on
  its socket when the rank closes it or dies.
"""

from __future__ import annotations

import mmap
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

from ..errors import PlanError
from ..process_lifetime import exit_description, killed_with_parent, state, state_code

CREDIT = b"+"
BEAT_S = 0.5
# Deadlines a loaded machine must not trip and an operator must not wait for; tests set them.
HEARTBEAT_TIMEOUT_S = float(os.environ.get("BYTESCALE_PLAN_HEARTBEAT_TIMEOUT_S", "10"))
PLAN_TIMEOUT_S = float(os.environ.get("BYTESCALE_PLAN_TIMEOUT_S", "600"))
STARTUP_S = 60.0  # a fresh interpreter importing numpy and the planner, on a loaded machine
SAY_AFTER_S = 10.0  # a wait this long gets a line saying what it waits for
# the shared heartbeat: (time of the last beat, step being planned or -1, when it began), monotonic clock
_BEAT = struct.Struct("ddd")


class PlanAhead:
    """Steps' plans from a child process, in order, up to ``depth`` ahead of the consumer."""

    def __init__(self, sampler, plan_fn, step: int, position, depth: int, say: Callable[[str], None] | None = None):
        if depth < 1:
            raise ValueError(f"plan ahead depth must be >= 1, got {depth}")
        try:
            payload = pickle.dumps((sampler, plan_fn, step, position))
        except (pickle.PicklingError, AttributeError, TypeError) as exc:
            raise PlanError(
                f"--hdp-plan-ahead plans in a background process, which needs a picklable planning function "
                f"(a module-level function or functools.partial, not a lambda or closure): {exc}; pass plan_ahead=0 "
                "to plan in the training process"
            ) from None
        ours, theirs = socket.socketpair()
        # the child finds this package (and a planning function's module) where the parent does
        env = dict(
            os.environ,
            OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
            PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
        )
        beat = tempfile.TemporaryFile()  # noqa: SIM115 - closed below, once the child holds it
        beat.write(bytes(_BEAT.size))
        beat.flush()
        self._beat = mmap.mmap(beat.fileno(), _BEAT.size)
        # the kernel's parent-death signal follows the thread that started the child: only the
        # main thread lives as long as this process
        main = threading.current_thread() is threading.main_thread()
        self._proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "megatron_bytescale.data.plan_ahead",
                str(theirs.fileno()),
                str(beat.fileno()),
                str(os.getpid() if main else 0),
            ],
            pass_fds=(theirs.fileno(), beat.fileno()),
            env=env,
            stdin=subprocess.DEVNULL,
        )
        theirs.close()
        beat.close()  # the mapping stays
        self._spawned = time.monotonic()
        self._say = say
        self._conn = Connection(ours.detach())
        self._conn.send(list(sys.path))
        self._conn.send_bytes(payload)
        for _ in range(depth):
            self._conn.send_bytes(CREDIT)
        self._next = step
        self._started = time.perf_counter()

    def get(self, step: int, position):
        """The plan of ``step`` (which must start at ``position``), waiting for it if the child
        is still planning it: ``(samples, plan, end, plan_s)``."""
        if step != self._next:
            raise PlanError(f"plan ahead: asked for step {step}, the planning process plans step {self._next} next")
        waited, said = time.monotonic(), False
        while not self._conn.poll(BEAT_S):
            self._check(step)
            if not said and self._say is not None and time.monotonic() - waited > SAY_AFTER_S:
                self._say(
                    f"bytescale: waiting for step {step}'s plan from the planning process (pid {self._proc.pid}; "
                    "a first plan on this machine also compiles the planner's kernels)"
                )
                said = True
        try:
            message = self._conn.recv()
        except (EOFError, OSError):
            raise PlanError(self._gone(step) or self._describe(step, "closed its connection")) from None
        if message[0] == "error":
            raise message[1]
        _, got, samples, plan, start, end, plan_s = message
        if got != step or start != position:
            raise PlanError(f"plan ahead: got step {got} from {start}, expected step {step} from {position}")
        self._next = step + 1
        try:
            self._conn.send_bytes(CREDIT)  # room for one more step ahead
        except OSError:  # it died after this plan: the next get names how
            pass
        return samples, plan, end, plan_s

    def _describe(self, step: int, what: str) -> str:
        return (
            f"the planning process (pid {self._proc.pid}, data/plan_ahead.py) {what} before step {step}'s plan; "
            "training cannot continue without it: resume from the last checkpoint"
        )

    def _gone(self, step: int) -> str | None:
        try:
            code = self._proc.wait(timeout=1.0)  # a closed connection: its process is ending
        except subprocess.TimeoutExpired:
            return None
        return self._describe(step, exit_description(code))

    def _check(self, step: int) -> None:
        """PlanError when the child exited, went silent, or overran the deadline on ``step``'s plan."""
        if self._proc.poll() is not None:
            raise PlanError(self._describe(step, exit_description(self._proc.returncode)))
        now = time.monotonic()
        beat, planning, since = _BEAT.unpack(self._beat[:])
        if beat == 0.0:  # not started yet
            if now - self._spawned > max(STARTUP_S, HEARTBEAT_TIMEOUT_S):
                raise PlanError(self._describe(step, f"did not start within {now - self._spawned:.0f} s"))
        elif now - beat > HEARTBEAT_TIMEOUT_S and state_code(self._proc.pid) != "R":
            # silent and not running: stopped, or asleep holding the interpreter (a process that
            # runs without beating is in one long call, e.g. compiling: the plan deadline bounds it)
            raise PlanError(
                self._describe(
                    step,
                    f"has been silent for {now - beat:.0f} s ({state(self._proc.pid)}; "
                    f"BYTESCALE_PLAN_HEARTBEAT_TIMEOUT_S={HEARTBEAT_TIMEOUT_S:g})",
                )
            )
        elif planning == step and now - since > PLAN_TIMEOUT_S:
            raise PlanError(
                self._describe(
                    step,
                    f"has been planning it for {now - since:.0f} s, past the deadline "
                    f"(BYTESCALE_PLAN_TIMEOUT_S={PLAN_TIMEOUT_S:g}); it is alive and beating: the planner is "
                    "stuck, or this step is too large to plan in time",
                )
            )

    def close(self) -> None:
        if not self._beat.closed:
            self._beat.close()
        if self._proc.poll() is None:
            self._conn.close()  # the child reads end of stream and exits
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:  # planning a long step: end it
                self._proc.kill()
                self._proc.wait()
        elif not self._conn.closed:
            self._conn.close()


class _Heartbeat:
    """The child's side of the shared heartbeat: a thread writes the time every ``BEAT_S``."""

    def __init__(self, fd: int):
        self._map = mmap.mmap(fd, _BEAT.size)
        os.close(fd)
        self.planning, self.since = -1, 0.0
        self._write()
        threading.Thread(target=self._run, name="plan-heartbeat", daemon=True).start()

    def _write(self) -> None:
        self._map[:] = _BEAT.pack(time.monotonic(), self.planning, self.since)

    def _run(self) -> None:
        while True:
            self._write()
            time.sleep(BEAT_S)

    def begin(self, step: int) -> None:
        self.planning, self.since = step, time.monotonic()
        self._write()


def _serve(fd: int, beat_fd: int, parent: int) -> int:
    # the SIGINT a launcher sends its rank's process group is the rank's to handle: this process
    # ends with the rank (end of stream, or the kernel's parent-death signal)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if parent:
        killed_with_parent(parent)
    heartbeat = _Heartbeat(beat_fd)
    conn = Connection(fd)
    try:
        sys.path[:] = conn.recv()
        sampler, plan_fn, step, position = pickle.loads(conn.recv_bytes())
        while True:
            conn.recv_bytes()  # a credit: the parent has room for one more step
            try:
                heartbeat.begin(step)
                samples, end = sampler.batch(position)
                t0 = time.perf_counter()
                plan = plan_fn([s.length for s in samples])
                plan_s = time.perf_counter() - t0
                conn.send(("plan", step, samples, plan, position, end, plan_s))
            except Exception as exc:  # noqa: BLE001 - raised again in the loader, at that step
                try:
                    conn.send(("error", exc))
                except (pickle.PicklingError, TypeError, AttributeError):
                    conn.send(("error", PlanError(f"step {step}: {type(exc).__name__}: {exc}")))
                return 0
            step, position = step + 1, end
    except (EOFError, BrokenPipeError, ConnectionResetError):  # the loader closed or died
        return 0


if __name__ == "__main__":
    sys.exit(_serve(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])))
