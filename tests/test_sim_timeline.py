"""The costing engine on tiny hand-made plans whose answers are worked out by hand."""

import pytest

from megatron_bytescale.errors import PlanError
from megatron_bytescale.planner.contract import MicroBatch, Op, Plan, one_f_one_b, ring_pieces, whole_piece
from megatron_bytescale.planner.cost_model import FORWARD_SHARE, CostModel
from megatron_bytescale.planner.ring_traffic import p2p_bytes_per_rank
from megatron_bytescale.sim.cluster import Cluster
from megatron_bytescale.sim.timeline import critical_path, evaluate, lower_bound, simulate

MS = 1e-3
F, B = FORWARD_SHARE, 1 - FORWARD_SHARE


def cost_model(a1=0.0, b1=1 * MS, layers=1, **kw):
    """Round numbers: 1 ms per token per layer, KV 1 byte/token, dKV 2 bytes/token,
    NVLink 1000 B/s, network 100 B/s, no latency, PCIe 10 B/s."""
    base = dict(
        a1=a1,
        b1=b1,
        g=0.0,
        a2=1.0,
        b2=0.0,
        num_layers=layers,
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


def plan_of(seq_lens, ranks, layers=1, capacity=1000, barriers=None):
    return Plan(
        num_ranks=len(ranks),
        capacity=capacity,
        num_layers=layers,
        seq_lens=tuple(seq_lens),
        ranks=tuple(tuple(mbs) for mbs in ranks),
        barriers=tuple(tuple(b) for b in barriers or ()),
    ).validate()


def test_local_micro_batches_run_back_to_back():
    plan = plan_of(
        [3, 5, 4],
        [
            [MicroBatch((whole_piece(0, 3, 0),)), MicroBatch((whole_piece(1, 5, 0),))],
            [MicroBatch((whole_piece(2, 4, 1),))],
        ],
    )
    t = simulate(plan, Cluster(2), cost_model())
    assert t.step_time == pytest.approx(8 * MS)
    assert list(t.busy) == pytest.approx([8 * MS, 4 * MS])
    assert list(t.idle) == pytest.approx([0, 4 * MS])
    assert list(t.comm) == [0, 0]


def ring_plan(gpus_with_local_first=True):
    # seq 0: 8 tokens over ring (0, 1): 4 each; rank 0 first runs a 6-token sequence alone
    r0, r1 = ring_pieces(0, 8, (0, 1))
    return plan_of([8, 6], [[MicroBatch((whole_piece(1, 6, 0),)), MicroBatch((r0,))], [MicroBatch((r1,))]])


def test_ring_starts_when_all_members_are_ready_and_comm_is_exposed():
    plan = ring_plan()
    t = simulate(plan, Cluster(2), cost_model())  # one node: NVLink 1000 B/s
    # ring of 2, blocks of 4 tokens, no attention compute (a1 = 0), so every hop is exposed:
    # forward: linear F*4 ms, one hop 4 B / 1000 B/s = 4 ms
    # backward: linear B*4 ms, one KV+dKV hop 4*3 B = 12 ms, then the dKV hop home 4*2 B = 8 ms
    ring = 4 * MS + 4 * MS + 12 * MS + 8 * MS
    assert t.step_time == pytest.approx(6 * MS + ring)  # starts when rank 0 is done with its 6 tokens
    assert list(t.comm) == pytest.approx([24 * MS, 24 * MS])
    assert list(t.busy) == pytest.approx([10 * MS, 4 * MS])
    assert list(t.idle) == pytest.approx([0, 6 * MS])
    assert t.row(1)[0][0] == pytest.approx(6 * MS)  # rank 1's ring micro-batch starts at 6 ms


def test_hops_between_nodes_use_the_network_bandwidth():
    t = simulate(ring_plan(), Cluster(2, gpus_per_node=1), cost_model())  # 100 B/s
    assert t.step_time == pytest.approx(6 * MS + 4 * MS + 40 * MS + 120 * MS + 80 * MS)


def test_attention_compute_hides_the_hop_and_only_the_excess_is_exposed():
    # a1 = 1 ms per pair: each member holds 8^2/2 = 32 pairs, 16 per ring step
    plan = ring_plan()
    t = simulate(plan, Cluster(2), cost_model(a1=1 * MS))
    step = 16 * MS
    fwd = F * 4 * MS + max(F * step, 4 * MS) + F * step  # the hop (4 ms) hides behind F*16 ms
    bwd = B * 4 * MS + max(B * step, 12 * MS) + B * step + 8 * MS  # 12 ms hop vs 10.7 ms compute
    local = 6 * MS + 36 * MS  # rank 0's 6-token sequence first: linear + 6^2 pairs
    assert t.step_time == pytest.approx(local + fwd + bwd)
    exposed = (12 * MS - B * step) + 8 * MS
    assert t.comm[1] == pytest.approx(exposed)
    assert t.busy[1] == pytest.approx(4 * MS + 32 * MS)


def test_barrier_synchronises_all_ranks():
    def mb(sid, s, r):
        return MicroBatch((whole_piece(sid, s, r),))

    lens = [10, 1, 2, 3]
    ranks = [[mb(0, 10, 0), mb(1, 1, 0)], [mb(2, 2, 1), mb(3, 3, 1)]]
    free = simulate(plan_of(lens, ranks), Cluster(2), cost_model())
    assert free.step_time == pytest.approx(11 * MS)  # max(10 + 1, 2 + 3)
    synced = simulate(plan_of(lens, ranks, barriers=[[1, 1]]), Cluster(2), cost_model())
    assert synced.step_time == pytest.approx(13 * MS)  # max(10, 2) + max(1, 3)
    assert synced.barriers == pytest.approx([10 * MS])
    assert synced.idle[1] == pytest.approx(8 * MS)


def test_malformed_barriers_are_rejected():
    plan = plan_of([1, 1], [[MicroBatch((whole_piece(0, 1, 0),))], [MicroBatch((whole_piece(1, 1, 1),))]])
    plan.barriers = ((2, 0),)  # set after validate (which refuses it too): simulate checks it itself
    with pytest.raises(PlanError, match="barrier 0"):
        simulate(plan, Cluster(2), cost_model())


def test_one_f_one_b_order():
    assert one_f_one_b(3, 2, 0) == [Op(0, 0), Op(0, 1), Op(1, 0), Op(0, 2), Op(1, 1), Op(1, 2)]
    assert one_f_one_b(3, 2, 1) == [Op(0, 0), Op(1, 0), Op(0, 1), Op(1, 1), Op(0, 2), Op(1, 2)]
    assert one_f_one_b(1, 4, 0) == [Op(0, 0), Op(1, 0)]


def test_pipeline_bubble_with_two_stages():
    # one pipeline (2 GPUs, PP=2), two 3-token micro-batches, one layer per stage:
    # F = 1 ms, B = 2 ms per stage; 1F1B takes (M + P - 1) * (F + B) = 3 * 3 ms
    plan = plan_of([3, 3], [[MicroBatch((whole_piece(0, 3, 0),)), MicroBatch((whole_piece(1, 3, 0),))]])
    t = simulate(plan, Cluster(2, pp=2), cost_model())
    assert t.step_time == pytest.approx(9 * MS)
    assert list(t.busy) == pytest.approx([6 * MS, 6 * MS])  # rows: stage 0, stage 1
    assert list(t.idle) == pytest.approx([3 * MS, 3 * MS])  # the bubble: (P - 1) * (F + B)


def test_unequal_micro_batches_in_a_pipeline():
    # micro-batch 0 is 6 tokens (F 2, B 4 ms), micro-batch 1 is 3 tokens (F 1, B 2 ms)
    plan = plan_of([6, 3], [[MicroBatch((whole_piece(0, 6, 0),)), MicroBatch((whole_piece(1, 3, 0),))]])
    t = simulate(plan, Cluster(2, pp=2), cost_model())
    # s0 F0 [0,2] F1 [2,3]; s1 F0 [2,4] B0 [4,8]; s1 F1 [8,9] B1 [9,11]; s0 B0 [8,12] B1 [12,14]
    assert t.step_time == pytest.approx(14 * MS)
    assert t.row(0, stage=1)[:, 0] == pytest.approx([2 * MS, 4 * MS, 8 * MS, 9 * MS])


def test_ring_micro_batches_that_meet_out_of_1f1b_step_deadlock():
    # PP=2. Rank 0 runs rings R1, R2 back to back; rank 1 has a local micro-batch between them.
    # On stage 0 rank 0 does F(R2) before B(R1), rank 1 does B(R1) before F(R2): a cycle.
    r1 = ring_pieces(0, 4, (0, 1))
    r2 = ring_pieces(1, 4, (0, 1))
    ranks = [
        [MicroBatch((r1[0],)), MicroBatch((r2[0],))],
        [MicroBatch((r1[1],)), MicroBatch((whole_piece(2, 2, 1),)), MicroBatch((r2[1],))],
    ]
    plan = plan_of([4, 4, 2], ranks)  # valid: both ranks meet R1 before R2
    simulate(plan, Cluster(2, pp=1), cost_model())  # fine without pipelining
    with pytest.raises(PlanError, match="deadlocks"):
        simulate(plan, Cluster(4, pp=2), cost_model())


def test_offload_copies_hide_only_behind_their_own_pass():
    # 4 layers, 2 of them offloaded at ratio 1: each copies Act(4) = 4 B at 10 B/s = 400 ms
    # to the host in the forward and 400 ms back in the backward. A layer computes 4 ms:
    # forward 4/3 ms hides 4/3 ms of its D2H copy, backward 8/3 ms hides as much of its H2D.
    # Exposed per offloaded layer: (400 - 4/3) + (400 - 8/3) = 796 ms; two layers 1,592 ms;
    # step 16 ms compute + 1,592 ms = 1,608 ms, at least the 1,600 ms the copies need alone.
    piece = whole_piece(0, 4, 0)
    plan = plan_of([4], [[MicroBatch((piece,), offload_ratio=1.0)]], layers=4, capacity=4)
    cost = cost_model(layers=4)
    r = evaluate(plan, Cluster(1), cost)
    assert r.timeline.step_time == pytest.approx(1608 * MS)
    assert r.timeline.step_time >= 2 * 2 * 400 * MS  # the physical copy time, both ways
    assert r.timeline.offload[0] == pytest.approx(1592 * MS)
    fwd, bwd = r.timeline.row(0)[:, 5]  # exposed copy time of the forward, then the backward
    assert fwd == pytest.approx(2 * (400 - 4 / 3) * MS)
    assert bwd == pytest.approx(2 * (400 - 8 / 3) * MS)
    assert r.offload_bytes == pytest.approx(2 * 4.0)
    assert r.host_bytes_max_gpu == pytest.approx(2 * 4.0)  # two layers of 4 B parked until backward


def test_offload_copy_directions_use_their_own_bandwidth_and_the_forward_share():
    # forward share 1/2: a layer of 100 tokens computes 100 ms, 50 ms each way. Act = 100 B at
    # r = 0.5 -> 50 B per layer. D2H at 10,000 B/s: 5 ms, hidden. H2D at 500 B/s: 100 ms
    # against 50 ms of backward: 50 ms exposed per offloaded layer, 2 layers -> 100 ms.
    piece = whole_piece(0, 100, 0)
    plan = plan_of([100], [[MicroBatch((piece,), offload_ratio=0.5)]], layers=4, capacity=1000)
    cost = cost_model(layers=4, bw_d2h=10_000.0, bw_h2d=500.0, forward_share=0.5)
    t = simulate(plan, Cluster(1), cost)
    fwd, bwd = t.row(0)[:, 5]
    assert fwd == pytest.approx(0.0)
    assert bwd == pytest.approx(100 * MS)
    assert t.step_time == pytest.approx(400 * MS + 100 * MS)


def test_p2p_bytes_and_lower_bound():
    plan = ring_plan()
    cost = cost_model(a1=1 * MS)
    r = evaluate(plan, Cluster(2), cost)
    # each member: forward one 4-token KV block (4 B); backward the KV block again (4 B) and
    # the dKV of both blocks once each (8 tokens * 2 B): the timeline's hops, 4 + 12 + 8 B
    assert r.p2p_bytes == pytest.approx(2 * (4 + 4 + 16))
    assert r.p2p_bytes == pytest.approx(sum(p2p_bytes_per_rank(plan, 1.0, 2.0, 1)))
    # sum over sequences of a1 s^2 + b1 s, over 2 ranks
    assert lower_bound([8, 6], Cluster(2), cost) == pytest.approx((64 + 8 + 36 + 6) * MS / 2)
    assert r.lower_bound <= r.timeline.step_time


def test_plan_and_cluster_must_agree():
    plan = ring_plan()
    with pytest.raises(PlanError, match="2 ranks but the cluster has 4"):
        simulate(plan, Cluster(4), cost_model())
    with pytest.raises(PlanError, match="layers per stage"):
        simulate(plan, Cluster(2), cost_model(layers=2))


def test_one_slow_link_paces_every_ring_step():
    # ring of 4 over two 2-GPU nodes: hops 1->2 and 3->0 cross the network (100 B/s).
    # 8 tokens, 2 per member: forward 3 hops of 2 B = 20 ms each; backward 3 hops of
    # 2 * 3 B = 60 ms and the dKV hop home, 2 * 2 B = 40 ms; plus 2 ms of linear compute
    pieces = ring_pieces(0, 8, (0, 1, 2, 3))
    plan = plan_of([8], [[MicroBatch((p,))] for p in pieces])
    t = simulate(plan, Cluster(4, gpus_per_node=2), cost_model())
    assert t.step_time == pytest.approx(2 * MS + 3 * 20 * MS + 3 * 60 * MS + 40 * MS)


def test_critical_path_is_the_longest_sequence_at_its_best_ring_size():
    # 8 tokens on 2 ranks of one node. Without attention one rank is fastest (8 ms against the
    # 28 ms ring of test_ring_starts_when_all_members_are_ready...); with a1 = 1 ms/pair one
    # rank takes 8 + 64 ms and the ring 12 + 33.3 ms (the hand-worked ring above)
    assert critical_path([8, 6], Cluster(2), cost_model()) == pytest.approx(8 * MS)
    ring = (F * 4 + max(F * 16, 4) + F * 16) + (B * 4 + max(B * 16, 12) + B * 16 + 8)
    assert critical_path([8, 6], Cluster(2), cost_model(a1=1 * MS)) == pytest.approx(ring * MS)
    assert critical_path([8], Cluster(4, pp=2), cost_model()) == pytest.approx(2 * 8 * MS)  # both stages
    r = evaluate(ring_plan(), Cluster(2), cost_model(a1=1 * MS))
    assert r.critical_path <= r.timeline.step_time
