"""Two-level attention in the planner and the simulator: which group sizes are allowed, the
per-sequence choice, placement in whole node groups, and the costing of the all-to-all."""

import numpy as np
import pytest

from megatron_bytescale.planner.contract import MicroBatch, Plan, ring_pieces
from megatron_bytescale.planner.contract.zigzag import rank_tokens
from megatron_bytescale.planner.cost_model import CostModel
from megatron_bytescale.planner.planner import PlannerConfig, plan_step
from megatron_bytescale.planner.ring_traffic import p2p_bytes_per_rank
from megatron_bytescale.planner.sizing import two_level
from megatron_bytescale.planner.sizing.rings import RingSizer
from megatron_bytescale.planner.specs import HardwareSpec, ModelSpec
from megatron_bytescale.runtime.two_level_attention import head_slices
from megatron_bytescale.sim.cluster import Cluster
from megatron_bytescale.sim.timeline import critical_path, evaluate, simulate

from planner_oracles import plain_placement


def llama7b(tp=1, **kw):
    return CostModel.analytic(ModelSpec.load("llama-7b"), HardwareSpec.load("h100"), tp=tp, **kw)


def heads(q, kv, cost=None):
    return (cost or llama7b()).with_overrides(q_heads=q, kv_heads=kv)


def test_group_sizes_divide_the_node_and_keep_kv_groups_whole():
    assert two_level.valid_splits(heads(32, 8), 8) == [2, 4, 8]
    assert two_level.valid_splits(heads(8, 2), 8) == [2]  # u=4 would cut a KV group of 4 query heads
    assert two_level.valid_splits(heads(26, 26), 4) == [2, 4]  # MHA: uneven slices 6/7/6/7 are fine
    assert two_level.valid_splits(heads(32, 8), 1) == []
    assert two_level.valid_splits(llama7b().with_overrides(q_heads=0, kv_heads=0), 8) == []  # a profile without heads
    # the planner's slices are the runtime's
    for q, kv, u in ((32, 8, 4), (26, 26, 4), (8, 2, 2)):
        bounds = two_level.slice_bounds(q, u)
        assert [s[0] for s in head_slices(q, kv, u)] == [tuple(range(a, b)) for a, b in zip(bounds, bounds[1:])]


def test_two_level_beats_the_plain_ring_for_a_2m_sequence_and_not_inside_a_node():
    cost = llama7b()
    sizer = RingSizer(8192, cost, True, 1024, 8)
    sizes, times = sizer.curve(2 * 2**20)
    best = int(sizes[times.argmin()])
    assert sizer.heads_split(2 * 2**20, best) == 8
    plain = RingSizer(8192, cost.with_overrides(q_heads=0), True, 1024, 8)
    assert times.min() < 0.5 * plain.curve(2 * 2**20)[1].min()
    small = RingSizer(8192, cost, True, 8, 8)  # one node: nothing to gain, nothing offered
    assert all(small.heads_split(40000, int(d)) == 1 for d in small.curve(40000)[0])


def test_the_planner_chooses_two_level_per_sequence_on_whole_node_groups():
    cost = llama7b()
    lens = [262144] + [8192] * 200 + [30000] * 4  # a 2M one on 64 ranks would be compute-bound: plain
    plan = plan_step(lens, PlannerConfig(num_ranks=64, capacity=8192, ranks_per_node=8), cost).validate()
    splits = {}
    for mbs in plan.ranks:
        for mb in mbs:
            for p in mb.pieces:
                if p.is_distributed:
                    splits[p.seq_id] = (p.heads_split, p.ring)
    u, ring = splits[0]
    assert u > 1 and len(ring) % u == 0 and len(ring) > 8
    for g in range(0, len(ring), u):  # every group inside one node
        assert len({r // 8 for r in ring[g : g + u]}) == 1
    for u, ring in splits.values():  # rings inside a node stay plain
        if len({r // 8 for r in ring}) == 1:
            assert u == 1


def test_placement_in_groups_takes_the_least_loaded_groups_of_each_node():
    """The rule (the scheduler kernel is checked against it in tests/test_planner_kernels.py)."""
    loads = np.full(24, 2.0)
    loads[:8] = loads[8:16] = 0.0
    loads[[0, 1, 2, 3]] = 5.0  # node 0's first four ranks are busy
    loads[[8, 9]] = 1.0
    ring = plain_placement(loads, 12, 4, 8)
    assert ring == [4, 5, 6, 7, 10, 11, 12, 13, 8, 9, 14, 15]  # by node; a group's load is its busiest member's
    assert plain_placement(np.zeros(24), 16, 8, 8) == list(range(16))


def test_realized_split_follows_the_nodes_a_ring_landed_on():
    cost = heads(32, 8)
    assert two_level.realized_split(tuple(range(16)), 8, 8, cost) == 8
    assert two_level.realized_split(tuple(range(4, 16)), 8, 8, cost) == 4  # 4 + 8 members per node
    assert two_level.realized_split(tuple(range(3, 16)), 8, 8, cost) == 1  # 5 + 8: no whole groups
    assert two_level.realized_split((0, 1, 2, 3), 4, 8, cost) == 1  # inside one node


def ring_plan(u, s=300_000, nodes=8, rpn=8):
    ring = tuple(range(nodes * rpn))
    pieces = ring_pieces(0, s, ring, heads_split=u)
    return Plan(
        num_ranks=len(ring), capacity=s, num_layers=32, seq_lens=(s,), ranks=tuple((MicroBatch((p,)),) for p in pieces)
    ).validate()


def test_the_timeline_costs_the_all_to_all_and_a_shorter_ring():
    """300K tokens on 8 nodes: the plain ring is communication-bound, two-level is not."""
    cost, cluster = llama7b(), Cluster(64)
    plain, two = evaluate(ring_plan(1), cluster, cost), evaluate(ring_plan(8), cluster, cost)
    assert plain.timeline.a2a.max() == 0 and two.timeline.a2a.min() > 0
    assert two.timeline.comm.mean() < 0.1 * plain.timeline.comm.mean()
    assert two.timeline.step_time < 0.7 * plain.timeline.step_time
    assert two.two_level_rings == 1 and plain.two_level_rings == 0
    # the planner's estimate of a member is the simulated step, and the critical path bounds it
    assert two.timeline.step_time == pytest.approx(two_level.share_time(cost, 300_000, 64, 8, 8), rel=1e-6)
    assert critical_path([300_000], cluster, cost) <= two.timeline.step_time * (1 + 1e-9)
    # rank 0's bytes: the cross ring's (8 groups, 1/8 of the KV heads) plus the all-to-all's
    q, kv, grad = cost.q_bytes_per_token, cost.kv_bytes_per_token, cost.grad_bytes_per_token
    sent = p2p_bytes_per_rank(ring_plan(8), kv, grad, 32, q_bytes_per_token=q)
    blocks = [sum(rank_tokens(300_000, 64, j) for j in range(8 * g, 8 * g + 8)) for g in range(8)]
    ring_part = 32 * (2 * (sum(blocks) - blocks[1]) * kv / 8 + sum(blocks) * grad / 8)
    assert sent[0] - ring_part == pytest.approx(32 * two_level.a2a_bytes(cost, rank_tokens(300_000, 64, 0), 8))


def test_bf16_dkv_halves_the_accumulator_bytes():
    fp32, bf16 = llama7b(), llama7b(dkv_bf16=True)
    assert bf16.grad_bytes_per_token == fp32.grad_bytes_per_token / 2 == fp32.kv_bytes_per_token
    assert simulate(ring_plan(1), Cluster(64), bf16).step_time < simulate(ring_plan(1), Cluster(64), fp32).step_time
