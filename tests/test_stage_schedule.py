"""Per-stage orders other than 1F1B (``planner.order.stage_schedule``) and plans that carry them:
every operation once, stages passing micro-batches on in the order the next one runs them,
no deadlock, at most ``p`` micro-batches in flight per stage, and the estimate equal to the
simulated step."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_bytescale.errors import PlanError
from megatron_bytescale.planner.contract import (
    FORWARD,
    MicroBatch,
    Op,
    Plan,
    encode_stage_orders,
    find_pipeline_deadlock,
    pipelined_finish_times,
    ring_pieces,
    whole_piece,
)
from megatron_bytescale.planner.cost_model import FORWARD_SHARE
from megatron_bytescale.planner.estimate import micro_batch_time
from megatron_bytescale.planner.order.stage_schedule import stage_schedule
from megatron_bytescale.planner.planner import PlannerConfig, plan_step
from megatron_bytescale.sim.cluster import Cluster
from megatron_bytescale.sim.timeline import simulate

from planner_cases import check_stage_orders, draw_lengths, peak_in_flight, ring_pipelines, small_cost


def pipelines():
    return ring_pipelines(ranks=(2, 5), max_rings=4, before=3, after=4, giant=True)


@settings(max_examples=150, deadline=None)
@given(pipelines())
def test_stage_orders_are_complete_safe_within_memory_and_shorter_than_1f1b(case):
    keys, times, p = case
    if find_pipeline_deadlock(keys, p) is not None:
        return  # no 1F1B baseline to beat (the planner never hands such runs over)
    base = max(pipelined_finish_times(keys, times, p, FORWARD_SHARE), default=0.0)
    found = stage_schedule(keys, times, p, FORWARD_SHARE)
    if found is None:
        return
    check_stage_orders(keys, found.orders, p)
    assert peak_in_flight(found.orders) == found.peak_in_flight <= p
    # the estimate is the longest path through the orders: what the simulator computes
    again = pipelined_finish_times(keys, times, p, FORWARD_SHARE, found.orders)
    assert again == pytest.approx(found.finish, rel=1e-9, abs=1e-12)
    assert found.makespan < base


LATE_RING_KEYS = [[("A",), None], [None, None, ("A",)]]
LATE_RING_TIMES = [[6.0, 4.0], [4.0, 1.0, 6.0]]


def test_a_ring_late_in_one_members_list_runs_first_on_both():
    """Two pipelines of two stages share ring A, first on pipeline 0 and last on pipeline 1.
    Under 1F1B pipeline 0 waits in A for pipeline 1's local work (22.7 s); the search runs A
    first on both and the local work after it, out of pipeline 1's list order (16.7 s)."""
    keys, times = LATE_RING_KEYS, LATE_RING_TIMES
    base = max(pipelined_finish_times(keys, times, 2, FORWARD_SHARE))
    found = stage_schedule(keys, times, 2, FORWARD_SHARE)
    assert base == pytest.approx(68 / 3)
    assert found is not None and found.makespan == pytest.approx(50 / 3)
    check_stage_orders(keys, found.orders, 2)
    assert found.orders[1][0][0] == Op(FORWARD, 2)  # the ring's forward before the local work
    assert found.peak_in_flight <= 2


def test_the_memory_cap_is_honoured():
    keys, times = LATE_RING_KEYS, LATE_RING_TIMES
    found = stage_schedule(keys, times, 2, FORWARD_SHARE, cap=1)
    assert found is not None and peak_in_flight(found.orders) == 1  # one micro-batch in flight at a time
    with pytest.raises(ValueError, match="cap must be >= 1"):
        stage_schedule(keys, times, 2, FORWARD_SHARE, cap=0)


# ------------------------------------------------------------- plans with stage orders
@st.composite
def planner_cases(draw):
    rpn = draw(st.sampled_from([1, 2]))
    num_ranks = rpn * draw(st.integers(1, 3))
    capacity = draw(st.integers(8, 120))
    lens = draw_lengths(draw, capacity, num_ranks, max_short=24, max_long=3, shuffle=True)
    config = PlannerConfig(
        num_ranks=num_ranks,
        capacity=capacity,
        ranks_per_node=rpn,
        balance=draw(st.sampled_from(["dp", "pp"])),
        offload=draw(st.booleans()),
        pipeline_stages=draw(st.sampled_from([2, 4])),
        pipeline_schedule="search",
    )
    return lens, config, small_cost(num_layers=draw(st.sampled_from([2, 4])))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(planner_cases())
def test_plans_with_stage_orders_hold_every_token_once_and_match_the_simulator(case):
    lens, config, cost = case
    plan = plan_step(lens, config, cost).validate()  # every token once; orders complete and safe
    p = config.pipeline_stages
    cluster = Cluster(config.num_ranks * p, pp=p, gpus_per_node=config.ranks_per_node)
    step = simulate(plan, cluster, cost).step_time
    assert plan.meta["est_time_max_s"] == pytest.approx(step, rel=0.05)
    if plan.stage_orders is not None:
        orders = plan.decoded_stage_orders()
        check_stage_orders(plan.ring_keys(), orders, p)
        assert peak_in_flight(orders) <= p
        assert step < plan.meta["stage_orders"]["one_f_one_b_est_s"] * (1 + 0.05)
        again = Plan.from_json(plan.to_json())
        assert again.stage_orders == plan.stage_orders


def test_plan_step_searches_only_when_asked_and_refuses_unknown_schedules():
    from megatron_bytescale.errors import ConfigError

    lens = [300] + [20] * 30
    base = {"num_ranks": 2, "capacity": 160, "ranks_per_node": 2, "balance": "pp", "pipeline_stages": 4}
    cost = small_cost(num_layers=4)
    assert plan_step(lens, PlannerConfig(**base), cost).stage_orders is None
    with pytest.raises(ConfigError, match="unknown pipeline_schedule 'zb'; choose one of 1f1b, search"):
        plan_step(lens, PlannerConfig(**base, pipeline_schedule="zb"), cost)


def two_rank_plan(orders=None) -> Plan:
    lens = (10, 3, 4)
    r = ring_pieces(0, 10, (0, 1))
    ranks = (
        (MicroBatch((r[0],)), MicroBatch((whole_piece(1, 3, 0),))),
        (MicroBatch((whole_piece(2, 4, 1),)), MicroBatch((r[1],))),
    )
    return Plan(num_ranks=2, capacity=20, num_layers=2, seq_lens=lens, ranks=ranks, stage_orders=orders)


def test_validate_refuses_incomplete_crossed_or_deadlocking_stage_orders():
    ok = [
        [[(0, 0), (0, 1), (1, 1), (1, 0)], [(0, 0), (0, 1), (1, 1), (1, 0)]],
        [[(0, 0), (0, 1), (1, 0), (1, 1)], [(0, 0), (0, 1), (1, 0), (1, 1)]],
    ]
    two_rank_plan(encode_stage_orders(ok)).validate()
    missing = [[s[:3] for s in rank] for rank in ok]
    with pytest.raises(PlanError, match="once forward and once backward"):
        two_rank_plan(encode_stage_orders(missing)).validate()
    crossed = [ok[0], [ok[1][0], [(0, 1), (0, 0), (1, 0), (1, 1)]]]
    with pytest.raises(PlanError, match="stages 0 and 1 run their forwards in different orders"):
        two_rank_plan(encode_stage_orders(crossed)).validate()
    # two rings on both ranks: rank 0 runs ring A's forward first, rank 1 ring B's
    lens = (10, 12)
    a, b = ring_pieces(0, 10, (0, 1)), ring_pieces(1, 12, (0, 1))
    ranks = ((MicroBatch((a[0],)), MicroBatch((b[0],))), (MicroBatch((a[1],)), MicroBatch((b[1],))))
    first_a, first_b = [(0, 0), (0, 1), (1, 0), (1, 1)], [(0, 1), (0, 0), (1, 1), (1, 0)]
    stuck = [[first_a, first_a], [first_b, first_b]]
    plan = Plan(
        num_ranks=2, capacity=20, num_layers=2, seq_lens=lens, ranks=ranks, stage_orders=encode_stage_orders(stuck)
    )
    with pytest.raises(PlanError, match="stage_orders deadlock: .*wait in a cycle"):
        plan.validate()


@pytest.mark.parametrize("schedule", ["1f1b", "search"])
def test_the_pipelined_estimate_uses_the_cost_models_forward_share(schedule):
    """A profile whose forward takes 45% of a layer's time: the planner's pipelined estimate
    (1F1B or searched orders) splits each stage's time as the simulator does."""
    cost = small_cost(
        num_layers=4, forward_share=0.45, kv_bytes_per_token=0.0, grad_bytes_per_token=0.0, p2p_latency_s=1e-12
    )
    lens = [300, 260] + [40, 25, 60, 10, 33, 47, 12, 80, 5, 70] * 2
    config = PlannerConfig(
        num_ranks=4, capacity=100, ranks_per_node=2, balance="pp", pipeline_stages=4, pipeline_schedule=schedule
    )
    plan = plan_step(lens, config, cost).validate()
    step = simulate(plan, Cluster(16, pp=4, gpus_per_node=2), cost).step_time
    assert plan.meta["est_time_max_s"] == pytest.approx(step, rel=1e-6)


def test_the_simulator_passes_the_pipeline_schedule_to_the_hdp_planner():
    from megatron_bytescale.sim.strategies import StrategyInput, make_plan

    lens = [300, 260] + [40, 25, 60, 10, 33, 47, 12, 80, 5, 70] * 2
    x = StrategyInput(lens, Cluster(16, pp=4, gpus_per_node=2), small_cost(num_layers=4), 100, 300, "search")
    notes = make_plan("hdp-balanced", x).meta["notes"]
    assert len(notes) == 1 and notes[0].startswith("searched stage orders: ")
    assert "notes" not in make_plan("hdp-balanced", StrategyInput(lens, x.cluster, x.cost, 100, 300)).meta


def test_the_floor_of_rings_on_every_pipeline_is_their_1f1b_alone_and_nothing_beats_it():
    """Three rings on both pipelines (equal stage times) and local work: the floor is
    (3 + p - 1) x a ring's stage time, and neither 1F1B nor the searched orders go under it."""
    from megatron_bytescale.sim.timeline import evaluate, pipeline_ring_floor

    lens = (40, 40, 40) + (6,) * 8
    rings = [ring_pieces(i, 40, (0, 1)) for i in range(3)]
    ranks = tuple(
        tuple(MicroBatch((rings[i][r],)) for i in range(3))
        + tuple(MicroBatch((whole_piece(3 + 4 * r + j, 6, r),)) for j in range(4))
        for r in range(2)
    )
    plan = Plan(num_ranks=2, capacity=20, num_layers=2, seq_lens=lens, ranks=ranks).validate()
    cost = small_cost(num_layers=2)
    cluster = Cluster(8, pp=4, gpus_per_node=2)
    floor = pipeline_ring_floor(plan, cluster, cost)
    timeline = simulate(plan, cluster, cost)
    f, b = timeline.row(0, 3)[:2]  # the first ring's forward and backward on the last stage
    ring_stage = (f[1] - f[0]) + (b[1] - b[0])
    assert floor == pytest.approx((3 + 4 - 1) * ring_stage, rel=1e-6)
    assert timeline.step_time >= floor * (1 - 1e-9)
    assert evaluate(plan, cluster, cost).metrics()["pipeline_ring_floor_s"] == floor
    keys = plan.ring_keys()
    times = [[micro_batch_time(cost, mb) for mb in mbs] for mbs in plan.ranks]
    found = stage_schedule(keys, times, 4, cost.forward_share)
    assert found is None or found.makespan >= floor * (1 - 1e-6)


def test_a_plan_ordered_for_other_stage_counts_is_refused():
    from megatron_bytescale.planner.contract import plan_pipeline_deadlock

    ok = [[[(0, 0), (0, 1), (1, 1), (1, 0)]] * 2, [[(0, 0), (0, 1), (1, 0), (1, 1)]] * 2]
    plan = two_rank_plan(encode_stage_orders(ok)).validate()
    assert plan.stage_count == 2 and plan_pipeline_deadlock(plan, 2) is None
    assert plan_pipeline_deadlock(plan, 4) == "the plan orders 2 pipeline stages but the pipeline has 4"
    with pytest.raises(PlanError, match="orders 2 pipeline stages.*the cluster has PP 4"):
        simulate(plan, Cluster(8, pp=4, gpus_per_node=2), small_cost(num_layers=2))
