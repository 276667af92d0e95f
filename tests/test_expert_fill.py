"""Expert parallelism: local slots moved into the waits before rings (planner/expert_fill.py)."""

from collections import Counter
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings

from megatron_bytescale.planner import planner as planner_module
from megatron_bytescale.planner.contract import MicroBatch, Plan, ring_pieces, whole_piece
from megatron_bytescale.planner.contract.slots import slot_errors
from megatron_bytescale.planner.expert_fill import fill_ring_waits
from megatron_bytescale.planner.expert_slots import align_expert_slots, slot_finish_times
from megatron_bytescale.planner.planner import plan_step

from planner_cases import expert_parallel_cases, small_cost

COST = small_cost(moe_a2a_bytes_per_token=64.0)


def _rings(plan):
    """Each rank's ring keys, in order."""
    return [[mb.ring_key for mb in mbs if mb.ring_key is not None] for mbs in plan.ranks]


def _held(plan):
    return [Counter(mbs) for mbs in plan.ranks]


def test_rings_start_when_their_groups_are_free_and_local_slots_fill_around_them():
    # EP groups {0, 1} and {2, 3}; sequence 0 rings over all four ranks. Rank 0 lists a short
    # local before the ring and two after it, rank 2 a long local before it. Aligned as listed,
    # the ring waits for rank 2's long slot, then {0, 1} still runs its two short slots: the
    # step is long + ring + 2 short. Filled, the ring starts at once and each group runs its
    # local slots after it: long + ring
    mb = lambda *p: MicroBatch(tuple(p))  # noqa: E731
    ring = ring_pieces(0, 400, (0, 1, 2, 3))
    lens = (400, 60, 60, 60, 300)
    ranks = (
        (mb(whole_piece(1, 60, 0)), mb(ring[0]), mb(whole_piece(2, 60, 0)), mb(whole_piece(3, 60, 0))),
        (mb(ring[1]),),
        (mb(whole_piece(4, 300, 2)), mb(ring[2])),
        (mb(ring[3]),),
    )
    plain = Plan(num_ranks=4, capacity=400, num_layers=6, seq_lens=lens, ranks=ranks).validate()
    aligned = align_expert_slots(plain, 2).validate()
    assert [mb.ring_key is not None for mb in aligned.ranks[0]] == [False, True, False, False]
    filled = fill_ring_waits(aligned, COST, ranks_per_node=4).validate()
    assert [mb.ring_key is not None for mb in filled.ranks[0]] == [True, False, False, False]
    assert [mb.ring_key is not None for mb in filled.ranks[2]] == [True, False]
    before, after = slot_finish_times(aligned, COST, 4), slot_finish_times(filled, COST, 4)
    # aligned, {0, 1} ends last, two short slots after {2, 3}; filled, {2, 3} ends last, at
    # what was {2, 3}'s end before
    assert before[0] > before[2] and max(after) == pytest.approx(after[2]) == pytest.approx(before[2])
    assert slot_errors(filled) == []
    assert _held(filled) == _held(aligned) and _rings(filled) == _rings(aligned)


def test_without_rings_or_expert_parallelism_the_plan_is_kept():
    mb = MicroBatch((whole_piece(0, 5, 0),))
    ranks = ((mb,), (MicroBatch(()),))
    lone = Plan(num_ranks=2, capacity=10, num_layers=6, seq_lens=(5,), ranks=ranks, expert_parallel=2)
    assert fill_ring_waits(lone, COST, 2) is lone
    plain = Plan(num_ranks=1, capacity=10, num_layers=6, seq_lens=(5,), ranks=((mb,),))
    assert fill_ring_waits(plain, COST, 1) is plain


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(expert_parallel_cases(groups=(2, 4), max_long=5, balances=("dp",)))
def test_filled_plans_keep_every_micro_batch_and_ring_order_and_the_planner_keeps_the_shorter(case):
    lens, config = case
    with mock.patch.object(planner_module, "fill_ring_waits", lambda plan, *_: plan):  # the plan before the fill
        aligned = plan_step(lens, config, COST)
    filled = fill_ring_waits(aligned, COST, config.ranks_per_node)
    filled.validate()  # every token once, rings consistent
    assert slot_errors(filled) == []  # and the slots cannot deadlock
    assert _held(filled) == _held(aligned)  # each rank holds what it held
    assert _rings(filled) == _rings(aligned)  # its rings in their order
    ours = plan_step(lens, config, COST)
    assert ours.ranks in (aligned.ranks, filled.ranks)
    assert ours.meta["est_time_max_s"] <= aligned.meta["est_time_max_s"]
    assert ours.meta["est_time_max_s"] == pytest.approx(max(slot_finish_times(ours, COST, config.ranks_per_node)))
