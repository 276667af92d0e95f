"""Run a function on N local processes joined by a gloo process group.

One launcher serves ``bytescale verify``, the CPU demo and the tests. Children are forked
from a forkserver that has already imported torch (and whatever else is preloaded), so a
launch costs a fork, not a fresh interpreter. Every failure comes back as an exception in
the parent with the failing rank's traceback (a rank's ``BytescaleError`` comes back as that
one-line error); a rank that hangs is killed at the deadline (and gloo's own timeout turns a
stuck collective into an error inside the ranks).

Ranks never outlive the launcher and a stopped or dead rank is named within seconds: see
``process_lifetime`` (parent-death signal, watchdog, a process group per rank, heartbeats).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import shutil
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from . import errors, process_lifetime
from .errors import BytescaleError, ConfigError, WorkerError  # noqa: F401 - WorkerError is part of this API

_PRELOAD = ["torch", "torch.distributed", "megatron_bytescale.planner"]
_context = None


# What one gloo rank costs: the proportional resident memory (PSS) of a `bytescale verify` rank
# of the tiny model (torch, megatron-core, the model, gloo buffers) measured 290-480 MiB on CPU
# for 700- to 16K-token sequences; larger models and batches need more than this floor.
RANK_BYTES = 384 << 20
STARTUP_S = 120.0  # a rank that has not beaten its heart once by then never started


def available_memory() -> int | None:
    """MemAvailable of /proc/meminfo in bytes, or None where there is none."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def max_world_size() -> int:
    """How many local ranks this machine can hold (memory-bound; 1024 where it cannot tell)."""
    avail = available_memory()
    return 1024 if avail is None else max(1, avail // RANK_BYTES)


def check_world_size(world_size: int, flag: str = "--world-size") -> None:
    """Refuse a local world the machine cannot hold, before any process starts."""
    if world_size < 1:
        raise ConfigError(f"{flag} {world_size}: must be at least 1")
    limit = max_world_size()
    if world_size > limit:
        avail = available_memory() or 0
        raise ConfigError(
            f"{flag} {world_size}: this machine can hold at most {limit} local gloo ranks "
            f"(~{RANK_BYTES >> 20} MiB each, {avail / 2**30:.1f} GiB available); lower {flag}"
        )


def shape_warnings(ranks: int, capacity: int, longest: int) -> list[str]:
    """What a local run's shape costs, said before it starts: more ranks than cores share them
    (every step takes that much longer), and a capacity at or above the longest sequence leaves
    HDP nothing to split (every sequence runs whole on one rank, no ring forms)."""
    out = []
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if ranks > cores:
        out.append(
            f"warning: {ranks} ranks on {cores} core{'s' if cores > 1 else ''}: the ranks share them, so each step "
            f"takes about {ranks / cores:.1f}x as long as with a core per rank"
        )
    if capacity >= longest:
        out.append(
            f"warning: capacity {capacity} tokens holds the longest sequence ({longest} tokens) on one rank: every "
            "sequence runs whole, no ring forms and HDP has nothing to split; lower the capacity to see rings"
        )
    return out


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


def _report(results, result_dir: str, rank: int, ok: bool, value) -> None:
    """Write the outcome to a file (atomically), then post only the rank on the queue: a message
    that small is one atomic pipe write, so a rank killed while reporting can never leave a
    half-written message that blocks the launcher's read forever."""
    path = os.path.join(result_dir, f"rank{rank}")
    with open(path + ".tmp", "wb") as f:
        pickle.dump((ok, value), f)
    os.replace(path + ".tmp", path)
    results.put(rank)


def _child(payload, rank, world_size, port, timeout_s, threads, env, results, heartbeat, launcher_pid, result_dir):
    process_lifetime.die_with_launcher(launcher_pid, heartbeat, rank)
    # The forkserver's environment dates from its start. Set the caller's (as of the launch: a
    # Ray session, a flag set since) before unpickling the function, whose module imports may
    # read it (Ray fixes its authentication mode at import).
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        fn, args, kwargs = pickle.loads(payload)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        out = fn(rank, world_size, *args, **kwargs)
        # Plain pickle copies tensor data; the queue's own pickler would share it through file
        # descriptors that vanish when this process exits before the parent reads them.
        _report(results, result_dir, rank, True, pickle.dumps(out))
    except BytescaleError as exc:  # bad input found inside a rank: the user sees the one line
        _report(results, result_dir, rank, False, (type(exc).__name__, str(exc)))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        _report(results, result_dir, rank, False, traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


RESULT_DIR_PREFIX = "bytescale-ranks-"  # then the launcher's pid, "-", mkdtemp's suffix


def _new_result_dir() -> str:
    """A fresh folder for the ranks' result files, named after this launcher's pid; first the
    folders of launchers that died without removing theirs (SIGKILL leaves no chance) go."""
    parent = tempfile.gettempdir()
    remove_stale_result_dirs(parent)
    return tempfile.mkdtemp(prefix=f"{RESULT_DIR_PREFIX}{os.getpid()}-", dir=parent)


def remove_stale_result_dirs(parent: str) -> list[str]:
    """Remove, and return, the result folders in ``parent`` that belong to this user and whose
    launcher pid no longer runs. Other names, other users' folders and live launchers' stay."""
    removed = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed
    for entry in entries:
        pid, sep, _ = entry.name[len(RESULT_DIR_PREFIX) :].partition("-")
        if not entry.name.startswith(RESULT_DIR_PREFIX) or not sep or not pid.isdigit():
            continue
        try:
            if not entry.is_dir(follow_symlinks=False) or entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
        except OSError:  # gone meanwhile
            continue
        if not process_lifetime._alive(int(pid)):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
    return removed


def run_local_world(
    fn: Callable[..., Any],
    world_size: int,
    *args,
    timeout_s: float = 120.0,
    threads_per_rank: int | None = None,
    heartbeat_timeout_s: float | None = None,
    **kwargs,
) -> list[Any]:
    """Call ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo ranks; return the
    per-rank results in rank order. ``fn`` must be importable (defined at module level).

    A rank that dies, or stops beating for ``heartbeat_timeout_s`` (default
    ``process_lifetime.HEARTBEAT_TIMEOUT_S``), ends the run with a ``WorkerError`` naming it;
    SIGTERM/SIGINT of this process end every rank before it exits."""
    check_world_size(world_size, "world_size")
    ctx = _ctx()
    threads = threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)
    results = ctx.Queue()
    heartbeat = ctx.Array("d", world_size, lock=False)
    port = free_port()
    payload = pickle.dumps((fn, args, kwargs))
    env = dict(os.environ)
    result_dir = _new_result_dir()
    procs = [
        ctx.Process(
            target=_child,
            args=(payload, r, world_size, port, timeout_s, threads, env, results, heartbeat, os.getpid(), result_dir),
            daemon=True,
        )
        for r in range(world_size)
    ]
    out: dict[int, Any] = {}
    ok_exit = False
    with process_lifetime.terminate_raises():
        try:
            for p in procs:
                p.start()
            started = time.monotonic()
            deadline = started + timeout_s + 30.0
            while len(out) < world_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = sorted(set(range(world_size)) - set(out))
                    raise TimeoutError(f"ranks {missing} did not finish within {timeout_s:.0f} s (killed)")
                try:
                    rank = results.get(timeout=min(remaining, 0.5))
                except queue.Empty:
                    _check_health(procs, out, heartbeat, started, heartbeat_timeout_s)
                    continue
                with open(os.path.join(result_dir, f"rank{rank}"), "rb") as f:
                    ok, value = pickle.load(f)
                if not ok:
                    # A rank whose peer died fails in gloo ("connection reset"): name the dead one.
                    _name_dead_peer(procs, out, rank, value)
                    if isinstance(value, tuple):
                        raise getattr(errors, value[0], BytescaleError)(value[1])
                    raise WorkerError(f"rank {rank} failed:\n{value}")
                out[rank] = pickle.loads(value)
            ok_exit = True
        finally:
            for p in procs:
                if ok_exit:
                    p.join(timeout=5.0)
                if p.is_alive():
                    process_lifetime.kill_group(p)
            for p in procs:
                if p.pid is not None:
                    p.join(timeout=5.0)
            shutil.rmtree(result_dir, ignore_errors=True)
    return [out[r] for r in range(world_size)]


def _name_dead_peer(procs, out, failed: int, value, grace_s: float = 1.0) -> None:
    end = time.monotonic() + grace_s
    while time.monotonic() < end:
        dead = [r for r in range(len(procs)) if r not in out and r != failed and procs[r].exitcode not in (None, 0)]
        if dead:
            last = value[1] if isinstance(value, tuple) else value.strip().splitlines()[-1]
            code = procs[dead[0]].exitcode
            how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
            raise WorkerError(
                f"rank {dead[0]} {how} before reporting (pid {procs[dead[0]].pid}); rank {failed} then failed: "
                f"{last[:300]}"
            )
        time.sleep(0.1)


def _check_health(procs, out, heartbeat, started: float, heartbeat_timeout_s: float | None) -> None:
    """Raise for the first rank that died before reporting, stalled, or never started."""
    pending = [r for r in range(len(procs)) if r not in out]
    dead = [r for r in pending if procs[r].exitcode not in (None, 0)]
    if dead:
        code = procs[dead[0]].exitcode
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        raise WorkerError(f"rank {dead[0]} {how} before reporting (pid {procs[dead[0]].pid})")
    now = time.monotonic()
    silent = process_lifetime.stalled(heartbeat, pending, now, heartbeat_timeout_s)
    if silent:
        r, quiet = silent[0]
        raise WorkerError(
            f"rank {r} (pid {procs[r].pid}) stopped responding: no heartbeat for {quiet:.0f} s "
            f"(stopped with SIGSTOP, swapped out or wedged); all ranks killed"
        )
    if now - started > STARTUP_S:
        never = [r for r in pending if heartbeat[r] == 0]
        if never:
            raise WorkerError(f"rank {never[0]} did not start within {STARTUP_S:.0f} s; all ranks killed")
