"""The demo survives kills and damaged checkpoints, and refuses bad input in the parent (before
any rank starts, as one line)."""

from __future__ import annotations

import math
import os
import shutil
import time

import numpy as np
import pytest
from test_demo import config, corpus, losses  # noqa: F401 - the corpus fixture

from megatron_bytescale.demo import run_demo
from megatron_bytescale.errors import BytescaleError
from megatron_bytescale.folder_lock import FolderLock, hold_as_worker


def test_resume_takes_the_newest_valid_checkpoint_and_continues_exactly(tmp_path, corpus, capsys):  # noqa: F811
    whole = run_demo(config(tmp_path / "whole", corpus, strategies=("hdp",), checkpoint_every=1))
    ckpts = tmp_path / "hurt" / "checkpoints" / "hdp"
    shutil.copytree(tmp_path / "whole" / "checkpoints" / "hdp", ckpts)
    (ckpts / "step_4.pt").write_bytes(b"")  # a kill mid-write by a non-atomic writer
    data = bytearray((ckpts / "step_3.pt").read_bytes())
    data[len(data) // 2 : len(data) // 2 + 4096] = bytes(4096)  # 4 KB zeroed inside
    (ckpts / "step_3.pt").write_bytes(bytes(data))
    (ckpts / "step_99.pt").write_text("not a checkpoint")
    shutil.copy(ckpts / "step_2.pt", ckpts / "step_4 (copy).pt")
    capsys.readouterr()

    rest = run_demo(config(tmp_path / "hurt", corpus, strategies=("hdp",), resume=True, checkpoint_every=0))
    out = capsys.readouterr().out
    assert "skipped step_99.pt: no checkpoint header" in out
    assert "skipped step_4.pt: empty file (a write was interrupted)" in out
    assert "skipped step_3.pt: checksum mismatch (the file is corrupted)" in out
    assert f"resuming from {ckpts / 'step_2.pt'} (step 2)" in out
    assert "copy" not in out
    assert losses(rest, "hdp") == losses(whole, "hdp")[2:]  # bit for bit

    t0 = time.monotonic()
    with pytest.raises(
        BytescaleError, match=r"^--lr 0.01 contradicts .*step_2.pt, trained with --lr 0.003; resume with --lr 0.003"
    ):
        run_demo(config(tmp_path / "hurt", corpus, strategies=("hdp",), resume=True, lr=0.01))
    with pytest.raises(BytescaleError, match=r"^--capacity 2048 contradicts .*trained with --capacity 1024"):
        run_demo(config(tmp_path / "hurt", corpus, strategies=("hdp",), resume=True, capacity=2048))
    assert time.monotonic() - t0 < 20  # refused before any rank started


def test_a_second_run_on_the_same_folder_is_refused_while_the_first_or_its_ranks_live(tmp_path, corpus):  # noqa: F811
    with FolderLock(tmp_path, "bytescale demo"):
        with pytest.raises(BytescaleError, match=rf"^another bytescale demo \(pid \d+\) is using {tmp_path}"):
            run_demo(config(tmp_path, corpus, resume=True))
    fd = hold_as_worker(tmp_path)  # an orphaned rank of an earlier run
    try:
        with pytest.raises(
            BytescaleError, match=rf"^processes of a previous bytescale demo on {tmp_path} are still running"
        ):
            run_demo(config(tmp_path, corpus, resume=True))
    finally:
        os.close(fd)


@pytest.fixture
def wide_ids_corpus(tmp_path, corpus):  # noqa: F811
    """The corpus with one token id beyond the tiny model's vocabulary, and no sidecar to tell."""
    prefix = tmp_path / "wide"
    for ext in (".bin", ".idx"):
        shutil.copy(corpus + ext, str(prefix) + ext)
    tokens = np.memmap(str(prefix) + ".bin", dtype=np.uint16, mode="r+")
    tokens[100] = 600
    tokens.flush()
    return str(prefix)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"step_tokens": 100}, r"^--step-tokens 100 is smaller than --context 2048"),
        ({"lr": math.nan}, r"^--lr nan: the learning rate must be a positive finite number"),
        ({"lr": -1.0}, r"^--lr -1.0: the learning rate must be a positive"),
        ({"checkpoint_every": -1}, r"^--checkpoint-every -1: give a number of steps, or 0"),
        ({"ranks": 100_000}, r"^--ranks 100000: this machine can hold at most"),
        ({"profile": "BAD_JSON"}, r"bad.json: not valid YAML/JSON \(.* at line 1, column 8\)"),
        ({"data": "/no/such/prefix"}, r"/no/such/prefix"),
        (
            {"data": "WIDE"},
            r"^--data .*wide: token id 600 \(first in document 0\) is outside the tiny model's vocabulary of 512",
        ),
    ],
)
def test_bad_input_is_one_line_from_the_parent(tmp_path, corpus, wide_ids_corpus, change, message):  # noqa: F811
    if change.get("profile") == "BAD_JSON":
        (tmp_path / "bad.json").write_text('{"a1": ')
        change = {"profile": str(tmp_path / "bad.json")}
    if change.get("data") == "WIDE":
        change = {"data": wide_ids_corpus}
    t0 = time.monotonic()
    with pytest.raises(BytescaleError, match=message) as info:
        run_demo(config(tmp_path / "out", corpus, **change))
    assert "\n" not in str(info.value) and "Traceback" not in str(info.value)
    assert time.monotonic() - t0 < 10  # no rank was started
    assert not (tmp_path / "out" / "checkpoints").exists()
