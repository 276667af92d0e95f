"""The simulator under expert parallelism: an EP group's slot lasts as long as its slowest
member plus the MoE all-to-alls, rings join the slots of their members, and the planner's
estimate of an aligned plan is what the simulator measures."""

import argparse

import pytest
from test_sim_timeline import MS, cost_model

from megatron_bytescale.commands.simulate import add_arguments, config_from_args
from megatron_bytescale.errors import ConfigError, PlanError
from megatron_bytescale.planner.contract import MicroBatch, Plan, ring_pieces, whole_piece
from megatron_bytescale.planner.expert.slots import align_expert_slots
from megatron_bytescale.sim.cluster import Cluster
from megatron_bytescale.sim.simulate import SimConfig, check_config, run
from megatron_bytescale.sim.timeline import simulate


def test_a_slot_waits_for_the_slowest_member_and_adds_the_all_to_alls():
    mb = lambda *p: MicroBatch(tuple(p))  # noqa: E731
    # EP group {0, 1}: rank 0 runs 3 then 5 tokens, rank 1 runs 6 then nothing
    plain = Plan(
        num_ranks=2,
        capacity=100,
        num_layers=1,
        seq_lens=(3, 5, 6),
        ranks=((mb(whole_piece(0, 3, 0)), mb(whole_piece(1, 5, 0))), (mb(whole_piece(2, 6, 1)),)),
    ).validate()
    no_moe = cost_model()
    assert simulate(plain, Cluster(2), no_moe).step_time == pytest.approx(8 * MS)
    aligned = align_expert_slots(plain, 2).validate()
    # rank 0's local micro-batches run longest first (5 then 3), so slot 0 pairs 5 with 6:
    # max(5, 6) ms; slot 1: 3 ms on rank 0, an empty slot (0 tokens: g = 0) on rank 1
    assert [mb.tokens for mb in aligned.ranks[0]] == [5, 3] and aligned.ranks[1][1].pieces == ()
    t = simulate(aligned, Cluster(2, ep=2), no_moe)
    assert t.step_time == pytest.approx(9 * MS)
    assert list(t.busy) == pytest.approx([8 * MS, 6 * MS])
    # all-to-alls: 1 byte per token and layer, four per layer, half the tokens leave the rank
    moe = cost_model(moe_a2a_bytes_per_token=1.0)
    t = simulate(aligned, Cluster(2, ep=2), moe)
    a2a = lambda tokens: 4 * tokens * 0.5 / 1000.0  # noqa: E731 (NVLink 1000 B/s)
    assert list(t.moe_a2a) == pytest.approx([a2a(5) + a2a(3), a2a(6) + a2a(1)])
    assert t.step_time == pytest.approx(max(5 * MS + a2a(5), 6 * MS + a2a(6)) + 3 * MS + a2a(3))
    # a static plan (no slots of its own) is aligned by the simulator as EP would need
    assert simulate(plain, Cluster(2, ep=2), moe).step_time == pytest.approx(t.step_time)


def test_a_ring_across_ep_groups_holds_both_groups():
    mb = lambda *p: MicroBatch(tuple(p))  # noqa: E731
    ring = ring_pieces(0, 8, (1, 2))
    plain = Plan(
        num_ranks=4,
        capacity=100,
        num_layers=1,
        seq_lens=(8, 10, 2, 2),
        ranks=(
            (mb(whole_piece(1, 10, 0)),),
            (mb(ring[0]),),
            (mb(ring[1]),),
            (mb(whole_piece(2, 2, 3)), mb(whole_piece(3, 2, 3))),
        ),
    ).validate()
    t = simulate(align_expert_slots(plain, 2).validate(), Cluster(4, ep=2), cost_model())
    # the ring joins slot 0 of group {0, 1} (rank 0's 10 ms) and of group {2, 3}: one merged
    # slot, which all four ranks leave together; rank 3's second micro-batch starts after it
    slot0_end = [t.row(r)[1, 1] for r in range(4)]  # ops per rank: forward 0, backward 0, ...
    assert slot0_end == pytest.approx([slot0_end[0]] * 4) and slot0_end[0] >= 10 * MS
    assert t.row(3)[2, 0] == pytest.approx(slot0_end[0])
    assert len(t.row(0)) == 2  # group {0, 1} has nothing at the second slot: no empty slot there
    assert t.step_time == pytest.approx(slot0_end[0] + 2 * MS)


def test_ep_needs_a_moe_model_and_a_dividing_size():
    with pytest.raises(ConfigError, match="does not divide the 6 HDP ranks"):
        Cluster(6, ep=4, gpus_per_node=6)
    with pytest.raises(ConfigError, match="has no experts"):
        run(
            SimConfig(gpus=8, context=4096, capacity=4096, global_batch_tokens=8192, model="tiny", ep=2), progress=False
        )
    mb = MicroBatch((whole_piece(0, 3, 0),))
    plan = Plan(num_ranks=2, capacity=100, num_layers=1, seq_lens=(3,), ranks=((mb,), ()), expert_parallel=2)
    with pytest.raises(PlanError, match="would deadlock"):
        simulate(plan, Cluster(2, ep=2), cost_model())


def test_ep_slots_span_the_pipelines_of_an_ep_group():
    # two pipelines of 2 stages (one layer each) in one EP group: 10 tokens on pipeline 0, 2 on
    # pipeline 1; each stage's slot lasts as its slowest member plus the all-to-alls, so the
    # short pipeline waits at every stage: 2 stages x (F + B) x 10 ms, and each member's
    # exchanges of 10 x 2 B x 1/2 over 1000 B/s, 4 of them per stage (the longer member's)
    plan = Plan(
        num_ranks=2,
        capacity=100,
        num_layers=1,
        seq_lens=(10, 2),
        ranks=((MicroBatch((whole_piece(0, 10, 0),)),), (MicroBatch((whole_piece(1, 2, 1),)),)),
    )
    cluster = Cluster(4, pp=2, ep=2)
    t = simulate(plan, cluster, cost_model())
    assert t.step_time == pytest.approx(2 * 10 * MS)
    assert list(t.busy) == pytest.approx([10 * MS, 2 * MS] * 2)  # (rank, stage): compute only
    assert t.ep_slot_floor == pytest.approx(10 * MS)  # one device's one slot: the slower member's
    t = simulate(plan, cluster, cost_model(moe_a2a_bytes_per_token=2.0))
    assert t.step_time == pytest.approx(2 * (10 * MS + 4 * 10 * MS))
    assert t.ep_slot_floor == pytest.approx(10 * MS + 4 * 10 * MS)
    alone = simulate(plan, Cluster(4, pp=2), cost_model())
    assert alone.step_time == pytest.approx(20 * MS) and alone.row(1)[-1, 1] == pytest.approx(4 * MS)


def ep_pp_config(**kw) -> SimConfig:
    """A small EP 4 x PP 2 x V 2 simulation, one batch."""
    shape = dict(gpus=16, pp=2, vpp=2, ep=4, context=16 * 1024, capacity=4 * 1024, global_batch_tokens=64 * 1024)
    return SimConfig(**shape, model="mistral-8x7b", steps=1, **kw)


def test_simulate_costs_ep_with_pipelines_and_virtual_stages():
    report = run(ep_pp_config(strategies=("static", "hdp-balanced")), progress=False)
    assert not report.errors and report.timelines["static"].chunks == 2
    hdp = report.results()["hdp-balanced"]
    # the planner aligns the slots over all pipelines itself (planner.expert.pipelines) and
    # estimates the same graph; the simulator splits the all-to-alls half and half between
    # forward and backward, the estimate by the forward share: within a percent
    step = report.steps["hdp-balanced"][0]
    assert step["planner_estimate_s"] == pytest.approx(step["step_time_s"], rel=1e-2)
    assert hdp["mean_step_time_s"] >= hdp["lower_bound_s"] and hdp["exposed_moe_a2a_s"] > 0


def test_simulated_ep_steps_match_the_planner_estimate():
    cfg = SimConfig(
        gpus=32,
        tp=2,
        ep=4,
        context=64 * 1024,
        capacity=8 * 1024,
        global_batch_tokens=512 * 1024,
        model="mistral-8x7b",
        strategies=("static", "hdp-balanced"),
        steps=1,
    )
    report = run(cfg, progress=False)
    bal = report.steps["hdp-balanced"][0]
    assert bal["planner_estimate_s"] == pytest.approx(bal["step_time_s"], rel=1e-6)
    assert bal["exposed_moe_a2a_s"] > 0 and report.steps["static"][0]["exposed_moe_a2a_s"] > 0


def test_megatron_dcp_is_left_out_under_ep_and_refused_when_asked_for():
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    base = [
        "--model",
        "mistral-8x7b",
        "--gpus",
        "64",
        "--tp",
        "2",
        "--context",
        "64K",
        "--capacity",
        "16K",
        "--global-batch-tokens",
        "1M",
    ]
    cfg = config_from_args(ap.parse_args(base + ["--ep", "4"]))
    assert "megatron-dcp" not in cfg.strategies and "hdp-balanced" in cfg.strategies
    assert "megatron-dcp" in config_from_args(ap.parse_args(base)).strategies
    asked = config_from_args(ap.parse_args(base + ["--ep", "4", "--strategies", "static,megatron-dcp"]))
    with pytest.raises(ConfigError, match="megatron-dcp is not simulated with expert parallelism"):
        check_config(asked)
