"""Rank functions for the process-lifetime tests (importable by the forkserver's children)."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch.distributed as dist


def wait_for(predicate, timeout_s: float, what: str):
    """Poll ``predicate`` until it returns something true (returned), or fail naming ``what``."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def sleeper(rank, world, pid_dir):
    """Report this rank's PID, then wait far longer than any test."""
    (Path(pid_dir) / f"rank{rank}").write_text(str(os.getpid()))
    time.sleep(600)


def stop_rank_one(rank, world):
    """Rank 1 stops itself (SIGSTOP) at once; the others wait for it in a collective."""
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    dist.barrier()


def die_on_rank_one(rank, world):
    if rank == 1:
        os._exit(3)
    dist.barrier()


def bad_input_in_rank(rank, world):
    from megatron_bytescale.errors import ConfigError

    raise ConfigError("--thing 7 is wrong; use 8")


if __name__ == "__main__":  # python lifetime_support.py PID_DIR: launch two sleeping ranks
    import faulthandler

    from megatron_bytescale.local_world import run_local_world

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test asks for stacks if it hangs
    # SIGINT as a terminal delivers it: a child inherits an ignored or blocked SIGINT from its
    # parent (a test runner started in the background, or an earlier test of the session), and
    # then the launcher never sees the signal this test sends
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})

    run_local_world(sleeper, 2, sys.argv[1], timeout_s=600)


def wedged_ring_peer(rank, world):
    """Rank 1 lives (and beats) but never sends its ring block; rank 0's ring wait must fail
    naming its peers."""
    import torch

    from megatron_bytescale.runtime import ring_comm

    ring_comm.RING_TIMEOUT_S = 2.0  # the default is 60 s
    comm = ring_comm.RingComm((0, 1), rank)
    if rank == 1:
        time.sleep(6)
        return None
    try:
        comm.send_recv(torch.ones(4), (4,)).wait()
    except TimeoutError as exc:
        return str(exc)
    return "completed"
