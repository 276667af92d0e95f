"""Rank processes never outlive their launcher, and a dead or stopped rank is named in seconds
(the heartbeat limit is shortened here; the default is 30 s)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_bytescale.errors import ConfigError
from megatron_bytescale.local_world import (
    RESULT_DIR_PREFIX,
    WorkerError,
    check_world_size,
    remove_stale_result_dirs,
    run_local_world,
)
from megatron_bytescale.process_lifetime import _alive

import lifetime_support
from lifetime_support import wait_for

HERE = Path(__file__).resolve().parent


def _launch_sleepers(tmp_path):
    """A launcher of two sleeping ranks, its temporary files under tmp_path/tmp."""
    (tmp_path / "tmp").mkdir(exist_ok=True)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
        "TMPDIR": str(tmp_path / "tmp"),
    }
    proc = subprocess.Popen([sys.executable, str(HERE / "lifetime_support.py"), str(tmp_path)], env=env)

    def pids():
        files = [tmp_path / f"rank{r}" for r in range(2)]
        if all(f.exists() and f.read_text() for f in files):
            return [int(f.read_text()) for f in files]
        return None

    try:
        return proc, wait_for(pids, 90, "both ranks to start")
    except AssertionError:
        proc.kill()
        raise


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT])
def test_ranks_die_with_their_launcher(tmp_path, sig):
    proc, pids = _launch_sleepers(tmp_path)
    assert all(_alive(p) for p in pids)
    proc.send_signal(sig)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:  # leave its signal masks and its stacks for the log
        status = [line.strip() for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines()]
        masks = [line for line in status if line.startswith(("SigBlk", "SigIgn", "SigCgt"))]
        proc.send_signal(signal.SIGUSR1)  # lifetime_support registers faulthandler on it
        time.sleep(2)
        proc.kill()
        raise AssertionError(f"the launcher still ran 30 s after {sig.name} ({masks}); its stacks are above") from None
    wait_for(lambda: not any(_alive(p) for p in pids), 15, f"ranks {pids} to end after {sig.name}")
    if sig == signal.SIGTERM:
        assert proc.returncode == 143
    left = sorted((tmp_path / "tmp").glob(f"{RESULT_DIR_PREFIX}{proc.pid}-*"))
    if sig != signal.SIGKILL:  # the launcher removed its ranks' result folder itself
        assert not left, left
        return
    # SIGKILL gave it no chance: the next launch removes the folder of the dead launcher, and
    # only that one (not a live launcher's, not another name)
    assert len(left) == 1, left
    live = tmp_path / "tmp" / f"{RESULT_DIR_PREFIX}{os.getpid()}-live"
    other = tmp_path / "tmp" / f"{RESULT_DIR_PREFIX}notapid"
    live.mkdir(), other.mkdir()
    assert remove_stale_result_dirs(str(tmp_path / "tmp")) == [str(left[0])]
    assert not left[0].exists() and live.is_dir() and other.is_dir()


def test_a_stopped_rank_is_named_within_seconds():
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match=r"rank 1 \(pid \d+\) stopped responding: no heartbeat"):
        run_local_world(lifetime_support.stop_rank_one, 2, timeout_s=600, heartbeat_timeout_s=2)
    assert time.monotonic() - t0 < 45


def test_a_dead_rank_is_named_not_its_peers_connection_error():
    with pytest.raises(WorkerError, match=r"^rank 1 exited with code 3 before reporting"):
        run_local_world(lifetime_support.die_on_rank_one, 2, timeout_s=600)


def test_a_ring_exchange_without_progress_names_its_peers():
    message, _ = run_local_world(lifetime_support.wedged_ring_peer, 2, timeout_s=60)
    assert message.startswith(
        "ring exchange made no progress for 2 s: ring (0, 1): this rank (global 0) sends to global rank 1"
    )


def test_bad_input_found_in_a_rank_comes_back_as_its_one_line_error():
    with pytest.raises(ConfigError, match=r"^--thing 7 is wrong; use 8$"):
        run_local_world(lifetime_support.bad_input_in_rank, 2, timeout_s=60)


def test_a_world_the_machine_cannot_hold_is_refused_before_any_process_starts():
    with pytest.raises(ConfigError, match=r"--world-size 100000: this machine can hold at most \d+ local gloo ranks"):
        check_world_size(100_000)
    with pytest.raises(ConfigError, match="at least 1"):
        check_world_size(0)


def test_a_rank_destroys_its_process_groups_before_the_interpreter_ends(tmp_path):
    """Gloo work finished but still referenced at exit: the rank's exit hook destroys the
    process group while the interpreter is whole (a hook registered before it runs after it
    and sees no group), and the rank exits 0."""
    script = f"""
import atexit
import torch
import torch.distributed as dist
atexit.register(lambda: print("initialized after the hook:", dist.is_initialized(), flush=True))
from megatron_bytescale.megatron import rank_guard
rank_guard.destroy_process_groups_at_exit()
rank_guard.destroy_process_groups_at_exit()  # idempotent
dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=0, world_size=1)
kept = [dist.all_reduce(torch.ones(1024), async_op=True) for _ in range(4)]
kept[-1].wait()
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "initialized after the hook: False" in proc.stdout, (proc.stdout, proc.stderr[-2000:])
