"""What the planner's search shortcuts leave as it was: schedules stopped once they cannot win,
units shared between candidate targets, long units timed all at once; and ``balanced_target``
against its tests of T summed one length at a time."""

from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_bytescale.data.workloads import sample_lengths
from megatron_bytescale.planner import search
from megatron_bytescale.planner.balance import UnitColumns, schedule
from megatron_bytescale.planner.cost_model import CostModel
from megatron_bytescale.planner.estimate import ring_share_time
from megatron_bytescale.planner.expert.timing import ep_all_to_all_time
from megatron_bytescale.planner.placement import Ranks
from megatron_bytescale.planner.planner import PlannerConfig, check_lengths, plan_step
from megatron_bytescale.planner.sizing import two_level
from megatron_bytescale.planner.sizing.rings import RingSizer, balanced_target, ring_decisions
from megatron_bytescale.planner.specs import HardwareSpec, ModelSpec
from megatron_bytescale.planner.units import UnitMemo, make_units, short_units

from planner_cases import draw_lengths, small_cost


@pytest.mark.parametrize("dataset", ["github", "byted"])
@pytest.mark.parametrize("mode", ["dp", "ep"])
def test_retargets_stopped_early_give_the_plan_of_every_target_in_full(dataset, mode):
    """The retargets of DP balance (and EP's): a target's schedule stops once its bound
    passes the best step so far, and the plan is the one made with every target scheduled in
    full. Batches of the simulator's workloads that retarget (4M tokens, 512 GPUs)."""
    model, tp, ep = ("llama-7b", 1, 1) if mode == "dp" else ("mistral-8x7b", 4, 8)
    cost = CostModel.analytic(ModelSpec.load(model), HardwareSpec.load("h100"), tp=tp)
    config = PlannerConfig(num_ranks=512 // tp, capacity=8192, ranks_per_node=8 // tp, balance="dp", expert_parallel=ep)
    given_up = []

    def counted(*args, **kwargs):
        got = schedule(*args, **kwargs)
        given_up.append(got is None)
        return got

    def in_full(*args, give_up_above=None, **kwargs):
        return schedule(*args, **kwargs)

    for seed in (0, 1):
        lens = sample_lengths(dataset, 4 << 20, 2 << 20, np.random.default_rng(seed))
        with mock.patch.object(search, "schedule", counted):
            plan = plan_step(lens, config, cost)
        with mock.patch.object(search, "schedule", in_full):
            full = plan_step(lens, config, cost)
        assert plan.to_dict() | {"meta": None} == full.to_dict() | {"meta": None}
    assert any(given_up)  # the batches retarget, and some schedules stop early


@pytest.mark.parametrize("mode", ["dp", "ep", "pp"])
def test_targets_sharing_their_units_give_the_plan_of_units_made_afresh(mode):
    """The candidate targets of a step share their long units (``units.UnitMemo``): the plan,
    its estimates included, equals the plan with every target's units made anew, so no unit is
    changed once made; and the targets did share some (GitHub-like batches that retarget, 4M
    tokens on 512 GPUs, seeds 0-1)."""
    layouts = {"dp": ("llama-7b", 1, 1, 1), "ep": ("mistral-8x7b", 4, 8, 1), "pp": ("llama-7b", 1, 1, 4)}
    model, tp, ep, pp = layouts[mode]
    cost = CostModel.analytic(ModelSpec.load(model), HardwareSpec.load("h100"), tp=tp, pp=pp)
    config = PlannerConfig(
        num_ranks=512 // (tp * pp),
        capacity=8192,
        ranks_per_node=8 // tp,
        balance="pp" if pp > 1 else "dp",
        pipeline_stages=pp,
        expert_parallel=ep,
    )
    shared = []

    def counted(*args):
        memo = args[-1]
        before = 0 if memo is None else len(memo.units)
        got, columns = make_units(*args)
        shared.append(sum(1 for u in got if u.kind != "short") - (0 if memo is None else len(memo.units) - before))
        return got, columns

    def afresh(*args):
        return make_units(*args[:-1], None)

    for seed in (0, 1):
        lens = sample_lengths("github", 4 << 20, 2 << 20, np.random.default_rng(seed))
        with mock.patch.object(search, "make_units", counted):
            plan = plan_step(lens, config, cost)
        with mock.patch.object(search, "make_units", afresh):
            fresh = plan_step(lens, config, cost)
        drop = {"plan_time_s": None, "compile_s": None}
        assert plan.to_dict() | {"meta": plan.meta | drop} == fresh.to_dict() | {"meta": fresh.meta | drop}
    assert any(shared)  # some target reused units another made


@pytest.mark.parametrize(
    "model, tp, ep, recompute",
    [
        ("llama-7b", 1, 1, None),
        ("llama-7b", 1, 1, "full"),
        ("mistral-8x7b", 4, 8, "selective"),
        ("llama-70b", 8, 1, None),
    ],
)
def test_long_units_take_their_seconds_from_the_columns_as_one_made_alone(model, tp, ep, recompute):
    """``make_units``' columns are ``UnitColumns.of`` its units (dtypes included), and each long
    unit's seconds, computed for all of them at once, are what one unit timed alone gets: its
    layers whole on one rank, ``ring_share_time`` of Python ints, ``two_level.share_time`` in
    two-level groups, plus EP's all-to-alls; over every target of GitHub-like batches (rings
    inside and across nodes, two-level groups and offloaded sequences on one rank among them),
    with and without recompute."""
    cost = CostModel.analytic(ModelSpec.load(model), HardwareSpec.load("h100"), tp=tp)
    if recompute:
        full = recompute == "full"
        cost = cost.with_recompute(recompute, "uniform" if full else None, 1 if full else None)
    rpn = 8 // tp
    config = PlannerConfig(num_ranks=2048 // tp, capacity=8192, ranks_per_node=rpn, expert_parallel=ep)
    lens = check_lengths(sample_lengths("github", 16 << 20, 2 << 20, np.random.default_rng(3)))
    sizer = search._ring_sizer(config, cost, 1, None)
    base = balanced_target(np.asarray(lens), sizer)
    shorts = short_units(lens, config, cost, rpn)
    memo = UnitMemo()
    seen = {"long": 0, "ring": 0, "across": 0, "two-level": 0}
    for scale in (1.0, 0.5, 0.2, 0.05):
        rings = ring_decisions(lens, sizer, base * scale)
        units, columns = make_units(lens, rings, config, cost, rpn, shorts, memo)
        for got, want in zip(columns._columns(), UnitColumns.of(units)._columns(), strict=True):
            assert got.dtype == want.dtype and np.array_equal(got, want)
        for u in units[: len(units) - len(shorts)]:
            s = lens[u.seq_ids[0]]
            if u.ring_size == 1:
                alone, kind = cost.num_layers * cost.layer_time(s), "long"
            elif u.heads_split > 1:
                alone, kind = two_level.share_time(cost, s, u.ring_size, u.heads_split, rpn), "two-level"
            else:
                across = u.ring_size > rpn
                alone, kind = ring_share_time(cost, s, u.ring_size, across), "across" if across else "ring"
            if ep > 1:
                alone += ep_all_to_all_time(cost, u.tokens, ep, rpn)
            assert u.time == alone and u.tokens == (s if u.ring_size == 1 else -(-s // u.ring_size))
            seen[kind] += 1
    assert seen["across"] and (seen["ring"] and seen["two-level"] or tp == 8) and (seen["long"] or recompute), seen


@st.composite
def pipelined_batches(draw):
    num_ranks = draw(st.sampled_from([4, 8, 16]))
    capacity = draw(st.integers(40, 120))
    lens = draw_lengths(draw, capacity, num_ranks, max_short=40, max_long=6, min_long=1)
    config = PlannerConfig(
        num_ranks=num_ranks,
        capacity=capacity,
        ranks_per_node=draw(st.sampled_from([1, 2, 4])),
        balance="pp",
        pipeline_stages=draw(st.sampled_from([2, 4])),
    )
    return lens, config


@settings(max_examples=40, deadline=None)
@given(pipelined_batches(), st.sampled_from([1, 2, 4]))
def test_best_schedules_stopped_early_match_every_target_scheduled(case, ordered):
    """The targets ``search`` orders for 1F1B: the same targets, bounds and schedules as
    scheduling every target in full and sorting by bound (ties to the earlier target), though
    schedules that cannot be among the best stop early."""
    lens, config = case
    ranks = Ranks.of(config.num_ranks, config.ranks_per_node)
    targets = search._pipeline_targets(check_lengths(lens), config, small_cost(), ranks, None)
    for *_, units, columns in targets:  # the short units' columns read once, joined to each target's long ones
        whole = UnitColumns.of(units)
        for got, want in zip(columns._columns(), whole._columns(), strict=True):
            assert got.dtype == want.dtype and np.array_equal(got, want)
    full = [
        (float(a.key.max()), search.PIPELINE_RETARGET[position], a)
        for position, _, _, units, _ in targets
        for a in [schedule(units, ranks, "pp", config.slack, config.pipeline_stages)]
    ]
    plain = sorted(full, key=lambda c: c[0])[:ordered]
    with mock.patch.object(search, "PIPELINE_ORDERED", ordered):
        got = search._best_schedules(targets, ranks, config)
    assert [(c[0], c[5]) for c in got] == [(k, scale) for k, scale, _ in plain]
    assert [c[4].runs for c in got] == [a.runs for _, _, a in plain]
    assert [c[4].members for c in got] == [a.members for _, _, a in plain]


def plain_balanced_target(lens, sizer):
    """``balanced_target`` written plainly: per length its curve, running minimum and rank-
    seconds, the tests of T summed one length at a time, the same bisection."""
    cost, capacity, p, n_ranks = sizer.cost, sizer.capacity, sizer.stages, sizer.num_ranks
    short = lens[lens <= capacity].astype(np.float64)
    short_times = cost.short_time(short, capacity)
    work = float(short_times.sum())
    short_times = np.sort(p * short_times)
    floor = float(short_times[-1]) if short.size else 0.0
    long_lens, counts = np.unique(lens[lens > capacity], return_counts=True)
    curves = []
    for s, n in zip(long_lens.tolist(), counts.tolist()):
        sizes, times = sizer.curve(s)
        floor = max(floor, p * float(times.min()))
        curves.append((n, sizes.tolist(), (sizes * times).tolist(), (p * np.minimum.accumulate(times)).tolist()))
    fixed = [c for c in curves if c[3][0] <= floor]
    varying = [c for c in curves if c[3][0] > floor]
    work += sum(n * rs[0] for n, _, rs, _ in fixed)
    held = sorted(
        [(t, 1) for t in short_times.tolist()] + [(b[0], n * sz[0]) for n, sz, _, b in fixed], key=lambda x: x[0]
    )

    def passes(t):
        total = work
        ranks = sum(r for x, r in held if x > t / 2)
        for n, sz, rs, b in varying:
            k = next((j for j, x in enumerate(b) if x <= t), len(b) - 1)  # first within t, else the last
            total += n * rs[k]
            if b[k] > t / 2:
                ranks += n * sz[k]
        return total / n_ranks <= t and ranks <= n_ranks

    lo = floor
    if passes(lo):
        return lo
    hi = 2 * max(lo, work / n_ranks, 1e-12)
    while not passes(hi):
        hi *= 2
        if hi > 1e12:
            return max(floor, work / n_ranks)
    while hi - lo > 1e-4 * hi:
        mid = 0.5 * (lo + hi)
        if passes(mid):
            hi = mid
        else:
            lo = mid
    return hi


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.integers(1, 512), max_size=30),
    st.lists(st.integers(513, 4000), max_size=12),
    st.sampled_from([(16, 4, 1), (64, 8, 1), (32, 8, 3), (8, 8, 2)]),
)
def test_balanced_target_of_all_lengths_at_once_matches_one_length_at_a_time(short, long, shape):
    num_ranks, per_node, stages = shape
    lens = np.array((short + long + long[:3]) or [100])  # repeated lengths: counts > 1
    cost = small_cost().with_overrides(q_heads=32, kv_heads=8, q_bytes_per_token=4096.0)
    sizer = RingSizer(512, cost, True, num_ranks, per_node, stages)
    got = balanced_target(lens, sizer)
    assert got == plain_balanced_target(lens, RingSizer(512, cost, True, num_ranks, per_node, stages))
