"""Expert parallelism: local slots moved into the waits before rings (planner/expert/fill.py)."""

from collections import Counter
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_bytescale.planner import planner as planner_module
from megatron_bytescale.planner.contract import MicroBatch, Plan, ring_pieces, whole_piece
from megatron_bytescale.planner.contract.slots import slot_errors
from megatron_bytescale.planner.expert.fill import fill_ring_waits
from megatron_bytescale.planner.expert.slots import align_expert_slots
from megatron_bytescale.planner.expert.timing import slot_finish_times
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
    filled, finish = fill_ring_waits(aligned, COST, ranks_per_node=4)
    filled.validate()
    assert [mb.ring_key is not None for mb in filled.ranks[0]] == [True, False, False, False]
    assert [mb.ring_key is not None for mb in filled.ranks[2]] == [True, False]
    before, after = slot_finish_times(aligned, COST, 4), slot_finish_times(filled, COST, 4)
    assert finish == after  # the estimate it returns is slot_finish_times's
    # aligned, {0, 1} ends last, two short slots after {2, 3}; filled, {2, 3} ends last, at
    # what was {2, 3}'s end before
    assert before[0] > before[2] and max(after) == pytest.approx(after[2]) == pytest.approx(before[2])
    assert slot_errors(filled) == []
    assert _held(filled) == _held(aligned) and _rings(filled) == _rings(aligned)


def test_without_rings_the_plan_is_kept():
    mb = MicroBatch((whole_piece(0, 5, 0),))
    ranks = ((mb,), (MicroBatch(()),))
    lone = Plan(num_ranks=2, capacity=10, num_layers=6, seq_lens=(5,), ranks=ranks, expert_parallel=2)
    kept, finish = fill_ring_waits(lone, COST, 2)
    assert kept is lone and finish == slot_finish_times(lone, COST, 2)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(expert_parallel_cases(groups=(2, 4), max_long=5, balances=("dp",)))
def test_filled_plans_keep_every_micro_batch_and_ring_order_and_the_planner_keeps_the_shorter(case):
    lens, config = case
    unfilled = lambda plan, cost, rpn: (plan, slot_finish_times(plan, cost, rpn))  # noqa: E731
    with mock.patch.object(planner_module, "fill_ring_waits", unfilled):  # the plan before the fill
        aligned = plan_step(lens, config, COST)
    filled, finish = fill_ring_waits(aligned, COST, config.ranks_per_node)
    assert finish == slot_finish_times(filled, COST, config.ranks_per_node)
    filled.validate()  # every token once, rings consistent
    assert slot_errors(filled) == []  # and the slots cannot deadlock
    assert _held(filled) == _held(aligned)  # each rank holds what it held
    assert _rings(filled) == _rings(aligned)  # its rings in their order
    assert max(finish) <= aligned.meta["est_time_max_s"]  # kept only where shorter
    assert (filled is aligned) == (max(finish) == aligned.meta["est_time_max_s"])
    ours = plan_step(lens, config, COST)  # the planner returns it, with its estimate
    assert ours.ranks == filled.ranks and ours.meta["est_rank_time_s"] == finish


@st.composite
def ring_plans(draw):
    """An aligned EP 2 plan of 2-4 groups: rings over random sets of whole groups (in one
    global order on every member) and local sequences at random places between them."""
    groups = draw(st.integers(2, 4))
    ranks: list[list] = [[] for _ in range(2 * groups)]
    lens: list[int] = []
    mb = lambda *p: MicroBatch(tuple(p))  # noqa: E731
    for _ in range(draw(st.integers(1, 4))):
        chosen = draw(st.sets(st.integers(0, groups - 1), min_size=1))
        members = tuple(r for g in sorted(chosen) for r in (2 * g, 2 * g + 1))
        lens.append(draw(st.integers(40, 400)))
        for r, piece in zip(members, ring_pieces(len(lens) - 1, lens[-1], members)):
            ranks[r].append(mb(piece))
    for r in range(len(ranks)):
        for _ in range(draw(st.integers(0, 4))):
            lens.append(draw(st.integers(10, 300)))
            ranks[r].insert(draw(st.integers(0, len(ranks[r]))), mb(whole_piece(len(lens) - 1, lens[-1], r)))
    plain = Plan(num_ranks=len(ranks), capacity=400, num_layers=6, seq_lens=tuple(lens), ranks=tuple(map(tuple, ranks)))
    return align_expert_slots(plain.validate(), 2)


@settings(max_examples=150, deadline=None)
@given(ring_plans())
def test_filling_never_lengthens_the_step_and_keeps_the_plan_valid(aligned):
    filled, finish = fill_ring_waits(aligned, COST, ranks_per_node=2)
    filled.validate()
    assert slot_errors(filled) == []
    assert _held(filled) == _held(aligned) and _rings(filled) == _rings(aligned)
    assert finish == slot_finish_times(filled, COST, 2)
    assert max(finish) <= max(slot_finish_times(aligned, COST, 2))
