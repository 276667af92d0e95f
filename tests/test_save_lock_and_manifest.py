"""One writer per --save folder across nodes (folder_lock.HeartbeatLock), checkpoint manifests
(checkpoint_manifest) and the choice of the iteration to load (megatron.checkpoint_guard), on
plain folders: no Megatron, no torch.distributed (one process verifies everything)."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from megatron_bytescale import checkpoint_manifest as manifest
from megatron_bytescale import folder_lock
from megatron_bytescale.errors import ConfigError
from megatron_bytescale.folder_lock import SAVE_LOCK, HeartbeatLock
from megatron_bytescale.megatron import checkpoint_guard


# ------------------------------------------------------------------ the lock
def test_a_second_holder_is_refused_with_one_line_naming_the_first(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    with HeartbeatLock(tmp_path, what="training run"):
        with pytest.raises(ConfigError) as refused:
            HeartbeatLock(tmp_path, what="training run").acquire()
        message = str(refused.value)
        assert "\n" not in message
        assert message.startswith(
            f"--save {tmp_path} is in use by another training run (job 4242, pid {os.getpid()} "
            f"on {socket.gethostname()}, heartbeat 0 s ago)"
        )
        with pytest.raises(ConfigError, match="is in use by another"):
            HeartbeatLock(tmp_path).check_free()
    assert not (tmp_path / SAVE_LOCK).exists()  # released on exit
    HeartbeatLock(tmp_path).check_free()


def test_the_lock_of_a_dead_process_on_this_host_is_taken_over_saying_so(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    (tmp_path / SAVE_LOCK).write_text(json.dumps({"host": socket.gethostname(), "pid": pid, "job": "7", "started": 0}))
    HeartbeatLock(tmp_path).check_free()  # a stale lock does not block the launcher's look
    lock = HeartbeatLock(tmp_path).acquire()
    try:
        assert lock.took_over == f"job 7, pid {pid} on {socket.gethostname()}: its process is gone"
        assert json.loads((tmp_path / SAVE_LOCK).read_text())["pid"] == os.getpid()
    finally:
        lock.release()


def test_a_lock_from_another_node_is_kept_while_it_beats_and_taken_over_after(tmp_path, monkeypatch):
    path = tmp_path / SAVE_LOCK
    path.write_text(json.dumps({"host": "gpu-node-99", "pid": 1, "job": "11", "started": 0}))
    with pytest.raises(ConfigError, match=r"job 11, pid 1 on gpu-node-99, heartbeat \d+ s ago"):
        HeartbeatLock(tmp_path).acquire()
    old = time.time() - folder_lock.STALE_AFTER_S - 5
    os.utime(path, (old, old))
    lock = HeartbeatLock(tmp_path).acquire()
    try:
        assert lock.took_over.startswith("job 11, pid 1 on gpu-node-99: no heartbeat for ")
    finally:
        lock.release()


def test_an_elastic_restart_takes_over_its_own_jobs_lock_from_a_beating_node(tmp_path, monkeypatch):
    """After an elastic restart (TORCHELASTIC_RESTART_COUNT > 0) the lock of this job's previous
    round is taken over at once, even while another node's lock still looks fresh; another job's
    lock is still refused."""
    path = tmp_path / SAVE_LOCK
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-7")
    path.write_text(json.dumps({"host": "lost-node", "pid": 1, "job": "run-7", "started": 0}))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    with pytest.raises(ConfigError, match="in use by another"):
        HeartbeatLock(tmp_path).acquire()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    lock = HeartbeatLock(tmp_path).acquire()
    try:
        assert "elastic restart 1" in lock.took_over
    finally:
        lock.release()
    path.write_text(json.dumps({"host": "lost-node", "pid": 1, "job": "run-8", "started": 0}))
    with pytest.raises(ConfigError, match="in use by another"):
        HeartbeatLock(tmp_path).acquire()


def test_the_holder_beats(tmp_path, monkeypatch):
    monkeypatch.setattr(folder_lock, "HEARTBEAT_S", 0.05)
    with HeartbeatLock(tmp_path):
        old = time.time() - 100
        os.utime(tmp_path / SAVE_LOCK, (old, old))
        time.sleep(0.5)
        assert time.time() - (tmp_path / SAVE_LOCK).stat().st_mtime < 5


def test_a_half_written_lock_of_a_live_run_is_not_taken(tmp_path):
    (tmp_path / SAVE_LOCK).write_text("")  # created, its identity not yet written
    with pytest.raises(ConfigError, match=r"pid \? on \?"):
        HeartbeatLock(tmp_path).acquire()


# ------------------------------------------------------------------ manifests
def _checkpoint(folder, seed=0):
    folder.mkdir(parents=True)
    for name, size in (("__0_0.distcp", 5000), ("__1_0.distcp", 7000), (".metadata", 300), ("common.pt", 100)):
        (folder / name).write_bytes(bytes((i * 7 + seed) % 251 for i in range(size)))
    (folder / "mp_rank_00").mkdir()
    (folder / "mp_rank_00" / "model_optim_rng.pt").write_bytes(b"x" * 50)
    entries = {}
    files = manifest.files_of(folder)
    for i in range(3):  # three workers' shares make the whole
        entries.update(manifest.digests(folder, manifest.share(files, i, 3)))
    manifest.write(folder, entries)
    return folder


def test_a_manifest_lists_every_file_and_verifies(tmp_path):
    folder = _checkpoint(tmp_path / "iter_0000002")
    entries = manifest.read(folder)
    assert sorted(entries) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "common.pt",
        "mp_rank_00/model_optim_rng.pt",
    ]
    assert entries["__1_0.distcp"]["bytes"] == 7000 and len(entries["__1_0.distcp"]["sha256"]) == 64
    assert manifest.verify(folder) is None
    assert not list(folder.glob(".bytescale-manifest.json.tmp-*"))


@pytest.mark.parametrize(
    "damage, reason",
    [
        ("truncate", "__1_0.distcp is truncated or overwritten: 3500 of 7000 bytes"),
        ("flip", "__1_0.distcp does not match its checksum (corrupted)"),
        ("missing", "__1_0.distcp is missing"),
        ("extra", "__2_0.distcp is not in the manifest (written by another run?)"),
        ("no manifest", manifest.NO_MANIFEST),
        ("bad manifest", "manifest malformed"),
    ],
)
def test_damage_is_named(tmp_path, damage, reason):
    folder = _checkpoint(tmp_path / "iter_0000002")
    shard = folder / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    if damage == "truncate":
        shard.write_bytes(data[:3500])
    elif damage == "flip":
        data[100] ^= 0x01
        shard.write_bytes(bytes(data))
    elif damage == "missing":
        shard.unlink()
    elif damage == "extra":
        (folder / "__2_0.distcp").write_bytes(b"other run")
    elif damage == "no manifest":
        (folder / manifest.MANIFEST).unlink()
    else:
        (folder / manifest.MANIFEST).write_text('{"version": 1}')
    assert manifest.verify(folder) == reason


# ------------------------------------------------------------------ which iteration loads
def test_load_falls_back_to_the_newest_iteration_that_verifies(tmp_path):
    for i in (2, 4, 6):
        _checkpoint(tmp_path / f"iter_{i:07d}", seed=i)
    (tmp_path / "iter_0000008").mkdir()  # a save the tracker never named: not a candidate
    (tmp_path / checkpoint_guard.TRACKER).write_text("6")
    (tmp_path / "iter_0000006" / manifest.MANIFEST).unlink()  # killed before its manifest
    shard = tmp_path / "iter_0000004" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:10])
    iteration, lines = checkpoint_guard.choose_iteration(tmp_path)
    assert iteration == 2
    assert lines == [
        f"bytescale: skipped checkpoint iter_0000006 in {tmp_path}: {manifest.NO_MANIFEST}",
        f"bytescale: skipped checkpoint iter_0000004 in {tmp_path}: "
        "__0_0.distcp is truncated or overwritten: 10 of 5000 bytes",
        f"bytescale: checkpoint iter_0000002 in {tmp_path} verified against its manifest",
    ]


def test_a_tracker_naming_a_missing_folder_is_skipped_saying_so(tmp_path):
    _checkpoint(tmp_path / "iter_0000002")
    (tmp_path / checkpoint_guard.TRACKER).write_text("4")
    iteration, lines = checkpoint_guard.choose_iteration(tmp_path)
    assert (
        iteration == 2
        and lines[0] == f"bytescale: skipped checkpoint iter_0000004 in {tmp_path}: its folder is missing"
    )


def test_no_verifying_iteration_is_one_line(tmp_path):
    _checkpoint(tmp_path / "iter_0000002")
    (tmp_path / checkpoint_guard.TRACKER).write_text("2")
    (tmp_path / "iter_0000002" / "common.pt").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"^--load .*: no checkpoint verifies \(iter_0000002: common.pt is truncated"):
        checkpoint_guard.choose_iteration(tmp_path)


def test_folders_without_manifests_or_tracker_are_left_to_megatron(tmp_path):
    assert checkpoint_guard.choose_iteration(tmp_path) == (None, [])
    (tmp_path / "iter_0000003").mkdir()
    (tmp_path / checkpoint_guard.TRACKER).write_text("3")
    iteration, lines = checkpoint_guard.choose_iteration(tmp_path)
    assert (
        iteration is None and "no checkpoint manifests" in lines[0] and "iteration 3 is loaded unverified" in lines[0]
    )
    (tmp_path / checkpoint_guard.TRACKER).write_text("release")
    assert checkpoint_guard.choose_iteration(tmp_path) == (None, [])


@pytest.mark.parametrize("tracker", [None, "abc"], ids=["tracker deleted", "tracker garbled"])
def test_no_readable_tracker_beside_verified_folders_resumes_the_newest_that_verifies(tmp_path, tracker):
    # Megatron would start from random weights and overwrite these folders (deleted tracker), or
    # exit 0 having trained nothing (garbled tracker)
    for i in (2, 4):
        _checkpoint(tmp_path / f"iter_{i:07d}", seed=i)
    (tmp_path / "iter_0000004" / ".metadata").write_bytes(b"\xff" * 300)  # same size, other bytes
    if tracker is not None:
        (tmp_path / checkpoint_guard.TRACKER).write_text(tracker)
    iteration, lines = checkpoint_guard.choose_iteration(tmp_path)
    said = "is missing" if tracker is None else "holds 'abc', not an iteration"
    assert iteration == 2 and lines == [
        f"bytescale: {tmp_path}/{checkpoint_guard.TRACKER} {said}: resuming from the newest checkpoint that verifies",
        f"bytescale: skipped checkpoint iter_0000004 in {tmp_path}: .metadata does not match its checksum (corrupted)",
        f"bytescale: checkpoint iter_0000002 in {tmp_path} verified against its manifest",
    ]


def test_an_unreadable_tracker_with_nothing_to_choose_from_is_one_line(tmp_path):
    (tmp_path / checkpoint_guard.TRACKER).write_text("abc")
    with pytest.raises(ConfigError, match=r"holds 'abc', not an iteration, and no iter_\* folder is there"):
        checkpoint_guard.choose_iteration(tmp_path)
    (tmp_path / checkpoint_guard.TRACKER).unlink()
    (tmp_path / "iter_0000003").mkdir()  # saved before manifests existed: nothing to choose one by
    with pytest.raises(ConfigError, match=r"is missing, and its iter_\* folders \(newest iter_0000003\) have no manif"):
        checkpoint_guard.choose_iteration(tmp_path)


def test_the_only_checkpoint_whose_manifest_a_kill_interrupted_loads_unverified_saying_so(tmp_path):
    # the marker says this folder's saves write manifests: a missing one was interrupted, not
    # "saved without them"
    _checkpoint(tmp_path / "iter_0000002")
    (tmp_path / "iter_0000002" / manifest.MANIFEST).unlink()
    (tmp_path / checkpoint_guard.TRACKER).write_text("2")
    (tmp_path / checkpoint_guard.MARKER).write_text("{}")
    assert checkpoint_guard.choose_iteration(tmp_path) == (
        None,
        [
            f"bytescale: checkpoint iter_0000002 in {tmp_path} has no manifest (a kill came after Megatron's save "
            "and before the manifest) and no older one verifies: it is loaded unverified"
        ],
    )


def test_a_save_folder_holding_checkpoints_is_written_only_by_a_run_resuming_it(tmp_path):
    from types import SimpleNamespace

    save = tmp_path / "ckpt"
    checkpoint_guard.check_overwrite(SimpleNamespace(save=str(save), load=None))  # nothing there yet
    _checkpoint(save / "iter_0000004")
    checkpoint_guard.check_overwrite(SimpleNamespace(save=str(save), load=str(tmp_path / "." / "ckpt")))
    for load, finetune, how in (
        (None, False, "it starts from scratch (no --load)"),
        (str(tmp_path / "other"), False, "it loads from another folder"),
        (str(save), True, "it starts at iteration 0 (--finetune)"),
    ):
        with pytest.raises(ConfigError) as error:
            checkpoint_guard.check_overwrite(SimpleNamespace(save=str(save), load=load, finetune=finetune))
        assert str(error.value) == (
            f"--save {save} already holds checkpoints (newest iter_0000004) that this run would overwrite: {how}; "
            f"resume them with --load {save}, or choose an empty --save"
        )


def test_while_another_iteration_loads_the_trackers_reads_answer_it(tmp_path):
    calls = []

    def read_metadata(tracker_filename):  # Megatron's: exits 0 on a garbled tracker
        calls.append(tracker_filename)
        raise SystemExit(0)

    read = checkpoint_guard.chosen_tracker(read_metadata)
    assert checkpoint_guard.chosen_tracker(read) is read
    checkpoint_guard._chosen = (str(tmp_path), 2)
    try:
        assert read(str(tmp_path / checkpoint_guard.TRACKER)) == (2, False)
        with pytest.raises(SystemExit):  # another folder's tracker (a non-persistent one) reads as it is
            read(str(tmp_path / "non_persistent" / checkpoint_guard.TRACKER))
    finally:
        checkpoint_guard._chosen = None
    assert calls == [str(tmp_path / "non_persistent" / checkpoint_guard.TRACKER)]


def test_an_unwritable_folder_is_one_line_and_leaves_no_lock(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    lock = HeartbeatLock(blocker / "ckpt", what="training run")
    for attempt in (lock.check_writable, lock.acquire):
        with pytest.raises(ConfigError, match=rf"^--save {blocker}/ckpt: cannot write there \(Not a directory\); "):
            attempt()
    # a write that fails after the lock file was created (a full disk) removes it
    folder = tmp_path / "full"
    folder.mkdir()
    lock = HeartbeatLock(folder, what="training run")

    def no_space(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(folder_lock.os, "fsync", no_space)
    with pytest.raises(ConfigError, match=r"cannot write there \(No space left on device\)"):
        lock.acquire()
    monkeypatch.undo()
    assert not (folder / SAVE_LOCK).exists() and not list(folder.iterdir())
