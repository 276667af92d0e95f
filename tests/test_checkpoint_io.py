"""Checkpoint files: atomic, checksummed, and the newest valid one is found among damaged ones."""

from __future__ import annotations

import pytest
import torch

from megatron_bytescale.checkpoint_io import CheckpointError, load, newest_valid, save


def state(step):
    return {"step": step, "w": torch.arange(4096, dtype=torch.float32) * step}


def test_round_trip_and_no_temporary_left(tmp_path):
    save(tmp_path / "step_3.pt", state(3))
    assert torch.equal(load(tmp_path / "step_3.pt")["w"], state(3)["w"])
    assert [p.name for p in tmp_path.iterdir()] == ["step_3.pt"]


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda p: p.write_bytes(b""), "empty file"),
        (lambda p: p.write_bytes(p.read_bytes()[:-1000]), "truncated"),
        (lambda p: p.write_bytes(p.read_bytes()[:6000] + bytes(4096) + p.read_bytes()[10096:]), "checksum mismatch"),
        (lambda p: p.write_text("not a checkpoint\n"), "no checkpoint header"),
    ],
)
def test_damage_is_detected(tmp_path, damage, reason):
    path = save(tmp_path / "step_1.pt", state(1))
    damage(path)
    with pytest.raises(CheckpointError, match=reason):
        load(path)


def test_newest_valid_skips_damaged_and_ignores_non_checkpoints(tmp_path):
    for s in (2, 4, 6):
        save(tmp_path / f"step_{s}.pt", state(s))
    (tmp_path / "step_6.pt").write_bytes(b"")  # killed mid-write by an older, non-atomic writer
    (tmp_path / "step_99.pt").write_text("hello")  # a text file with a checkpoint's name
    (tmp_path / "step_4 (copy).pt").write_bytes((tmp_path / "step_4.pt").read_bytes()[:10])
    (tmp_path / ".step_8.pt.tmp-123").write_bytes(b"partial")
    found = newest_valid(tmp_path)
    assert found.path == tmp_path / "step_4.pt" and found.step == 4
    assert [(p.name, why) for p, why in found.skipped] == [
        ("step_99.pt", "no checkpoint header (not written by bytescale, or overwritten)"),
        ("step_6.pt", "empty file (a write was interrupted)"),
    ]
    assert found.report()[-1] == f"resuming from {tmp_path / 'step_4.pt'} (step 4)"


def test_a_checkpoint_renamed_to_another_step_is_skipped(tmp_path):
    save(tmp_path / "step_5.pt", state(2))
    assert newest_valid(tmp_path).skipped[0][1] == "holds step 2, not 5"
    assert newest_valid(tmp_path / "missing").path is None
