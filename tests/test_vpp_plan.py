"""Virtual pipeline stages (VPP) in the planner and the simulator: a chunk op does 1/V of a
stage's work, the interleaved bubble is (p - 1)/V of a stage time, chunk orders found by the
list schedule are complete, safe and within their memory cap, and plans with V > 1 hold
every token once and are estimated as the simulator runs them."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_bytescale.errors import ConfigError
from megatron_bytescale.planner.contract import (
    BACKWARD,
    FORWARD,
    MicroBatch,
    Plan,
    find_pipeline_deadlock,
    interleaved_order,
    megatron_interleaved_orders,
    pipelined_finish_times,
    ring_pieces,
    whole_piece,
)
from megatron_bytescale.planner.cost_model import FORWARD_SHARE, CostModel
from megatron_bytescale.planner.estimate import one_f_one_b_time
from megatron_bytescale.planner.order.interleaved import slot_interleaved_orders, slot_offsets
from megatron_bytescale.planner.order.runs import LocalBatch, Ordered, rings_at_one_index
from megatron_bytescale.planner.order.slots import rank_estimates
from megatron_bytescale.planner.order.stage_schedule import chunk_schedule, stage_schedule
from megatron_bytescale.planner.order.walk import Longer
from megatron_bytescale.planner.planner import PlannerConfig, plan_step
from megatron_bytescale.sim.cluster import Cluster
from megatron_bytescale.sim.timeline import evaluate, pipeline_ring_floor, simulate
from megatron_bytescale.virtual_stages import check_vpp

from planner_cases import check_stage_orders, draw_lengths, peak_in_flight, ring_pipelines, small_cost
from planner_oracles import plain_one_pipeline

MS = 1e-3


def unit_cost(layers: int = 4) -> CostModel:
    """1 ms per token per layer, nothing else."""
    return CostModel(
        a1=0.0,
        b1=1 * MS,
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


def local_plan(m: int, tokens: int, chunks: int, layers: int = 4) -> Plan:
    mbs = tuple(MicroBatch((whole_piece(i, tokens, 0),)) for i in range(m))
    return Plan(
        num_ranks=1, capacity=1000, num_layers=layers, seq_lens=(tokens,) * m, ranks=(mbs,), virtual_stages=chunks
    ).validate()


@pytest.mark.parametrize("p,v", [(2, 2), (4, 2), (4, 4), (3, 2)])
def test_one_pipeline_of_p_equal_micro_batches_takes_m_plus_bubble_over_v(p, v):
    """m = p equal local micro-batches of t = 10 tokens x 4 layers x 1 ms = 40 ms per stage:
    interleaved 1F1B finishes in (m + (p - 1) / V) t (1F1B: (m + p - 1) t); every device
    still computes m t, in 2 m V chunk ops of t / V."""
    t = 40 * MS
    plan = local_plan(p, 10, v)
    timeline = simulate(plan, Cluster(p, pp=p, gpus_per_node=8), unit_cost())
    assert timeline.step_time == pytest.approx((p + (p - 1) / v) * t)
    assert list(timeline.busy) == pytest.approx([p * t] * p)
    assert all(len(timeline.row(0, k)) == 2 * p * v for k in range(p))
    chunk_forward = timeline.row(0, 0)[0]
    assert chunk_forward[1] - chunk_forward[0] == pytest.approx(FORWARD_SHARE * t / v)
    one_f_one_b = simulate(local_plan(p, 10, 1), Cluster(p, pp=p, gpus_per_node=8), unit_cost()).step_time
    assert one_f_one_b == pytest.approx((2 * p - 1) * t)


def test_the_ring_floor_shrinks_its_bubble_by_v():
    """Two pipelines of p = 2 stages share m rings of 20 tokens (10 each: t = 40 ms per
    stage): alone they take (m + (p - 1) / V) t, but never less than one ring's chain
    through every virtual stage, p t; the simulator finds the same."""
    cost = unit_cost().with_overrides(kv_bytes_per_token=0.0, grad_bytes_per_token=0.0)
    cluster = Cluster(4, pp=2, gpus_per_node=8)
    t = 40 * MS
    for m in (1, 2, 4):
        rings = [ring_pieces(i, 20, (0, 1)) for i in range(m)]
        ranks = tuple(tuple(MicroBatch((r[k],)) for r in rings) for k in range(2))
        for v in (1, 2, 4):
            plan = Plan(
                num_ranks=2, capacity=100, num_layers=4, seq_lens=(20,) * m, ranks=ranks, virtual_stages=v
            ).validate()
            floor = pipeline_ring_floor(plan, cluster, cost)
            assert floor == pytest.approx(max(m + 1 / v, 2) * t)
            step = simulate(plan, cluster, cost).step_time
            if m <= 2:  # one group of p: the interleaved order reaches the floor
                assert step == pytest.approx(floor)
            assert step >= floor * (1 - 1e-9)


def pipelines():
    return ring_pipelines(ranks=(1, 4), max_rings=3, before=2, after=5, chunks=[2, 3])


@settings(max_examples=80, deadline=None)
@given(pipelines())
def test_chunk_orders_are_complete_safe_and_within_their_memory_cap(case):
    keys, times, p, v = case
    for cap in (p * v, p * v + p - 1):
        found = stage_schedule(keys, times, p, FORWARD_SHARE, cap=cap, chunks=v)
        if found is None:
            continue  # not shorter than the interleaved order (or stalled)
        check_stage_orders(keys, found.orders, p, v)
        assert peak_in_flight(found.orders) == found.peak_in_flight <= cap
        again = pipelined_finish_times(keys, times, p, FORWARD_SHARE, found.orders, v)
        assert again == pytest.approx(found.finish, rel=1e-9, abs=1e-12)  # the simulator's rule


@st.composite
def planner_cases(draw):
    rpn = draw(st.sampled_from([1, 2]))
    num_ranks = rpn * draw(st.integers(1, 3))
    capacity = draw(st.integers(8, 120))
    lens = draw_lengths(draw, capacity, num_ranks, max_short=20, max_long=3, shuffle=True)
    p = draw(st.sampled_from([2, 3]))
    v = draw(st.sampled_from([2, 4]))
    config = PlannerConfig(
        num_ranks=num_ranks,
        capacity=capacity,
        ranks_per_node=rpn,
        balance=draw(st.sampled_from(["none", "pp"])),
        offload=draw(st.booleans()),
        pipeline_stages=p,
        virtual_stages=v,
    )
    return lens, config, small_cost(num_layers=4)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(planner_cases())
def test_plans_with_virtual_stages_run_every_token_once_safely_and_as_estimated(case):
    lens, config, cost = case
    plan = plan_step(lens, config, cost).validate()  # every token once; chunk orders complete, in message order, safe
    p, v = config.pipeline_stages, config.virtual_stages
    assert plan.virtual_stages == v
    cluster = Cluster(config.num_ranks * p, pp=p, gpus_per_node=config.ranks_per_node)
    result = evaluate(plan, cluster, cost)
    assert plan.meta["est_time_max_s"] == pytest.approx(result.timeline.step_time, rel=0.05)
    orders = plan.decoded_stage_orders()
    if orders is not None:
        check_stage_orders(plan.ring_keys(), orders, p, v)
        cap = plan.meta["stage_orders"]["chunk_cap"]
    else:  # the interleaved order: Megatron's warm-up, at most p V + p - 1 chunk forwards
        cap = p * v + p - 1
        assert find_pipeline_deadlock(plan.ring_keys(), p, None, v) is None
    assert result.peak_in_flight <= cap
    assert result.metrics()["chunks_in_flight_max"] == result.peak_in_flight


def test_interleaved_order_holds_megatrons_warmup_at_most():
    for p in (2, 3, 4):
        for v in (2, 4):
            for count in (1, p, p + 1, 3 * p):
                peak = peak_in_flight([[interleaved_order(count, p, d, v) for d in range(p)]])
                assert peak <= p * v + p - 1


def test_vpp_refusals_name_the_fix():
    with pytest.raises(ConfigError, match="--vpp 2 needs pipeline stages.*--pp > 1"):
        check_vpp(2, 1, 16)
    with pytest.raises(ConfigError, match="--vpp 3 does not divide the 16 layers.*divisor of 16"):
        check_vpp(3, 2, 16)
    with pytest.raises(ConfigError, match="whole number"):
        check_vpp(0, 2, 16)
    check_vpp(4, 2, 16)


def test_cli_plans_and_simulates_with_vpp_and_refuses_bad_values(tmp_path, capsys):
    from megatron_bytescale.cli import main

    out = tmp_path / "p.json"
    rc = main(
        [
            "plan",
            "--model",
            "llama-7b",
            "--gpus",
            "16",
            "--capacity",
            "8K",
            "--pp",
            "2",
            "--vpp",
            "2",
            "--lengths",
            "20K,2K,3K,1K,40K,5K",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    plan = Plan.from_json(out).validate()
    assert plan.virtual_stages == 2
    sim = [
        "simulate",
        "--gpus",
        "16",
        "--gpus-per-node",
        "4",
        "--context",
        "64K",
        "--capacity",
        "8K",
        "--global-batch-tokens",
        "512K",
        "--pp",
        "2",
        "--steps",
        "1",
        "--strategies",
        "static,hdp-balanced",
    ]
    rc = main(sim + ["--vpp", "2", "--json", str(tmp_path / "s.json")])
    text = capsys.readouterr().out
    assert rc == 0 and "VPP 2" in text and "interleaved 1F1B" in text
    assert "chunk forwards a device holds at most (1F1B's memory: 4; Megatron's interleaved warm-up: 5)" in text
    import json

    results = json.loads((tmp_path / "s.json").read_text())["results"]
    for res in results.values():
        assert res["virtual_stages"] == 2 and res["chunks_in_flight_max"] >= 2
    for bad, problem in (
        (["--pp", "1", "--vpp", "2"], "needs pipeline stages"),
        (["--vpp", "3"], "does not divide the 16 layers"),
    ):
        assert main(sim + bad) != 0
        err = capsys.readouterr().err
        assert problem in err and len(err.strip().splitlines()) == 1


@st.composite
def slot_aligned_pipelines(draw, shifted: bool = True, chunks: tuple[int, ...] = (2, 3)):
    """Pipelines whose rings each sit at one slot (index + the rank's offset) on all members,
    as ``order_runs`` places them; the counts differ, so the default interleaved order may
    deadlock. Not ``shifted``: every offset 0, each ring the same micro-batch of its members."""
    n = draw(st.integers(1, 4))
    p = draw(st.sampled_from([2, 3, 4]))
    v = draw(st.sampled_from(chunks))
    offsets = [draw(st.integers(0, 3)) if shifted else 0 for _ in range(n)]
    counts = [draw(st.integers(0, 6)) for _ in range(n)]
    keys = [[None] * c for c in counts]
    for s in range(max(o + c for o, c in zip(offsets, counts))):
        here = [r for r in range(n) if offsets[r] <= s < offsets[r] + counts[r]]
        if len(here) >= 2 and draw(st.booleans()):
            ring = draw(st.sets(st.sampled_from(here), min_size=2))
            for r in ring:
                keys[r][s - offsets[r]] = ("ring", s)
    times = [[draw(st.floats(0.1, 5.0)) for _ in k] for k in keys]
    return keys, times, p, v


@settings(max_examples=80, deadline=None)
@given(slot_aligned_pipelines())
def test_slot_aligned_interleaved_orders_never_deadlock(case):
    keys, times, p, v = case
    tried = {-o % p for o in slot_offsets(keys)}  # the shifts chunk_schedule tries
    shortest = float("inf")
    for megatron, shift in [(False, 0)] + [(True, k) for k in range(p)]:
        orders = slot_interleaved_orders(keys, p, v, megatron, shift)
        assert orders is not None
        check_stage_orders(keys, orders, p, v)
        assert peak_in_flight(orders) <= p * v + p - 1
        if not megatron or shift in tried:
            shortest = min(shortest, max(pipelined_finish_times(keys, times, p, FORWARD_SHARE, orders, v), default=0.0))
    # the planner's choice is safe and no longer than any slot-aligned candidate it tries
    # (Megatron's with groups starting where some pipeline starts)
    orders, finish, _, _ = chunk_schedule(keys, times, p, FORWARD_SHARE, v)
    if orders is not None:
        check_stage_orders(keys, orders, p, v)
    assert max(finish, default=0.0) <= shortest + 1e-9


def _one_index_by_hand(keys) -> bool:
    index = {}
    return all(index.setdefault(k, m) == m for row in keys for m, k in enumerate(row) if k is not None)


@settings(max_examples=120, deadline=None)
@given(
    st.one_of(
        slot_aligned_pipelines(shifted=False, chunks=(1, 2, 3)),
        slot_aligned_pipelines(),
        ring_pipelines(ranks=(1, 4), max_rings=3, before=2, after=2, chunks=[1, 2, 3]),
    )
)
def test_rings_at_one_index_keep_the_default_orders_free_of_deadlock(case):
    """``rings_at_one_index`` says whether every ring is the same micro-batch of all its
    members (as a plain loop finds), and where it is, the default orders (1F1B, Megatron's
    interleaved one) do not deadlock whatever the counts: what lets ``rank_estimates`` stop
    their walk at the caller's step. Any layout, at one index or not (ring pipelines in one
    global order, slot-aligned ones with offsets: those may deadlock)."""
    keys, times, p, v = case
    ids = {k: i for i, k in enumerate(dict.fromkeys(k for row in keys for k in row if k is not None))}
    rings = np.array([-1 if k is None else ids[k] for row in keys for k in row], dtype=np.int64)
    one_index = rings_at_one_index(rings, [len(row) for row in keys])
    assert one_index == _one_index_by_hand(keys)
    if one_index:
        assert pipelined_finish_times(keys, times, p, FORWARD_SHARE, None, v) is not None


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 13), st.integers(0, 13), st.sampled_from([1, 2, 3, 4]), st.sampled_from([1, 2, 3, 5]))
def test_a_default_order_is_a_larger_counts_order_cut_down(small, large, p, v):
    """What ``rings_at_one_index`` rests on: every device's default order (1F1B, Megatron's
    interleaved one) for a count is the order for any larger count with the micro-batches it
    lacks left out, so the ranks' orders are cuts of one pipeline's."""
    small, large = sorted((small, large))
    for stage in range(p):
        cut = [op for op in interleaved_order(large, p, stage, v) if op.micro_batch < small]
        assert interleaved_order(small, p, stage, v) == cut


def test_rings_crossing_between_indexes_can_deadlock_and_are_told_apart():
    """Two rings in opposite order on two ranks: not at one index, and the default order
    deadlocks (with one chunk and with two), so ``rank_estimates`` must walk it to the end."""
    keys, times = [[0, 1], [1, 0]], [[1.0, 1.0], [1.0, 1.0]]
    assert not rings_at_one_index(np.array([0, 1, 1, 0]), [2, 2])
    assert rings_at_one_index(np.array([-1, 0, 1, 0, 1]), [3, 2]) is False  # ring 0: 1 and 0
    assert rings_at_one_index(np.array([0, 1, -1, 0, 1, -1]), [3, 3])
    for v in (1, 2):
        assert pipelined_finish_times(keys, times, 2, FORWARD_SHARE, None, v) is None


@settings(max_examples=100, deadline=None)
@given(
    st.one_of(slot_aligned_pipelines(), ring_pipelines(ranks=(1, 4), max_rings=3, before=2, after=2, chunks=[2, 3])),
    st.booleans(),
    st.floats(0.5, 1.5),
    st.data(),
)
def test_a_limit_stops_only_the_walks_of_orders_that_could_not_be_kept(case, whole, scale, data):
    """``rank_estimates`` given the step of a candidate before (``limit``) is its estimate
    without one, or ``Longer`` where that is over the limit; the orders it stopped were over
    the step they were stopped at; and where it is kept (not over), ``chunk_schedule``
    reading what it evaluated chooses the same orders as from the unlimited estimate's.
    Rings at one slot (the slot-aligned orders exist) or anywhere (where the interleaved order
    deadlocks, 1F1B's makespans); the graphs are walked by the compiled kernel (the
    contract's walk ignores a limit)."""
    keys, times, p, v = case
    if whole:  # whole seconds: orders of equal steps (the tie rule)
        times = [[float(round(t)) for t in row] for row in times]
    ids = {k: i for i, k in enumerate(dict.fromkeys(k for row in keys for k in row if k is not None))}
    keys = [[None if k is None else ids[k] for k in row] for row in keys]  # the planner's rings are ints
    ring_time = {k: times[r][i] for r, row in enumerate(keys) for i, k in enumerate(row) if k is not None}
    runs = [[k if k is not None else LocalBatch((0,), 0.0, t) for k, t in zip(row, ts)] for row, ts in zip(keys, times)]
    times = [[ring_time[k] if k is not None else t for k, t in zip(row, ts)] for row, ts in zip(keys, times)]
    ordered = Ordered(runs, [0.0] * len(runs))
    # the estimate's rule, by the contract's walks: the interleaved order unless it deadlocks,
    # then the shorter slot-aligned one (not Megatron's on a tie), then 1F1B's makespans
    want = pipelined_finish_times(keys, times, p, FORWARD_SHARE, None, v)
    if want is None:
        slot = [slot_interleaved_orders(keys, p, v, megatron=m) for m in (False, True)]
        walked = [pipelined_finish_times(keys, times, p, FORWARD_SHARE, o, v) for o in slot if o is not None]
        walked = [w for w in walked if w is not None]
        want = min(walked, key=max) if walked else [one_f_one_b_time(t, p, FORWARD_SHARE) for t in times]
    full = {}
    assert rank_estimates(ordered, p, ring_time, FORWARD_SHARE, v) == want
    limit = scale * max(want, default=0.0) if data.draw(st.booleans()) else max(want, default=0.0)
    got = rank_estimates(ordered, p, ring_time, FORWARD_SHARE, v, full, limit)
    if isinstance(got, Longer):
        assert got.limit == limit and max(want) > limit
        return
    assert got == want
    for _, (orders, finish) in full.items():  # each order evaluated: its walk, or stopped over that step
        walked = pipelined_finish_times(keys, times, p, FORWARD_SHARE, orders, v)
        if isinstance(finish, Longer):
            assert max(walked) > finish.limit
        else:
            assert finish == walked
    kept = chunk_schedule(keys, times, p, FORWARD_SHARE, v, full)
    plain = chunk_schedule(keys, times, p, FORWARD_SHARE, v)  # every order walked afresh
    assert kept[1:3] == plain[1:3] and _codes(kept[0], v) == _codes(plain[0], v)


def test_chunk_schedule_walks_the_default_order_again_where_an_estimate_stopped_it():
    """A default order's walk the estimate stopped at another plan's step (``Longer`` in
    ``known``) tells nothing of its finish: ``chunk_schedule`` walks it again and chooses as
    without ``known``."""
    keys, times = [[0, None, None], [0, None]], [[2.0, 0.5, 0.25], [2.0, 1.0]]
    plain = chunk_schedule(keys, times, 2, FORWARD_SHARE, 2)
    again = chunk_schedule(keys, times, 2, FORWARD_SHARE, 2, {None: (None, Longer(0.1))})
    assert again[1:] == plain[1:] and _codes(again[0], 2) == _codes(plain[0], 2)


def _codes(orders, chunks):
    return None if orders is None else (orders.codes(chunks) if hasattr(orders, "codes") else orders)


def test_interleaved_order_is_megatrons_schedule():
    """The runtime's default order (and the static baseline's) is Megatron's interleaved
    schedule: pinned here on a count that is not a multiple of p (phantom micro-batch 5 of
    the padded group of four dropped)."""
    for count, p, v in ((5, 4, 3), (6, 2, 2), (3, 3, 4), (8, 4, 5)):
        assert [interleaved_order(count, p, d, v) for d in range(p)] == megatron_interleaved_orders(count, p, v)
    # p 2, V 2, 2 micro-batches: device 1 warms up with 2 chunk forwards, then alternates
    assert interleaved_order(2, 2, 1, 2) == [
        (FORWARD, 0, 0),
        (FORWARD, 1, 0),
        (FORWARD, 0, 1),
        (BACKWARD, 0, 1),
        (FORWARD, 1, 1),
        (BACKWARD, 1, 1),
        (BACKWARD, 0, 0),
        (BACKWARD, 1, 0),
    ]


@pytest.mark.parametrize("p,v", [(2, 2), (3, 2), (4, 2), (4, 3), (4, 5)])
def test_megatron_interleaved_order_has_megatron_bubble_for_any_count(p, v):
    """Megatron's fixed interleaved schedule, phantoms padding the count to a multiple of p:
    safe and complete for every count, within Megatron's warm-up memory, and on equal
    micro-batches of t it takes (m + (p - 1) / V) t whenever m is a multiple of p, where the
    greedy run (``one_pipeline``) loses whole micro-batches (m = 16, p = 4, V = 5:
    17.6 t against 16.6 t)."""
    for m in range(3 * p + 2):
        orders = megatron_interleaved_orders(m, p, v)
        keys = [[None] * m]
        check_stage_orders(keys, [orders], p, v)
        for d, order in enumerate(orders):
            held = peak = 0
            for direction, _, _ in order:
                held += 1 if direction == FORWARD else -1
                peak = max(peak, held)
            assert peak <= 2 * (p - 1 - d) + (v - 1) * p + 1
        if m and m % p == 0:
            finish = pipelined_finish_times(keys, [[1.0] * m], p, FORWARD_SHARE, [orders], v)
            assert max(finish) == pytest.approx(m + (p - 1) / v)
    greedy = pipelined_finish_times(
        [[None] * 16], [[1.0] * 16], 4, FORWARD_SHARE, [plain_one_pipeline([5.0] * 16, [10.0] * 16, 4, 5)], 5
    )
    megatron = pipelined_finish_times(
        [[None] * 16], [[1.0] * 16], 4, FORWARD_SHARE, [megatron_interleaved_orders(16, 4, 5)], 5
    )
    assert max(megatron) == pytest.approx(16.6) and max(greedy) > 17.5
