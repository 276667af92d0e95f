"""Costing what Megatron parity under HDP changes: activation recompute (cost model, offload
policy, planner, simulator) and the exposed gradient reduction with and without overlap."""

import pytest

from megatron_bytescale.errors import ConfigError
from megatron_bytescale.planner.contract import MicroBatch, Plan, ring_pieces, whole_piece
from megatron_bytescale.planner.cost_model import FORWARD_SHARE, CostModel
from megatron_bytescale.planner.planner import PlannerConfig, plan_step
from megatron_bytescale.planner.sizing.offload import decide
from megatron_bytescale.sim.cluster import Cluster
from megatron_bytescale.sim.timeline import evaluate, simulate

from planner_cases import small_cost

MS = 1e-3
F, B = FORWARD_SHARE, 1 - FORWARD_SHARE


def test_flags_map_to_recomputed_layers():
    cost = small_cost(num_layers=8)
    assert cost.with_recompute(None) == cost
    uniform = cost.with_recompute("full", "uniform", 2)
    assert (uniform.recomputed_layers, uniform.recomputed_attention_layers, uniform.activation_layers) == (8, 8, 0)
    block = cost.with_recompute("full", "block", 3)
    assert (block.recomputed_layers, block.recomputed_attention_layers, block.activation_layers) == (3, 3, 5)
    selective = cost.with_recompute("selective", modules=None)  # megatron-core's default: core_attn
    assert (selective.recomputed_layers, selective.recomputed_attention_layers) == (0, 8)
    assert cost.with_recompute("selective", modules=["layernorm", "mlp"]) == cost  # no attention: no extra ring
    for bad in (("full", None, None), ("full", "block", None), ("partial", None, None)):
        with pytest.raises(ConfigError, match="recompute"):
            cost.with_recompute(*bad)
    with pytest.raises(ConfigError, match="once"):
        block.with_recompute("full", "block", 3)


def test_layer_time_adds_the_recomputed_forward():
    cost = small_cost(num_layers=4)
    tokens, pairs = 500, 500 * 500
    base = cost.layer_time(tokens, pairs)
    attn, rest = cost.a1 * pairs, cost.b1 * tokens + cost.g
    full = cost.with_recompute("full", "uniform", 1)
    assert full.layer_time(tokens, pairs) == pytest.approx(base * (1 + F))  # every forward twice
    block = cost.with_recompute("full", "block", 1)
    assert block.layer_time(tokens, pairs) == pytest.approx(base + F * (attn + rest) / 4)
    selective = cost.with_recompute("selective", modules=["core_attn"])
    assert selective.layer_time(tokens, pairs) == pytest.approx(base + F * attn)


def test_recomputed_layers_need_no_offload_and_hold_more_tokens():
    # 6 layers, capacity 100: a 150-token sequence fits one rank by offloading without recompute
    cost = small_cost(num_layers=6)
    assert decide(150, 100, cost).ranks == 1 and decide(150, 100, cost).ratio > 0
    # with 4 layers recomputed only 2 keep activations: the last two, never offloaded
    block = cost.with_recompute("full", "block", 4)
    assert decide(150, 100, block).ratio == 0.0 and decide(150, 100, block).ranks == 2
    plan = plan_step([150, 40, 30], PlannerConfig(num_ranks=2, capacity=100, ranks_per_node=2), block)
    assert plan.recomputed_layers == 4 and plan.activation_layers == 2
    assert all(mb.offload_ratio == 0.0 for mbs in plan.ranks for mb in mbs)
    assert Plan.from_json(plan.to_json()).recomputed_layers == 4


def test_fewer_activation_layers_change_the_validators_capacity():
    # 150 tokens at ratio 0.5 of 6 layers keep 150 * (2 + 0.5 * 4) / 6 = 100 token-equivalents
    mb = MicroBatch((whole_piece(0, 150, 0),), offload_ratio=0.5)
    Plan(num_ranks=1, capacity=100, num_layers=6, seq_lens=(150,), ranks=((mb,),)).validate()
    # with 2 of them recomputed, 4 keep activations: 150 * (2 + 0.5 * 2) / 4 = 112.5 > 100
    with pytest.raises(Exception, match="over capacity"):
        Plan(num_ranks=1, capacity=100, num_layers=6, seq_lens=(150,), ranks=((mb,),), recomputed_layers=2).validate()


def _cost(**kw):
    base = dict(
        a1=0.0,
        b1=1 * MS,
        g=0.0,
        a2=1.0,
        b2=0.0,
        num_layers=1,
        kv_bytes_per_token=1.0,
        grad_bytes_per_token=2.0,
        bw_d2h=10.0,
        bw_h2d=10.0,
        bw_intra_node=1000.0,
        bw_inter_node=100.0,
        p2p_latency_s=0.0,
    )
    base.update(kw)
    return CostModel(**base)


def test_simulator_puts_the_recomputed_forward_and_its_hops_in_backward():
    r0, r1 = ring_pieces(0, 8, (0, 1))
    plan = Plan(
        num_ranks=2,
        capacity=100,
        num_layers=1,
        seq_lens=(8, 6),
        ranks=((MicroBatch((whole_piece(1, 6, 0),)), MicroBatch((r0,))), (MicroBatch((r1,)),)),
    ).validate()
    cost = _cost()
    plain = simulate(plan, Cluster(2), cost)
    full = simulate(plan, Cluster(2), cost.with_recompute("full", "uniform", 1))
    # rank 0's local 6 tokens: + F*6 ms; the ring: + F*4 ms linear and the 4 ms forward hop again
    assert full.step_time == pytest.approx(plain.step_time + F * 6 * MS + F * 4 * MS + 4 * MS)
    assert list(full.comm) == pytest.approx(list(plain.comm + 4 * MS))
    assert list(full.busy) == pytest.approx([plain.busy[0] + F * 10 * MS, plain.busy[1] + F * 4 * MS])
    # the recomputed forward shows in backward: rank 1's ring forward is unchanged
    assert full.row(1)[0][1] - full.row(1)[0][0] == pytest.approx(plain.row(1)[0][1] - plain.row(1)[0][0])
    # P2P bytes: the forward KV hop again (4 tokens x 1 byte) on each member
    more = evaluate(plan, Cluster(2), cost.with_recompute("full", "uniform", 1)).p2p_bytes
    assert more == evaluate(plan, Cluster(2), cost).p2p_bytes + 2 * 4


def test_exposed_gradient_reduction_with_and_without_overlap():
    from megatron_bytescale.sim.grad_reduction import allreduce_time, exposed_reduction

    # rank 0: local 6 tokens then the ring; rank 1: the ring then local 10 tokens (last: local)
    r0, r1 = ring_pieces(0, 8, (0, 1))
    plan = Plan(
        num_ranks=2,
        capacity=100,
        num_layers=1,
        seq_lens=(8, 6, 10),
        ranks=(
            (MicroBatch((whole_piece(1, 6, 0),)), MicroBatch((r0,))),
            (MicroBatch((r1,)), MicroBatch((whole_piece(2, 10, 1),))),
        ),
    ).validate()
    cost = _cost(grad_bytes_per_gpu=10.0)  # NVLink 1000 B/s: all-reduce over 2 ranks 2*1/2*10/1000 = 10 ms
    cluster = Cluster(2)
    t = simulate(plan, cluster, cost)
    total = allreduce_time(cost, cluster)
    assert total == pytest.approx(10 * MS)
    assert exposed_reduction(plan, t, cost, cluster, overlap=False) == pytest.approx(total)
    # rank 1 ends last (f); its last backward (B * 10 ms) launches its buckets as it goes; rank 0
    # (ring last) launches when its ring micro-batch ends, earlier: the reduction streams from
    # the later of the two launches
    f = float(t.row(1)[:, 1].max())
    launch0, launch1 = float(t.row(0)[:, 1].max()), f - B * 10 * MS
    assert launch0 < launch1
    expected = max(launch1 + total, f + total / 8) - f
    assert expected == pytest.approx(total - B * 10 * MS)
    got = exposed_reduction(plan, t, cost, cluster, overlap=True)
    assert got == pytest.approx(expected) and got < total
    assert evaluate(plan, cluster, cost).metrics()["exposed_grad_reduce_overlap_s"] == pytest.approx(got)

    # static CP's rings run on their own CP group: every rank launches during its last backward
    static = exposed_reduction(plan, t, cost, cluster, overlap=True, hdp_rule=False)
    assert static == pytest.approx(max(f - B * 10 * MS + total, f + total / 8) - f) and static <= got
