"""A local run whose shape costs it (more ranks than cores, a capacity that leaves nothing to
split) is told so before it starts (the demo, and the launcher of pretrain_gpt.py)."""

import os

from megatron_bytescale.local_world import shape_warnings


def test_more_ranks_than_cores_and_a_capacity_over_the_longest_sequence_are_said(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert shape_warnings(2, 1024, 4096) == []
    (cores,) = shape_warnings(4, 1024, 4096)
    assert cores.startswith("warning: 4 ranks on 2 cores") and "about 2.0x as long" in cores
    (whole,) = shape_warnings(2, 8192, 4096)
    assert "capacity 8192 tokens holds the longest sequence (4096 tokens) on one rank" in whole
    assert "no ring forms" in whole
    assert len(shape_warnings(4, 4096, 4096)) == 2  # a sequence of exactly the capacity needs no ring either
