"""The HDP step with two-level attention on 4 gloo ranks ("nodes" of 2) equals one rank:
megatron-core's tiny GPT (4 query heads, 2 KV groups), one sequence two-level with groups of
2 (u divides the KV heads), one with a group of 4 (it does not), whole sequences beside."""

from __future__ import annotations

import pytest
from test_hdp_step import TOL, _step, max_grad_diff, reference

from megatron_bytescale.local_world import run_local_world
from megatron_bytescale.planner.contract import MicroBatch, Plan, ring_pieces, whole_piece


def two_level_plan() -> Plan:
    lens = (45, 5, 33, 7)
    a = ring_pieces(0, 45, (2, 3, 0, 1), heads_split=2)  # groups (2, 3) and (0, 1)
    b = ring_pieces(2, 33, (0, 1, 2, 3), heads_split=4)  # one group: all-to-all only
    at = {r: i for i, r in enumerate((2, 3, 0, 1))}
    ranks = tuple(
        (
            MicroBatch((a[at[r]],) + ((whole_piece(1, 5, 1),) if r == 1 else ())),
            MicroBatch((b[r],) + ((whole_piece(3, 7, 3),) if r == 3 else ())),
        )
        for r in range(4)
    )
    return Plan(num_ranks=4, capacity=24, num_layers=4, seq_lens=lens, ranks=ranks).validate()


def test_two_level_step_on_four_ranks_equals_one_rank():
    plan = two_level_plan()
    outs = run_local_world(_step, 4, plan.to_json(), timeout_s=150)
    ref = reference(plan.seq_lens)
    for o in outs:
        assert o["tokens"] == ref["tokens"]
        assert o["loss"] == pytest.approx(ref["loss"], abs=TOL)
        assert max_grad_diff(o["grads"], ref["grads"]) < TOL
        assert o["p2p"] > 0
