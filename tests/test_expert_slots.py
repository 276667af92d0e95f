"""Aligned micro-batch slots for expert parallelism (planner/expert/slots.py): every token once,
slots equal per EP group, rings at one slot on all members, no deadlock; and the checks that
refuse plans that would hang."""

import dataclasses

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from megatron_bytescale.errors import ConfigError, PlanError
from megatron_bytescale.planner.contract import (
    MicroBatch,
    Plan,
    pipelined_finish_times,
    plan_pipeline_deadlock,
    ring_pieces,
    whole_piece,
)
from megatron_bytescale.planner.contract.slots import ep_groups, slot_errors, slot_unit_keys
from megatron_bytescale.planner.cost_model import CostModel
from megatron_bytescale.planner.expert.slots import align_expert_slots
from megatron_bytescale.planner.expert.timing import all_to_all_time, slot_finish_times
from megatron_bytescale.planner.planner import PlannerConfig, plan_step
from megatron_bytescale.planner.specs import HardwareSpec, ModelSpec

from planner_cases import expert_parallel_cases, small_cost


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(expert_parallel_cases())
# PP balance places its rings on whole EP groups too (its compiled scheduler places them as
# RingPlacer does: not used under EP)
@example(([4, 9], PlannerConfig(num_ranks=6, capacity=8, ranks_per_node=1, balance="pp", expert_parallel=2)))
def test_aligned_plans_hold_every_token_once_and_cannot_deadlock(case):
    lens, config = case
    cost = small_cost(moe_a2a_bytes_per_token=64.0)
    plan = plan_step(lens, config, cost)
    plan.validate()  # every token once, rings consistent, and slot_errors() empty
    assert plan.expert_parallel == config.expert_parallel
    assert Plan.from_json(plan.to_json()).ranks == plan.ranks
    # slots equal within each EP group
    for group in ep_groups(config.num_ranks, config.expert_parallel):
        assert len({len(plan.ranks[r]) for r in group}) == 1
    # a ring sits at one global slot on every member: the slot's position in the merged order
    # is the same wherever (the check: the slot graph has no self-loops or cycles)
    assert slot_errors(plan) == []
    # rings rounded to whole EP groups sit on whole groups (a group never mixes two rings)
    e = config.expert_parallel
    for mbs in plan.ranks:
        for mb in mbs:
            if mb.ring is not None and len(mb.ring) % e == 0 and mb.heads_split == 1:
                assert {r // e for r in mb.ring} == {r // e for r in mb.ring if r % e == 0} and len(
                    {r // e for r in mb.ring}
                ) * e == len(mb.ring)
    # the estimate waits for the slowest member of each slot: never below the no-wait sum
    finish = slot_finish_times(plan, cost, config.ranks_per_node)
    assert plan.meta["est_time_max_s"] == pytest.approx(max(finish))
    for rank in range(len(plan.ranks)):
        assert plan.meta["est_rank_time_s"][rank] == pytest.approx(finish[rank])


def _plan(ranks, lens, ep):
    return Plan(num_ranks=len(ranks), capacity=100, num_layers=2, seq_lens=lens, ranks=ranks, expert_parallel=ep)


def test_a_ring_across_ep_groups_gets_one_slot_and_idle_members_empty_slots():
    # EP groups {0, 1} and {2, 3}; sequence 0 rings over ranks 1 and 2 (one member in each)
    ring = ring_pieces(0, 30, (1, 2))
    mb = lambda *p: MicroBatch(tuple(p))  # noqa: E731
    lens = (30, 5, 6, 7, 8)
    ranks = (
        (mb(whole_piece(1, 5, 0)), mb(whole_piece(2, 6, 0))),
        (mb(ring[0]),),
        (mb(whole_piece(3, 7, 2)), mb(ring[1])),
        (mb(whole_piece(4, 8, 3)),),
    )
    plain = Plan(num_ranks=4, capacity=100, num_layers=2, seq_lens=lens, ranks=ranks).validate()
    aligned = align_expert_slots(plain, 2).validate()
    # rank 2 reaches the ring at its second slot, so the ring runs at global slot 1 on rank 1 as well;
    # rank 1 waits at slot 0 with an empty micro-batch, rank 3 after its one micro-batch
    assert [len(mbs) for mbs in aligned.ranks] == [2, 2, 2, 2]
    assert aligned.ranks[1][0].pieces == () and aligned.ranks[1][1].ring == (1, 2)
    assert aligned.ranks[2][1].ring == (1, 2)
    assert aligned.ranks[3][1].pieces == ()
    assert aligned.meta["expert_slots"] == {"slots_per_group": [2, 2], "empty_slots": 2}
    # the unaligned lists would hang: group {0, 1} runs 2 and 1 micro-batches
    with pytest.raises(PlanError, match=r"EP group \[0, 1\] holds different numbers"):
        _plan(ranks, lens, 2).validate()


def test_a_ring_at_different_slots_in_one_group_is_a_deadlock():
    # ranks 0 and 1 form one EP group; ring A = (0, 2), ring B = (1, 3); rank 0 runs A then a
    # local, rank 1 a local then B: slot 0 of the group joins A and B's... rank 2 runs B's partner
    # order so that the merged slots form a cycle
    a, b = ring_pieces(0, 20, (0, 2)), ring_pieces(1, 20, (1, 3))
    lens = (20, 20, 4, 4)
    mb = lambda *p: MicroBatch(tuple(p))  # noqa: E731
    ranks = (
        (mb(a[0]), mb(whole_piece(2, 4, 0))),
        (mb(whole_piece(3, 4, 1)), mb(b[0])),
        (mb(a[1]),),
        (mb(b[1]),),
    )
    # groups {0,1}, {2,3}: slot 0 of {0,1} holds A, so {2,3}'s slot 0 is A's too, and it holds
    # B on rank 3, which rank 1 runs at slot 1 of {0,1}: slot 1 must come before itself
    with pytest.raises(PlanError, match="deadlock"):
        _plan(ranks, lens, 2).validate()
    ok = align_expert_slots(Plan(num_ranks=4, capacity=100, num_layers=2, seq_lens=lens, ranks=ranks).validate(), 2)
    assert slot_errors(ok.validate()) == []


def test_empty_micro_batches_only_under_expert_parallelism():
    lens = (5,)
    ranks = ((MicroBatch((whole_piece(0, 5, 0),)),), (MicroBatch(()),))
    with pytest.raises(PlanError, match="empty micro-batch"):
        Plan(num_ranks=2, capacity=10, num_layers=2, seq_lens=lens, ranks=ranks).validate()
    _plan(ranks, lens, 2).validate()
    with pytest.raises(PlanError, match="expert_parallel=3 must divide"):
        _plan(ranks, lens, 3).validate()


def test_config_refuses_what_expert_slots_cannot_serve():
    with pytest.raises(ConfigError, match="does not divide the 6 HDP ranks"):
        PlannerConfig(num_ranks=6, capacity=8, ranks_per_node=1, expert_parallel=4).check()
    with pytest.raises(ConfigError, match="set pipeline_schedule to '1f1b'"):
        PlannerConfig(
            num_ranks=4, capacity=8, ranks_per_node=1, expert_parallel=2, pipeline_stages=2, pipeline_schedule="search"
        ).check()


def test_all_to_all_cost_counts_four_exchanges_per_layer_off_rank():
    moe = ModelSpec("m", 2, 64, 4, 4, 16, 128, 512, num_experts=8, moe_router_topk=2)
    cost = CostModel.analytic(moe, HardwareSpec.load("h100"))
    assert cost.moe_a2a_bytes_per_token == 2 * 64 * 2  # top-2 x hidden, bf16
    t = all_to_all_time(cost, 1000, 4, inter_node=False)
    assert t == pytest.approx(2 * 4 * (cost.p2p_latency_s + 1000 * 256 * 0.75 / cost.bw_intra_node))
    assert all_to_all_time(cost, 1000, 1, inter_node=False) == 0.0
    dense = CostModel.analytic(ModelSpec("d", 2, 64, 4, 4, 16, 128, 512), HardwareSpec.load("h100"))
    assert dense.moe_a2a_bytes_per_token == 0.0


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(expert_parallel_cases(balances=("pp",)), st.sampled_from([(2, 1), (3, 1), (2, 2), (4, 2)]))
def test_ep_with_pipelines_runs_every_ep_group_in_lock_step_without_deadlock(case, layout):
    """EP with pipelines (``expert/pipelines.py``): every token once; an EP group's members
    hold the same number of slots and, with no stage orders, run the same default order, so
    the k-th op of every member's stage is the same op; the joint pipeline graph, with each EP
    group's slot one unit of all its members, has no cycle; the estimate is that graph's."""
    lens, config = case
    stages, chunks = layout
    config = dataclasses.replace(config, pipeline_stages=stages, virtual_stages=chunks)
    cost = small_cost(moe_a2a_bytes_per_token=64.0)
    plan = plan_step(lens, config, cost)
    plan.validate()
    assert plan.expert_parallel == config.expert_parallel and plan.virtual_stages == chunks
    assert plan.stage_orders is None
    for group in ep_groups(config.num_ranks, config.expert_parallel):
        assert len({len(plan.ranks[r]) for r in group}) == 1
    assert plan_pipeline_deadlock(plan, stages) is None
    keys = slot_unit_keys(plan)
    times = [[1.0] * len(mbs) for mbs in plan.ranks]
    assert pipelined_finish_times(keys, times, stages, 0.33, chunks=chunks) is not None
    assert plan.meta["est_time_max_s"] == pytest.approx(max(plan.meta["est_rank_time_s"]))
