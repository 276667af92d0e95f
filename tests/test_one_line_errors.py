"""Where a traceback used to come out, one line: an output folder that cannot be written (the
demo's --out, its default under a read-only working directory, dataloader-bench's cache under an
unwritable HOME), a negative --seed, and a checkpoint write that fails (full disk, read-only
folder) with the previous checkpoint left intact. Unwritable places are /sys paths (root may
write almost anywhere else) and a patched fsync for a full disk."""

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_bytescale import checkpoint_io
from megatron_bytescale.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
UNWRITABLE = "/sys/bytescale-out"


def _can_create(path: str) -> bool:
    try:
        os.mkdir(path)
    except OSError:
        return False
    os.rmdir(path)
    return True


needs_unwritable = pytest.mark.skipif(_can_create(UNWRITABLE), reason=f"{UNWRITABLE} can be created here")


def bytescale(*argv, cwd=ROOT, **env):
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_bytescale.cli", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        env=dict(os.environ, PYTHONPATH=str(ROOT), **env),
    )
    return proc


def _one_error_line(proc, prefix):
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert proc.returncode == 2 and len(errors) == 1 and errors[0].startswith(prefix), proc.stderr[-3000:]
    return errors[0]


@needs_unwritable
def test_demo_out_that_cannot_be_written(tmp_path):
    line = _one_error_line(bytescale("demo", "--out", UNWRITABLE, "--steps", "1"), "bytescale demo: error: ")
    assert (
        line.startswith(f"bytescale demo: error: --out {UNWRITABLE}: cannot write there (")
        and "choose a writable --out" in line
    )
    # the default --out under a working directory that cannot be written
    line = _one_error_line(
        bytescale("demo", "--steps", "1", cwd="/sys"), "bytescale demo: error: --out runs/demo: cannot write there"
    )


@needs_unwritable
def test_dataloader_bench_cache_that_cannot_be_written():
    proc = bytescale("dataloader-bench", "--steps", "1", XDG_CACHE_HOME=UNWRITABLE)
    line = _one_error_line(proc, "bytescale dataloader-bench: error: cannot build the default corpus in ")
    assert "pass --data PREFIX" in line and "XDG_CACHE_HOME" in line


@pytest.mark.parametrize("command", ["simulate", "demo", "dataloader-bench"])
def test_a_negative_seed_is_refused_by_the_parser(command):
    proc = bytescale(command, "--seed", "-1")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"bytescale {command}: error: argument --seed: a seed is a whole number from 0 to 4294967295, got -1"
    )


@pytest.mark.parametrize("failure", [errno.ENOSPC, errno.EROFS])
def test_a_failed_checkpoint_write_is_one_line_and_keeps_the_previous(tmp_path, monkeypatch, failure):
    path = tmp_path / "step_2.pt"
    checkpoint_io.save(path, {"step": 2})
    real_fsync = os.fsync

    def fail(fd):
        raise OSError(failure, os.strerror(failure))

    monkeypatch.setattr(os, "fsync", fail)
    with pytest.raises(ConfigError) as exc:
        checkpoint_io.save(path, {"step": 4})
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert str(exc.value) == (
        f"cannot write checkpoint {path} ({os.strerror(failure)}); the previous checkpoint is intact: "
        "free space or make the folder writable, then run again to resume"
    )
    assert checkpoint_io.load(path) == {"step": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["step_2.pt"]  # no temporary file left
