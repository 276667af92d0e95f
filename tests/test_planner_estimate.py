"""The planner's time estimate against the simulator's timeline (``sim.timeline``) on small
plans without pipelines: both cost a ring the same way, the final dKV hop included."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_bytescale.planner.estimate import dkv_home_time, exposed_ring_time, ring_share_time
from megatron_bytescale.planner.planner import PlannerConfig, plan_step
from megatron_bytescale.planner.sizing.rings import RingSizer
from megatron_bytescale.sim.cluster import Cluster
from megatron_bytescale.sim.timeline import simulate

from planner_cases import draw_lengths, small_cost


@st.composite
def small_plans(draw, balances=("none", "dp", "pp")):
    rpn = draw(st.sampled_from([1, 2, 3, 4]))
    num_ranks = rpn * draw(st.integers(1, 3))
    capacity = draw(st.integers(20, 200))
    lens = draw_lengths(draw, capacity, num_ranks, max_short=25, max_long=3, min_long=1)
    config = PlannerConfig(
        num_ranks=num_ranks,
        capacity=capacity,
        ranks_per_node=rpn,
        balance=draw(st.sampled_from(balances)),
        offload=draw(st.booleans()),
    )
    return lens, config


def comm_cost(num_layers=4, **changes):
    # slow links, so that ring hops (and the last dKV hop) are a visible part of the step
    return small_cost(num_layers=num_layers, bw_intra_node=1e8, bw_inter_node=1e7, **changes)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_plans(balances=("dp", "pp")))
def test_estimate_equals_the_simulated_step_when_hops_do_not_depend_on_block_sizes(case):
    # The estimate sizes every hop by the largest share (shares differ by a token); with
    # hops that cost latency only, the two models must agree exactly.
    lens, config = case
    cost = comm_cost(kv_bytes_per_token=0.0, grad_bytes_per_token=0.0, p2p_latency_s=2e-3)
    plan = plan_step(lens, config, cost).validate()
    timeline = simulate(plan, Cluster(config.num_ranks, gpus_per_node=config.ranks_per_node), cost)
    assert plan.meta["est_time_max_s"] == pytest.approx(timeline.step_time, rel=1e-9)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_plans(), st.sampled_from([1e3, 1e6, 1e12]))
def test_estimate_never_undercuts_the_simulated_step(case, bw_offload):
    # Sizing hops by the largest share, and (hdp-naive) not hiding hop 0 behind the short
    # sequences packed beside a ring share, only ever overestimates.
    lens, config = case
    cost = comm_cost(bw_offload=bw_offload)
    plan = plan_step(lens, config, cost).validate()
    timeline = simulate(plan, Cluster(config.num_ranks, gpus_per_node=config.ranks_per_node), cost)
    assert timeline.step_time <= plan.meta["est_time_max_s"] * (1 + 1e-9)


def test_ring_alone_matches_the_simulator_including_the_last_dkv_hop():
    # 800 tokens over a ring of 4 at the memory floor (C = 200, no offload): equal shares of 200
    cost = comm_cost()
    config = PlannerConfig(num_ranks=4, capacity=200, ranks_per_node=4, balance="none", offload=False)
    plan = plan_step([800], config, cost).validate()
    assert plan.ring_sizes() == {0: 4}
    timeline = simulate(plan, Cluster(4, gpus_per_node=4), cost)
    assert plan.meta["est_time_max_s"] == pytest.approx(timeline.step_time, rel=1e-12)
    # the home hop is a visible part of it: 4 layers of (latency + 200 tokens of dKV over NVLink)
    home = dkv_home_time(cost, 200, inter_node=False)
    assert home == pytest.approx(1e-6 + 200 * 200.0 / 1e8)
    assert cost.num_layers * home > 1e-3 * timeline.step_time
    without_home = ring_share_time(cost, 800, 4, False) - cost.num_layers * home
    assert without_home < timeline.step_time * (1 - 1e-3)


def test_every_ring_pays_the_home_hop_even_when_compute_hides_the_others():
    # attention so slow that every overlapped hop hides: only the home hop is exposed
    cost = small_cost(a1=1.0)
    for inter in (False, True):
        assert exposed_ring_time(cost, 1e6, 50, 4, inter) == pytest.approx(dkv_home_time(cost, 50, inter))
    assert exposed_ring_time(cost, 1e6, 50, 1, False) == 0.0  # no ring, no hops
    sizes, times = RingSizer(100, cost, True, 8, 4).curve(400)  # the ring sizer's curve: the same seconds
    assert times.tolist() == [ring_share_time(cost, 400, d, d > 4) for d in sizes.tolist()]


# ------------------------------------------------------------------ pipelines (1F1B)
@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 400), min_size=1, max_size=12), st.sampled_from([2, 3, 4]))
def test_one_f_one_b_estimate_equals_the_simulated_pipeline(lens, p):
    """One pipeline of whole sequences: the planner's 1F1B makespan is the simulator's step."""
    from megatron_bytescale.planner.contract import MicroBatch, Plan, whole_piece
    from megatron_bytescale.planner.estimate import one_f_one_b_time, pipeline_time, rank_times

    cost = small_cost(num_layers=2)
    ranks = (tuple(MicroBatch((whole_piece(i, s, 0),)) for i, s in enumerate(lens)),)
    plan = Plan(num_ranks=1, capacity=max(lens), num_layers=2, seq_lens=tuple(lens), ranks=ranks).validate()
    (est,) = rank_times(plan, cost, 1, p)
    step = simulate(plan, Cluster(p, pp=p, gpus_per_node=p), cost).step_time
    assert est == pytest.approx(step, rel=1e-9)
    times = [cost.num_layers * cost.layer_time(s) for s in lens]
    assert one_f_one_b_time(times, p) == est
    if len(set(lens)) == 1:  # equal micro-batches: (m + p - 1) x one, as sum + (p - 1) x max says
        assert est == pytest.approx((len(lens) + p - 1) * times[0]) == pytest.approx(pipeline_time(times, p))


def test_sum_plus_bubble_is_not_the_1f1b_makespan_of_uneven_micro_batches():
    """Why the estimate runs 1F1B instead of ``sum + (p - 1) x max``: a short micro-batch
    between two long ones stalls the first stage (p = 2: 24 time units, not 22)."""
    from megatron_bytescale.planner.estimate import one_f_one_b_time, pipeline_time

    assert pipeline_time([6, 4, 6], 2) == 22
    assert one_f_one_b_time([6, 4, 6], 2) == pytest.approx(24)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_plans(balances=("none", "pp")), st.sampled_from([2, 4]))
def test_pipelined_estimate_equals_the_simulated_step(case, p):
    """With pipelines the estimate runs every pipeline's 1F1B together, rings starting on a
    stage when all their members are ready there: the simulator's step, when ring hops cost
    (next to) nothing (the estimate splits a ring's exposed hops between forward and
    backward by FORWARD_SHARE, the simulator by where they occur)."""
    from dataclasses import replace

    lens, config = case
    config = replace(config, pipeline_stages=p)
    cost = comm_cost(kv_bytes_per_token=0.0, grad_bytes_per_token=0.0, p2p_latency_s=1e-12)
    plan = plan_step(lens, config, cost).validate()
    timeline = simulate(plan, Cluster(config.num_ranks * p, pp=p, gpus_per_node=config.ranks_per_node), cost)
    assert plan.meta["est_time_max_s"] == pytest.approx(timeline.step_time, rel=1e-6)


@settings(max_examples=80, deadline=None)
@given(
    st.integers(1, 3_000_000),
    st.integers(1, 64),
    st.sampled_from([0.0, 0.25, 0.5]),
    st.booleans(),
    st.booleans(),
    st.sampled_from([1e12, 1e5]),
    st.data(),
)
def test_a_micro_batch_of_one_piece_takes_the_time_of_the_general_sum(
    seq_len, ring, ratio, inter, recompute, bw_offload, data
):
    """``micro_batch_time``'s one-piece path (``piece_time``, with or without the ring's
    exposed time given) against its sum over pieces, reached by adding an empty piece (no
    tokens, no pairs): the same float."""
    from megatron_bytescale.planner.contract import MicroBatch
    from megatron_bytescale.planner.contract.plan import Piece, ring_pieces, whole_piece
    from megatron_bytescale.planner.estimate import micro_batch_time, piece_time, ring_exposed_time

    cost = comm_cost(num_layers=8, bw_offload=bw_offload, **({"recomputed_layers": 3} if recompute else {}))
    ring = min(ring, seq_len)
    pieces = ring_pieces(0, seq_len, tuple(range(ring))) if ring > 1 else [whole_piece(0, seq_len, 0)]
    p = data.draw(st.sampled_from(pieces))
    empty = Piece(1, 0, (), (p.ring[0],))
    one = micro_batch_time(cost, MicroBatch((p,), ratio), inter)
    assert one == micro_batch_time(cost, MicroBatch((p, empty), ratio), inter)
    exposed = ring_exposed_time(cost, seq_len, ring, inter) if ring > 1 else None
    assert one == piece_time(cost, seq_len, ring, p.tokens, ratio, inter, exposed)
