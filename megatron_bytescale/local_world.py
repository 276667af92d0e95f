"""Run a function on N local processes joined by a gloo process group.

One launcher serves ``bytescale verify``, the CPU demo and the tests. Children are forked
from a forkserver that has already imported torch (and whatever else is preloaded), so a
launch costs a fork, not a fresh interpreter. Every failure comes back as an exception in
the parent with the failing rank's traceback; a rank that hangs is killed at the deadline
(and gloo's own timeout turns a stuck collective into an error inside the ranks).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

_PRELOAD = ["torch", "torch.distributed", "megatron_bytescale.planner"]
_context = None


class WorkerError(RuntimeError):
    """A rank raised; the message carries its traceback."""


def _ctx():
    global _context
    if _context is None:
        _context = mp.get_context("forkserver")
        _context.set_forkserver_preload(_PRELOAD)
    return _context


def preload(modules: list[str]) -> None:
    """Add modules to import once in the forkserver (call before the first launch)."""
    for m in modules:
        if m not in _PRELOAD:
            _PRELOAD.append(m)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(payload, rank, world_size, port, timeout_s, threads, env, results):
    # The forkserver's environment dates from its start. Set the caller's (as of the launch: a
    # Ray session, a flag set since) before unpickling the function, whose module imports may
    # read it (Ray fixes its authentication mode at import).
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        fn, args, kwargs = pickle.loads(payload)
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        out = fn(rank, world_size, *args, **kwargs)
        # Plain pickle copies tensor data; the queue's own pickler would share it through file
        # descriptors that vanish when this process exits before the parent reads them.
        results.put((rank, True, pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_local_world(
    fn: Callable[..., Any],
    world_size: int,
    *args,
    timeout_s: float = 120.0,
    threads_per_rank: int | None = None,
    **kwargs,
) -> list[Any]:
    """Call ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo ranks; return the
    per-rank results in rank order. ``fn`` must be importable (defined at module level)."""
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    ctx = _ctx()
    threads = threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)
    results = ctx.Queue()
    port = free_port()
    payload = pickle.dumps((fn, args, kwargs))
    procs = [
        ctx.Process(target=_child, args=(payload, r, world_size, port, timeout_s, threads, dict(os.environ), results), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s + 30.0
    try:
        while len(out) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(out))
                raise TimeoutError(f"ranks {missing} did not finish within {timeout_s:.0f} s (killed)")
            try:
                rank, ok, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in out and p.exitcode not in (None, 0)]
                if dead:
                    raise WorkerError(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode} before reporting")
                continue
            if not ok:
                raise WorkerError(f"rank {rank} failed:\n{value}")
            out[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=5.0)
            if p.is_alive():
                p.kill()
                p.join()
    return [out[r] for r in range(world_size)]
