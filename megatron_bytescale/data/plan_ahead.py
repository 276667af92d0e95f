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
or died: no orphan outlives its loader).
"""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection

from ..errors import PlanError

CREDIT = b"+"


class PlanAhead:
    """Steps' plans from a child process, in order, up to ``depth`` ahead of the consumer."""

    def __init__(self, sampler, plan_fn, step: int, position, depth: int):
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
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "megatron_bytescale.data.plan_ahead", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            env=env,
            stdin=subprocess.DEVNULL,
        )
        theirs.close()
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
        while not self._conn.poll(1.0):
            if self._proc.poll() is not None:
                raise PlanError(
                    f"the planning process exited with status {self._proc.returncode} before step {step}'s plan"
                )
        try:
            message = self._conn.recv()
        except EOFError:
            raise PlanError(f"the planning process closed before step {step}'s plan") from None
        if message[0] == "error":
            raise message[1]
        _, got, samples, plan, start, end, plan_s = message
        if got != step or start != position:
            raise PlanError(f"plan ahead: got step {got} from {start}, expected step {step} from {position}")
        self._next = step + 1
        self._conn.send_bytes(CREDIT)  # room for one more step ahead
        return samples, plan, end, plan_s

    def close(self) -> None:
        if self._proc.poll() is None:
            self._conn.close()  # the child reads end of stream and exits
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:  # planning a long step: end it
                self._proc.kill()
                self._proc.wait()
        elif not self._conn.closed:
            self._conn.close()


def _serve(fd: int) -> int:
    conn = Connection(fd)
    try:
        sys.path[:] = conn.recv()
        sampler, plan_fn, step, position = pickle.loads(conn.recv_bytes())
        while True:
            conn.recv_bytes()  # a credit: the parent has room for one more step
            try:
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
    sys.exit(_serve(int(sys.argv[1])))
