"""The planner's fast paths give exactly what their plain versions give (same plans, bit for bit).

Each fast path (rounds of numpy work for long runs of short sequences, bucket cuts from a
running sum, ring placement told which ranks changed, two-level curves of many lengths at
once) is checked against a plain one-at-a-time version on random inputs, ties included.
"""

import copy
import heapq
import random
from contextlib import contextmanager
from unittest import mock

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from megatron_bytescale.planner import balance, compiled, two_level
from megatron_bytescale.planner.balance import _Loads, make_buckets
from megatron_bytescale.planner.placement import RingPlacer
from megatron_bytescale.planner.sharding import RingSizer, ring_times

from planner_cases import small_cost

# coarse values make equal keys and equal unit times common (the tie rules must agree)
coarse = st.integers(0, 6).map(lambda v: v / 4)


def one_at_a_time(clock, seconds, tokens, pipeline_stages=1, by_tokens=False):
    """The DP rule written plainly: each unit to the least-loaded rank, ties to the lowest."""
    n = len(clock)
    clock, count, peak = list(clock), [0.0] * n, [0.0] * n
    bubble = pipeline_stages - 1
    key = [count[r] if by_tokens else clock[r] + bubble * peak[r] for r in range(n)]
    ranks = []
    for t, k in zip(seconds, tokens):
        r = min(range(n), key=lambda i: (key[i], i))
        clock[r] += t
        count[r] += k
        peak[r] = max(peak[r], t)
        key[r] = count[r] if by_tokens else clock[r] + bubble * peak[r]
        ranks.append(r)
    return ranks, clock, key


def loads_at(clock, pipeline_stages=1, by_tokens=False) -> _Loads:
    """Loads as if each rank had been busy ``clock[r]`` seconds (no unit counted in its peak)."""
    loads = _Loads(len(clock), pipeline_stages, by_tokens)
    loads.clock = list(clock)
    loads.last_key = [0.0] * len(clock) if by_tokens else list(clock)
    loads.top = max(loads.last_key)
    loads._dirty = list(range(len(clock)))  # the key array follows
    loads.heap = [(k, r) for r, k in enumerate(loads.last_key)]
    heapq.heapify(loads.heap)
    return loads


@settings(max_examples=150, deadline=None)
@given(
    st.lists(coarse, min_size=1, max_size=12),
    st.lists(st.tuples(st.integers(1, 8).map(lambda v: v / 8), st.integers(1, 50)), min_size=1, max_size=60),
    st.sampled_from([(1, False), (3, False), (1, True)]),
    st.booleans(),
)
def test_rounds_give_what_one_unit_at_a_time_gives(clock, units, mode, longest_first):
    stages, by_tokens = mode
    if longest_first:  # the scheduler's order
        units = sorted(units, key=lambda u: -u[0])
    seconds, tokens = [u[0] for u in units], [u[1] for u in units]
    then = seconds[:3], tokens[:3]  # more units after the run: the heap must be whole again
    ranks, clocks, keys = one_at_a_time(clock, seconds + then[0], tokens + then[1], stages, by_tokens)
    # the loop alone, rounds alone, rounds until one is short and then the loop
    for bulk_run, min_round in ((10**9, 1), (1, 1), (1, 4)):
        loads = loads_at(clock, stages, by_tokens)
        old = balance.BULK_RUN, balance.MIN_ROUND
        balance.BULK_RUN, balance.MIN_ROUND = bulk_run, min_round
        try:
            got = loads.give_many(seconds, tokens) + loads.give_many(*then)
        finally:
            balance.BULK_RUN, balance.MIN_ROUND = old
        assert got == ranks
        assert loads.clock == clocks and loads.last_key == keys
        if bulk_run == 1:  # the scheduler passes long runs as arrays: the same result
            arrays = loads_at(clock, stages, by_tokens)
            balance.BULK_RUN, balance.MIN_ROUND = bulk_run, min_round
            try:
                assert (
                    arrays.give_many(np.array(seconds), np.array(tokens, dtype=np.float64)) + arrays.give_many(*then)
                    == ranks
                )
            finally:
                balance.BULK_RUN, balance.MIN_ROUND = old
            assert arrays.clock == clocks and arrays.last_key == keys and arrays.tokens == loads.tokens
        assert loads.top == max(keys)
        assert loads.key.tolist() == keys


def plain_buckets(order, weights, num_buckets):
    total = float(sum(weights[u] for u in order))
    buckets = [[]]
    acc = 0.0
    for u in order:
        if acc >= total * len(buckets) / num_buckets and buckets[-1] and len(buckets) < num_buckets:
            buckets.append([])
        buckets[-1].append(u)
        acc += weights[u]
    return buckets


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 20).map(float), min_size=1, max_size=40), st.integers(1, 10))
def test_buckets_cut_from_the_running_sum_match_the_loop(weights, num_buckets):
    order = sorted(range(len(weights)), key=lambda u: -weights[u])
    assert make_buckets(order, weights, num_buckets) == plain_buckets(order, weights, num_buckets)


def plain_placement(loads, size, per_node):
    """The placement rule written plainly: a ring up to a node goes to the node where it
    starts first (its size-th least-loaded rank is free first), then where its members
    idle least, then the lowest node; a larger ring to the least-loaded ranks. Members:
    least-loaded first, ties to the lower rank, listed by rank."""
    loads = [float(x) for x in loads]
    by_load = lambda ranks: sorted(ranks, key=lambda r: (loads[r], r))[:size]
    if size > per_node:
        return sorted(by_load(range(len(loads))))
    best = None
    for node in range(len(loads) // per_node):
        members = by_load(range(node * per_node, (node + 1) * per_node))
        start = loads[members[-1]]
        idle = size * start - sum(sorted(loads[r] for r in members))
        if best is None or (start, idle) < best[0]:
            best = ((start, idle), sorted(members))
    return best[1]


@settings(max_examples=80, deadline=None)
@given(
    st.sampled_from([(16, 4), (24, 8), (12, 3)]),
    st.lists(
        st.tuples(st.integers(1, 12), st.lists(st.tuples(st.integers(0, 23), coarse | st.just(-0.25)), max_size=5)),
        min_size=1,
        max_size=25,
    ),
)
def test_placement_told_the_changes_matches_placement_that_compares(shape, steps):
    num_ranks, per_node = shape
    told, compares = RingPlacer(num_ranks, per_node), RingPlacer(num_ranks, per_node)
    loads = np.zeros(num_ranks)  # one array, changed in place, as the scheduler's (a load may
    changed: list[int] = []  # fall below 0 here: then a node starting at 0 need not idle 0)
    for size, bumps in steps:
        for r, add in bumps:
            loads[r % num_ranks] += add
            changed.append(r % num_ranks)
        ring = told.place(loads, min(size, num_ranks), 1, changed)
        assert ring.tolist() == compares.place(loads.copy(), min(size, num_ranks)).tolist()
        assert ring.tolist() == plain_placement(loads, min(size, num_ranks), per_node)
        loads[ring] += 1.0
        changed = ring.tolist()


def test_two_level_curves_of_many_lengths_match_one_length_at_a_time():
    cost = small_cost().with_overrides(q_heads=32, kv_heads=8, q_bytes_per_token=4096.0)
    lengths = [3000, 3001, 5000, 12345, 40000]
    many = RingSizer(512, cost, True, 64, 8)
    assert many.two_level == [2, 4, 8]
    many.prepare(lengths)
    for s in lengths:
        sizes, times = many.curve(s)
        assert sizes[-1] > 8  # rings that may span nodes
        # one length alone: the plain ring, and each two-level group size where it applies
        plain = ring_times(cost, s, sizes, 8)
        rows = two_level.share_times(cost, s, sizes, many.two_level, 8)
        best = rows.min(axis=0)
        assert np.array_equal(times, np.minimum(plain, best))
        splits = np.where(best < plain, np.asarray(many.two_level)[rows.argmin(axis=0)], 1)
        assert [many.heads_split(s, int(d)) for d in sizes] == splits.tolist()
    # the first ring within a target, found for all lengths at once, is where size() starts
    for stages in (1, 3):
        sizer = RingSizer(512, cost, True, 64, 8, stages)
        for target in (0.0, 1e-3, 0.05, 0.2, 1.0, 1e9):
            starts = sizer.first_within(lengths, target)
            one_by_one = [sizer.size(s, target) for s in lengths]
            assert [sizer.size(s, target, k) for s, k in zip(lengths, starts)] == one_by_one
            # and the sizes of all lengths at once (most read off the curves): the same
            # rings, ratios (the floor's, 0.0 where every share fits, else offloading) and
            # two-level group sizes
            assert sizer.size_many(lengths, target) == [
                (d, r, sizer.heads_split(s, d)) for s, (d, r, _) in zip(lengths, one_by_one)
            ]


def _prepared_both_ways(cost, num_ranks: int, per_node: int, lengths, offload: bool = True):
    """Two sizers with ``lengths``' curves: one from ``compiled.ring_curves``, one numpy."""
    assert compiled.ring_curves() is not None  # numba is a dependency
    sizers = RingSizer(8192, cost, offload, num_ranks, per_node), RingSizer(8192, cost, offload, num_ranks, per_node)
    sizers[0].prepare(lengths)
    with mock.patch.object(compiled, "ring_curves", lambda: None):
        sizers[1].prepare(lengths)
    return sizers


def _assert_same_curves(got: RingSizer, want: RingSizer, lengths) -> None:
    from megatron_bytescale.planner.sharding import _CurveTable

    for s in lengths:
        for a, b in zip(got._entries(s), want._entries(s), strict=True):
            assert a.dtype == b.dtype and np.array_equal(a, b)
    # a step's lengths prepared at once are one block: the table's view of it equals the
    # table put together length by length
    one_block, by_length = _CurveTable(got, lengths), _CurveTable(want, lengths)
    for name in ("sizes", "times", "splits", "counts", "first", "least"):
        assert np.array_equal(getattr(one_block, name), getattr(by_length, name)), name


MODELS_BY_NODE = {8: ("llama-7b", 1), 2: ("mistral-8x7b", 4), 1: ("llama-70b", 8)}  # HDP ranks per node: model, TP


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from(sorted(MODELS_BY_NODE)),
    st.sampled_from([64, 256, 1024]),
    st.lists(st.integers(8193, 2 << 20), min_size=1, max_size=30, unique=True),
    st.booleans(),
)
def test_compiled_curves_match_the_numpy_curves(per_node, num_ranks, lengths, offload):
    """``compiled.ring_curves`` (``RingSizer.prepare``'s kernel) against the numpy curves
    (``ring_times``, then each two-level group size where it is strictly faster), bit for
    bit: every length's sizes, times and group sizes, and the curve table's view of them."""
    from megatron_bytescale.planner.cost_model import CostModel
    from megatron_bytescale.planner.specs import HardwareSpec, ModelSpec

    model, tp = MODELS_BY_NODE[per_node]
    cost = CostModel.analytic(ModelSpec.load(model), HardwareSpec.load("h100"), tp=tp)
    lengths = sorted(s for s in lengths if s <= 8192 * num_ranks * (4 if offload else 1))
    if lengths:
        _assert_same_curves(*_prepared_both_ways(cost, num_ranks, per_node, lengths, offload), lengths)


def test_compiled_curves_match_where_two_level_groups_win():
    """The same on a GitHub-like batch's long lengths over 1,024 ranks of 8 per node, where
    two-level groups of every size win somewhere on the curves (the kernel's other branch)."""
    from megatron_bytescale.data.workloads import sample_lengths
    from megatron_bytescale.planner.cost_model import CostModel
    from megatron_bytescale.planner.specs import HardwareSpec, ModelSpec

    cost = CostModel.analytic(ModelSpec.load("llama-7b"), HardwareSpec.load("h100"))
    lens = sample_lengths("github", 32 << 20, 2 << 20, np.random.default_rng(0))
    lengths = sorted({int(s) for s in lens if s > 8192})
    compiled_sizer, numpy_sizer = _prepared_both_ways(cost, 1024, 8, lengths)
    _assert_same_curves(compiled_sizer, numpy_sizer, lengths)
    won = np.concatenate([compiled_sizer._entries(s)[2] for s in lengths])
    assert set(np.unique(won).tolist()) == {1, 2, 4, 8}


@settings(max_examples=100, deadline=None)
@given(
    st.lists(coarse, min_size=2, max_size=10),
    st.lists(
        st.tuples(st.integers(1, 8).map(lambda v: v / 8), st.integers(1, 50), st.integers(1, 4)),
        min_size=1,
        max_size=12,
    ),
    st.sampled_from([(1, False), (3, False), (1, True)]),
)
def test_ring_members_given_at_once_match_run_then_push(clock, rings, mode):
    """``run_ring`` is ``run`` + ``push`` per member: same loads and keys; the heap keeps one
    entry per rank, none above its rank's key, so ``least`` finds the least (key, rank) of
    all (a ring over a quarter of the ranks or more rebuilds the heap: every entry exact)."""
    stages, by_tokens = mode
    plain, fast = loads_at(clock, stages, by_tokens), loads_at(clock, stages, by_tokens)
    n = len(clock)
    for seconds, tokens, size in rings:
        ring = sorted(range(n), key=lambda r: (plain.last_key[r], r))[: min(size, n)]
        start = max(plain.clock[r] for r in ring)
        for r in ring:
            plain.run(r, start, seconds, tokens)
            plain.push(r)
        fast.run_ring(ring, start, seconds, tokens)
        for attr in ("clock", "idle", "tokens", "peak", "last_key", "top"):
            assert getattr(fast, attr) == getattr(plain, attr), attr
        for x in (fast, plain):
            assert sorted(r for _, r in x.heap) == list(range(n))
            assert all(k <= x.last_key[r] for k, r in x.heap)
            assert all(x.heap[(i - 1) // 2] <= x.heap[i] for i in range(1, n))  # a heap
        if len(ring) * balance.REBUILD_SHARE >= n:
            assert sorted(fast.heap) == sorted(zip(fast.last_key, range(n)))
        least = min(range(n), key=lambda r: (plain.last_key[r], r))
        assert fast.key.tolist() == plain.key.tolist() and fast.least() == plain.least() == least


def test_plan_step_leaves_the_garbage_collector_as_it_found_it():
    """Planning pauses the collector and moves what it made to the oldest generation (no
    walk of the young one on return); it must leave the collector on, nothing frozen, and
    leave it off (untouched) when the caller had turned it off or frozen objects."""
    import gc

    from megatron_bytescale.planner.planner import PlannerConfig, plan_step

    lengths = [300, 5000, 70, 1200, 40, 2500]
    config = PlannerConfig(num_ranks=4, capacity=1024, balance="dp")
    assert gc.isenabled()
    plan = plan_step(lengths, config, small_cost())
    assert gc.isenabled() and gc.get_freeze_count() == 0
    plan.validate()
    gc.disable()
    try:
        plan_step(lengths, config, small_cost())
        assert not gc.isenabled()
    finally:
        gc.enable()
    frozen = [object() for _ in range(3)]
    gc.freeze()
    try:
        before = gc.get_freeze_count()
        plan_step(lengths, config, small_cost())
        # untouched: an unfreeze would drop the count to 0, a freeze raise it (threads left by
        # earlier tests of the session may free frozen objects meanwhile: it may fall a little)
        assert 0 < gc.get_freeze_count() <= before and gc.isenabled()
    finally:
        gc.unfreeze()
    del frozen


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 40), st.integers(0, 30)), min_size=1, max_size=8),
    st.integers(1, 9),
    st.integers(0, 20),
)
def test_multiples_of_a_group_size_match_the_modulo_mask(runs, u, above):
    from megatron_bytescale.planner.sharding import _multiples, _ragged

    todo = [(1000 + i, (lo, lo + extra)) for i, (lo, extra) in enumerate(runs)]
    _, sizes, counts = _ragged(todo)
    expected = np.flatnonzero((sizes % u == 0) & (sizes > above))
    assert _multiples(todo, counts, u, above).tolist() == expected.tolist()


def plain_balanced_target(lens, sizer):
    """``balanced_target`` written plainly: per length its curve, running minimum and rank-
    seconds, the tests of T summed one length at a time, the same bisection."""
    cost, cap, p, n_ranks = sizer.cost, sizer.capacity, sizer.stages, sizer.num_ranks
    l = cost.num_layers
    short = lens[lens <= cap].astype(np.float64)
    short_times = l * (cost.a1 * short * short + cost.b1 * short + cost.g * short / cap)
    work = float(short_times.sum())
    short_times = np.sort(p * short_times)
    floor = float(short_times[-1]) if short.size else 0.0
    long_lens, counts = np.unique(lens[lens > cap], return_counts=True)
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


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(1, 512), max_size=30),
    st.lists(st.integers(513, 4000), max_size=12),
    st.sampled_from([(16, 4, 1), (64, 8, 1), (32, 8, 3), (8, 8, 2)]),
)
def test_balanced_target_of_all_lengths_at_once_matches_one_length_at_a_time(short, long, shape):
    from megatron_bytescale.planner.sharding import balanced_target

    num_ranks, per_node, stages = shape
    lens = np.array((short + long + long[:3]) or [100])  # repeated lengths: counts > 1
    cost = small_cost().with_overrides(q_heads=32, kv_heads=8, q_bytes_per_token=4096.0)
    sizer = RingSizer(512, cost, True, num_ranks, per_node, stages)
    got = balanced_target(lens, sizer)
    assert got == plain_balanced_target(lens, RingSizer(512, cost, True, num_ranks, per_node, stages))


def test_curves_prepared_at_once_match_each_length_alone():
    """Ring-size ranges found for all lengths at once are ``_size_range`` / ``_two_level_hi``
    per length, and the in-place two-level times are ``two_level.share_times``'."""
    cost = small_cost().with_overrides(q_heads=32, kv_heads=8, q_bytes_per_token=4096.0)
    free_hops = small_cost().with_overrides(kv_bytes_per_token=0.0, grad_bytes_per_token=0.0)  # x beyond int64
    for num_ranks, per_node, c in ((64, 8, cost), (8, 8, cost), (24, 4, cost), (256, 8, cost), (64, 8, free_hops)):
        lengths = [s for s in (513, 700, 3000, 3001, 5000, 12345, 40000, 90001) if s <= 400 * num_ranks]
        sizer = RingSizer(512, c, True, num_ranks, per_node)
        sizer.prepare(lengths)
        for s in lengths:
            sizes = sizer.curve(s)[0]
            lo, hi = sizer._size_range(s)
            if sizer.two_level and hi > sizer.ranks_per_node:
                hi = sizer._two_level_hi(s, lo)
            assert (int(sizes[0]), int(sizes[-1])) == (lo, hi)
    rng = np.random.default_rng(0)
    for u in two_level.valid_splits(cost, 8):
        d = (rng.integers(8 // u + 1, 400, 5000) * u).astype(np.int64)  # multiples of u past a node
        s = rng.integers(600, 10**6, d.size)
        expected = two_level.share_times(cost, s, d, u, 8)
        assert np.array_equal(
            two_level.valid_share_times(cost, s.astype(np.float64), d.astype(np.float64), u), expected
        )
        # the planner's long units time all their two-level rings at once: each one alone
        # (``share_time``) is the same float
        alone = [two_level.share_time(cost, int(a), int(b), u, 8) for a, b in zip(s[:200], d[:200])]
        assert two_level.share_times(cost, s[:200], d[:200], u, 8).tolist() == alone


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(1, 40), max_size=30), st.integers(40, 64))
def test_best_fit_packing_inlined_matches_the_best_fit_class(sizes, capacity):
    from megatron_bytescale.planner.sharding import BestFit, pack_best_fit

    items = [(100 + i, s) for i, s in enumerate(sizes)]
    packer = BestFit(capacity)
    for item, size in sorted(items, key=lambda x: (-x[1], x[0])):
        packer.add(item, size)
    assert pack_best_fit(items, capacity) == packer.bins


def plain_group_placement(loads, size, group, per_node):
    """Two-level placement written plainly: each node's ranks least-loaded first (ties to the
    lower rank) cut into groups of ``group``; the size / group groups whose busiest member is
    least loaded (ties to the lower node, then group), by node; each group's ranks by rank."""
    loads = [float(x) for x in loads]
    groups = []
    for node in range(len(loads) // per_node):
        ranks = sorted(range(node * per_node, (node + 1) * per_node), key=lambda r: (loads[r], r))
        for g in range(per_node // group):
            members = ranks[g * group : (g + 1) * group]
            groups.append((loads[members[-1]], node, g, sorted(members)))
    chosen = sorted(sorted(groups, key=lambda x: x[:3])[: size // group], key=lambda x: x[1:3])
    return [r for *_, members in chosen for r in members]


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.sampled_from([0.0, 0.0, 0.0, 0.25, 0.5, 1.0]), min_size=32, max_size=32),
    st.sampled_from([2, 4, 8]),
    st.integers(2, 4),
)
def test_placement_in_groups_matches_the_plain_rule(loads, group, nodes_worth):
    """Groups at the least load taken directly (rings placed early) or by the full sort: both
    are the plain rule."""
    loads = np.array(loads)
    size = nodes_worth * 8 // group * group  # a multiple of the group, more than a node
    ring = RingPlacer(32, 8).place(loads, size, group)
    assert ring.tolist() == plain_group_placement(loads, size, group, 8)


@settings(max_examples=60, deadline=None)
@given(st.data(), st.sampled_from([2, 4, 8]))
def test_placement_in_groups_keeps_to_the_plain_rule_as_loads_change(data, group):
    """One placer over a run of calls on one loads array changed in place between them (as
    the scheduler does, telling it which ranks changed): the node order it keeps between calls
    gives the plain rule every time."""
    values = st.sampled_from([0.0, 0.25, 0.5, 1.0, 1.5])
    loads = np.array(data.draw(st.lists(values, min_size=32, max_size=32)))
    placer = RingPlacer(32, 8)
    for _ in range(data.draw(st.integers(1, 6))):
        size = data.draw(st.integers(2, 4)) * 8 // group * group
        changed = data.draw(st.lists(st.integers(0, 31), max_size=12))
        for r in changed:
            loads[r] = data.draw(values)
        ring = placer.place_ranks(loads, size, group, changed)
        assert list(ring) == plain_group_placement(loads, size, group, 8)


@contextmanager
def python_pp_balance():
    """``schedule``'s PP balance in Python (what runs where numba is missing), not compiled."""
    with mock.patch.object(compiled, "schedule", lambda: None):
        yield


def plain_pp_schedule(units, placer, slack, stages, num_buckets=balance.DEFAULT_BUCKETS):
    """PP-balance written plainly: per single-rank unit ``least``, ``run`` and ``push``, the
    run going on while the key after the next unit stays within the level."""
    weights = [u.time for u in units]
    order = sorted(range(len(units)), key=lambda u: (-weights[u], units[u].seq_ids[0]))
    loads = _Loads(placer.num_ranks, stages, False)
    runs = [[] for _ in range(placer.num_ranks)]
    bubble = stages - 1
    water = (1 + slack) * sum(weights) / placer.num_ranks

    def give(u, r):
        loads.run(r, loads.clock[r], units[u].time, units[u].tokens)
        runs[r].append(u)
        loads.push(r)

    for bucket in make_buckets(order, weights, num_buckets):
        i = 0
        while i < len(bucket):
            u = bucket[i]
            i += 1
            if units[u].ring_size > 1:
                key, changed = loads.key_changes()
                ring = placer.place_ranks(key, units[u].ring_size, units[u].heads_split, changed)
                loads.run_ring(ring, max(loads.clock[r] for r in ring), units[u].time, units[u].tokens)
                for r in ring:
                    runs[r].append(u)
                continue
            rank = loads.least()
            give(u, rank)
            level = max(water, loads.top)
            while i < len(bucket) and units[bucket[i]].ring_size == 1:
                w = weights[bucket[i]]
                if loads.clock[rank] + w + bubble * max(loads.peak[rank], w) > level:
                    break
                give(bucket[i], rank)
                i += 1
    return runs, loads.clock, loads.last_key


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 16).map(lambda v: v / 8), st.sampled_from([1, 1, 1, 2, 3])), min_size=1, max_size=60
    ),
    st.sampled_from([1, 2, 4]),
    st.sampled_from([0.0, 0.05, 0.3]),
    st.booleans(),
)
def test_pp_runs_given_in_one_loop_match_least_run_push(specs, stages, slack, in_python):
    """The PP balance, compiled and in Python, is the plain rule."""
    from megatron_bytescale.planner.balance import Unit, schedule

    units = [Unit("ring" if n > 1 else "short", (i,), n, t, 10) for i, (t, n) in enumerate(specs)]
    if in_python:
        with python_pp_balance():
            got = schedule(units, RingPlacer(8, 4), "pp", slack, stages)
    else:
        got = schedule(units, RingPlacer(8, 4), "pp", slack, stages)
    runs, clock, keys = plain_pp_schedule(units, RingPlacer(8, 4), slack, stages)
    assert got.runs == runs and got.clock.tolist() == clock and got.key.tolist() == keys


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 12).map(lambda v: v / 4), st.sampled_from([1] * 8 + [2, 3])), min_size=1, max_size=120
    ),
    st.sampled_from([1, 2, 4]),
    st.sampled_from([0.0, 0.05, 0.3]),
    st.sampled_from([(1, 1), (4, 2), (1, 8), (16, 4)]),
)
def test_pp_runs_of_one_unit_given_in_rounds_match_least_run_push(specs, stages, slack, bulk):
    """Long stretches of single-rank units go out in rounds of numpy work (``give_runs_in_rounds``,
    here from stretches of ``bulk[0]`` units on, while rounds place ``bulk[1]``): the same runs,
    clocks and keys as one unit at a time (coarse times: equal keys, which end a round, are common)."""
    from megatron_bytescale.planner.balance import Unit, schedule

    units = [Unit("ring" if n > 1 else "short", (i,), n, t, 10) for i, (t, n) in enumerate(specs)]
    runs, clock, keys = plain_pp_schedule(units, RingPlacer(8, 4), slack, stages)
    old = balance.BULK_RUN, balance.MIN_ROUND
    balance.BULK_RUN, balance.MIN_ROUND = bulk
    try:
        with python_pp_balance():  # the rounds are the Python version's
            got = schedule(units, RingPlacer(8, 4), "pp", slack, stages)
    finally:
        balance.BULK_RUN, balance.MIN_ROUND = old
    assert got.runs == runs and got.clock.tolist() == clock and got.key.tolist() == keys


def test_pp_rounds_take_most_of_a_long_stretch_of_short_units():
    """On a step's tail of short units (sorted, longest first) the rounds do place units (here
    about 30%: early in each bucket ranks below the level take runs of several units, which
    the loop gives); the schedule is the plain one."""
    from megatron_bytescale.planner.balance import Unit, schedule

    rng = np.random.default_rng(0)
    times = np.sort(rng.uniform(0.1, 1.0, 24_000))[::-1]  # 8 buckets of ~3,000, over the ranks
    units = [Unit("short", (i,), 1, float(t), 10) for i, t in enumerate(times)]
    placer = RingPlacer(1024, 8)
    given = []
    original = balance._Loads.give_runs_in_rounds

    def counted(self, bucket, i, *rest):
        j = original(self, bucket, i, *rest)
        given.append(j - i)
        return j

    balance._Loads.give_runs_in_rounds = counted
    try:
        with python_pp_balance():
            got = schedule(units, placer, "pp", 0.05, 4)
    finally:
        balance._Loads.give_runs_in_rounds = original
    runs, clock, keys = plain_pp_schedule(units, RingPlacer(1024, 8), 0.05, 4)
    assert got.runs == runs and got.clock.tolist() == clock and got.key.tolist() == keys
    assert sum(given) >= len(units) // 5


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 30), max_size=12), st.lists(st.integers(1, 40), max_size=30))
def test_ring_spare_filling_inlined_matches_the_best_fit_class(spare, sizes):
    from megatron_bytescale.planner.sharding import BestFit, fill_ring_spare

    items = [(100 + i, s) for i, s in enumerate(sizes)]
    packer = BestFit(max(spare, default=0))
    for free in spare:
        packer.open_bin(free)
    left = [(i, s) for i, s in sorted(items, key=lambda x: (-x[1], x[0])) if packer.try_add(i, s) is None]
    assert fill_ring_spare(spare, items) == (packer.bins, left)


def test_ring_sizes_without_offload_checks_where_shares_fit_match_ratio_for_ranks():
    """``RingSizer.size`` skips ``ratio_for_ranks`` where every share fits the capacity (it
    gives 0 there); the sizes, ratios and times are those of the check at every ring size."""
    from megatron_bytescale.planner.offload_policy import ratio_for_ranks

    cost = small_cost(bw_offload=2e5).with_overrides(q_heads=32, kv_heads=8, q_bytes_per_token=4096.0)
    for host in (None, 300):
        sizer = RingSizer(512, cost, True, 64, 8, 1, host)
        for s in (513, 900, 1500, 3001, 7000, 20000):
            sizes, times = sizer.curve(s)
            for target in (0.0, float(times.min()), float(np.median(times)), 1e9):
                fits = np.flatnonzero(times <= target)
                k = int(fits[0]) if fits.size else int(np.flatnonzero(times <= times.min() * (1 + 1e-3))[0])
                expected = None
                for j in range(k, len(sizes)):
                    r = sizer.floor(s).ratio if j == 0 else ratio_for_ranks(s, int(sizes[j]), 512, cost, host)
                    if r is not None:
                        expected = (int(sizes[j]), r, float(times[j]))
                        break
                assert sizer.size(s, target) == expected


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 16).map(lambda v: v / 8), st.sampled_from([1, 1, 1, 2, 3])), min_size=1, max_size=60
    ),
    st.sampled_from([1, 2, 4]),
    st.floats(0.0, 1.2),
    st.sampled_from(["pp", "dp", "tokens"]),
)
def test_schedule_gives_up_only_once_its_bound_passes_the_limit(specs, stages, share, mode):
    """``give_up_above`` (PP balance's candidates, the retargets of the other modes): None
    only where the schedule's own bound (``key.max()``) is above the limit, and otherwise the
    very schedule made without it."""
    from megatron_bytescale.planner.balance import Unit, schedule

    units = [Unit("ring" if n > 1 else "short", (i,), n, t, 10 + i % 3) for i, (t, n) in enumerate(specs)]
    plain = schedule(units, RingPlacer(8, 4), mode, 0.05, stages)
    limit = share * float(plain.key.max())
    got = schedule(units, RingPlacer(8, 4), mode, 0.05, stages, give_up_above=limit)
    assert (got is None) == (float(plain.key.max()) > limit)
    if got is not None:
        assert got.runs == plain.runs and got.members == plain.members and got.key.tolist() == plain.key.tolist()
    if share < 1e-9 and len(units) > 1:  # the first unit already passes a limit of 0
        assert got is None


def test_schedule_refuses_the_columns_of_other_units():
    """``schedule`` reads the units' ``UnitColumns`` where the planner passes them: columns
    of another unit count are a caller's bug, refused rather than read past or short."""
    from megatron_bytescale.planner.balance import Unit, UnitColumns, schedule

    units = [Unit("short", (i,), 1, 0.5 + i, 10) for i in range(4)]
    given = schedule(units, RingPlacer(4, 4), "pp", 0.05, 2, columns=UnitColumns.of(units))
    plain = schedule(units, RingPlacer(4, 4), "pp", 0.05, 2)
    assert given.runs == plain.runs and given.key.tolist() == plain.key.tolist()
    with pytest.raises(ValueError, match="columns of 3 units given for 4 units"):
        schedule(units, RingPlacer(4, 4), "pp", 0.05, 2, columns=UnitColumns.of(units[:3]))


@pytest.mark.parametrize("dataset", ["github", "byted"])
@pytest.mark.parametrize("mode", ["dp", "ep"])
def test_retargets_stopped_early_give_the_plan_of_every_target_in_full(dataset, mode):
    """The retargets of DP balance (and EP's): a target's schedule stops once its bound
    passes the best step so far, and the plan is the one made with every target scheduled in
    full. Batches of the simulator's workloads that retarget (4M tokens, 512 GPUs)."""
    from megatron_bytescale.data.workloads import sample_lengths
    from megatron_bytescale.planner import planner
    from megatron_bytescale.planner.cost_model import CostModel
    from megatron_bytescale.planner.specs import HardwareSpec, ModelSpec

    model, tp, ep = ("llama-7b", 1, 1) if mode == "dp" else ("mistral-8x7b", 4, 8)
    cost = CostModel.analytic(ModelSpec.load(model), HardwareSpec.load("h100"), tp=tp)
    config = planner.PlannerConfig(
        num_ranks=512 // tp, capacity=8192, ranks_per_node=8 // tp, balance="dp", expert_parallel=ep
    )
    schedule = planner.schedule
    given_up = []

    def counted(*args, **kwargs):
        got = schedule(*args, **kwargs)
        given_up.append(got is None)
        return got

    def in_full(*args, give_up_above=None, **kwargs):
        return schedule(*args, **kwargs)

    for seed in (0, 1):
        lens = sample_lengths(dataset, 4 << 20, 2 << 20, np.random.default_rng(seed))
        with mock.patch.object(planner, "schedule", counted):
            plan = planner.plan_step(lens, config, cost)
        with mock.patch.object(planner, "schedule", in_full):
            full = planner.plan_step(lens, config, cost)
        assert plan.to_dict() | {"meta": None} == full.to_dict() | {"meta": None}
    assert any(given_up)  # the batches retarget, and some schedules stop early


@pytest.mark.parametrize("mode", ["dp", "ep", "pp"])
def test_targets_sharing_their_units_give_the_plan_of_units_made_afresh(mode):
    """The candidate targets of a step share their long units (``planner._UnitMemo``): the
    plan, its estimates included, equals the plan with every target's units made anew, so no
    unit is changed once made; and the targets did share some (GitHub-like batches that
    retarget, 4M tokens on 512 GPUs, seeds 0-1)."""
    from megatron_bytescale.data.workloads import sample_lengths
    from megatron_bytescale.planner import planner
    from megatron_bytescale.planner.cost_model import CostModel
    from megatron_bytescale.planner.specs import HardwareSpec, ModelSpec

    layouts = {"dp": ("llama-7b", 1, 1, 1), "ep": ("mistral-8x7b", 4, 8, 1), "pp": ("llama-7b", 1, 1, 4)}
    model, tp, ep, pp = layouts[mode]
    cost = CostModel.analytic(ModelSpec.load(model), HardwareSpec.load("h100"), tp=tp, pp=pp)
    config = planner.PlannerConfig(
        num_ranks=512 // (tp * pp),
        capacity=8192,
        ranks_per_node=8 // tp,
        balance="pp" if pp > 1 else "dp",
        pipeline_stages=pp,
        expert_parallel=ep,
    )
    units_of = planner._units
    shared = []

    def counted(*args):
        memo = args[-1]
        before = 0 if memo is None else len(memo.units)
        got, columns = units_of(*args)
        shared.append(sum(1 for u in got if u.kind != "short") - (0 if memo is None else len(memo.units) - before))
        return got, columns

    def afresh(*args):
        return units_of(*args[:-1], None)

    for seed in (0, 1):
        lens = sample_lengths("github", 4 << 20, 2 << 20, np.random.default_rng(seed))
        with mock.patch.object(planner, "_units", counted):
            plan = planner.plan_step(lens, config, cost)
        with mock.patch.object(planner, "_units", afresh):
            fresh = planner.plan_step(lens, config, cost)
        drop = {"plan_time_s": None}
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
    """``planner._units``' columns are ``UnitColumns.of`` its units (dtypes included), and each
    long unit's seconds, computed for all of them at once (``_long_columns``), are what one
    unit timed alone gets: its layers whole on one rank, ``ring_share_time`` of Python ints
    (``max``, not numpy), ``two_level.share_time`` in two-level groups, plus EP's all-to-alls;
    over every target of GitHub-like batches (rings inside and across nodes, two-level groups
    and offloaded sequences on one rank among them), with and without recompute."""
    from megatron_bytescale.data.workloads import sample_lengths
    from megatron_bytescale.planner import planner
    from megatron_bytescale.planner.balance import UnitColumns
    from megatron_bytescale.planner.cost_model import CostModel
    from megatron_bytescale.planner.estimate import ring_share_time
    from megatron_bytescale.planner.expert_slots import ep_all_to_all_time
    from megatron_bytescale.planner.sharding import balanced_target, ring_decisions
    from megatron_bytescale.planner.specs import HardwareSpec, ModelSpec

    cost = CostModel.analytic(ModelSpec.load(model), HardwareSpec.load("h100"), tp=tp)
    if recompute:
        full = recompute == "full"
        cost = cost.with_recompute(recompute, "uniform" if full else None, 1 if full else None)
    rpn = 8 // tp
    config = planner.PlannerConfig(num_ranks=2048 // tp, capacity=8192, ranks_per_node=rpn, expert_parallel=ep)
    lens = planner.check_lengths(sample_lengths("github", 16 << 20, 2 << 20, np.random.default_rng(3)))
    sizer = planner._ring_sizer(config, cost, 1, None)
    base = balanced_target(np.asarray(lens), sizer)
    shorts = planner._short_units(lens, config, cost, rpn)
    memo = planner._UnitMemo()
    seen = {"long": 0, "ring": 0, "across": 0, "two-level": 0}
    for scale in (1.0, 0.5, 0.2, 0.05):
        rings = ring_decisions(lens, sizer, base * scale)
        units, columns = planner._units(lens, rings, config, cost, rpn, shorts, memo)
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
def pp_schedule_cases(draw):
    """Units of coarse times (ties common) over a cluster shape: rings inside a node, over
    several nodes, in two-level groups, on whole EP groups; a limit to give up above, sometimes."""
    from megatron_bytescale.planner.balance import Unit
    from megatron_bytescale.planner.expert_slots import GroupPlacer

    rpn = draw(st.sampled_from([1, 2, 4, 8]))
    n = rpn * draw(st.integers(1, 6))
    ep = draw(st.sampled_from([e for e in (1, 1, 2, 4) if n % e == 0]))
    specs = draw(
        st.lists(
            st.tuples(
                st.integers(1, 12).map(lambda v: v / 4),
                st.one_of(st.just(1), st.just(1), st.integers(1, n)),
                st.sampled_from([1, 1, 2, 4]),
                st.integers(1, 9),
            ),
            min_size=1,
            max_size=80,
        )
    )
    units = [
        Unit("ring" if k > 1 else "short", (i,), k, t, tokens, heads_split=g if k > 1 else 1)
        for i, (t, k, g, tokens) in enumerate(specs)
    ]
    limit = draw(st.one_of(st.just(float("inf")), st.integers(1, 40).map(float)))
    placer = GroupPlacer(n, rpn, ep) if ep > 1 else RingPlacer(n, rpn)
    return units, placer, draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([0.0, 0.05])), limit


@settings(max_examples=400, deadline=None)
@given(pp_schedule_cases(), st.sampled_from(["pp", "dp"]), st.sampled_from([1, compiled.TREE_PICK]))
def test_compiled_balance_matches_its_python_version(case, mode, tree_pick):
    """``compiled.schedule`` against ``schedule``'s Python PP and DP balance, rings placed
    by ``RingPlacer`` or on whole EP groups by ``GroupPlacer``: the same runs, ring members
    (and their order), order of giving, clocks, keys and idle seconds, bit for bit, and the
    same give-up. ``tree_pick`` 1: every ring over several nodes takes its least-loaded ranks
    from the kernel's tournament tree (at these cluster sizes the default takes none)."""
    from megatron_bytescale.planner.balance import schedule

    units, placer, stages, slack, limit = case
    assert compiled.schedule() is not None  # numba is a dependency
    with (
        mock.patch.object(balance, "COMPILED_DP_MIN_UNITS", 0),  # DP compiled at any size
        mock.patch.object(compiled, "TREE_PICK", tree_pick),
    ):
        got = schedule(units, placer, mode, slack, stages, give_up_above=limit)
    with python_pp_balance():
        fresh = copy.deepcopy(placer)  # a placer keeps state between calls
        want = schedule(units, fresh, mode, slack, stages, give_up_above=limit)
    assert (got is None) == (want is None)
    if got is not None:
        assert got.runs == want.runs and got.members == want.members and got.order == want.order
        assert got.clock.tolist() == want.clock.tolist() and got.key.tolist() == want.key.tolist()
        assert got.idle.tolist() == want.idle.tolist() and got.num_buckets == want.num_buckets


@st.composite
def pipelined_batches(draw):
    from megatron_bytescale.planner.planner import PlannerConfig

    from planner_cases import draw_lengths

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


@settings(max_examples=60, deadline=None)
@given(pipelined_batches(), st.sampled_from([1, 2, 4]))
def test_best_schedules_stopped_early_match_every_target_scheduled(case, ordered):
    """The targets ``_pipeline_candidates`` orders for 1F1B: the same targets, bounds and
    schedules as scheduling every target in full and sorting by bound (ties to the earlier
    target), though schedules that cannot be among the best stop early."""
    from megatron_bytescale.planner import planner
    from megatron_bytescale.planner.balance import UnitColumns, schedule

    lens, config = case
    cost = small_cost()
    placer = RingPlacer(config.num_ranks, config.ranks_per_node)
    targets = planner._pipeline_targets(planner.check_lengths(lens), config, cost, placer)
    for *_, units, columns in targets:  # the short units' columns read once, joined to each target's long ones
        whole = UnitColumns.of(units)
        for got, want in zip(columns._columns(), whole._columns(), strict=True):
            assert got.dtype == want.dtype and np.array_equal(got, want)
    full = [
        (float(a.key.max()), planner.PIPELINE_RETARGET[position], a)
        for position, _, _, units, _ in targets
        for a in [schedule(units, placer, "pp", config.slack, config.pipeline_stages)]
    ]
    plain = sorted(full, key=lambda c: c[0])[:ordered]
    old = planner.PIPELINE_ORDERED
    planner.PIPELINE_ORDERED = ordered
    try:
        got = planner._best_schedules(targets, placer, config, config.pipeline_stages)
    finally:
        planner.PIPELINE_ORDERED = old
    assert [(c[0], c[5]) for c in got] == [(k, scale) for k, scale, _ in plain]
    assert [c[4].runs for c in got] == [a.runs for _, _, a in plain]
    assert [c[4].members for c in got] == [a.members for _, _, a in plain]


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 6),
    st.sampled_from([8, 20, 64]),
    st.lists(
        st.tuples(st.sampled_from(["short", "short", "short", "ring", "long", "pack"]), st.integers(1, 64)), max_size=60
    ),
    st.randoms(use_true_random=False),
)
# two bins left with equal room: the next sequence goes to the earlier one
@example(1, 10, [("short", 6), ("short", 6), ("short", 3), ("short", 3), ("ring", 1)], random.Random(0))
def test_compiled_rank_items_match_the_python_walk(num_ranks, capacity, specs, rng):
    """``planner._rank_items`` compiled (``compiled.stretch_packs``) and in Python: the same
    items per rank (ring indices, micro-batches of the same sequences in the same order, the
    same ratios and seconds): stretches of short sequences that fit together or do not (then
    packed best-fit, with tied lengths), one alone, at a rank's start or end or between rings,
    long units and hdp-naive packs, ranks with nothing."""
    from megatron_bytescale.planner import planner
    from megatron_bytescale.planner.balance import Assignment, Unit

    lens, units = [], []
    for kind, size in specs:
        ids = tuple(range(len(lens), len(lens) + (2 if kind == "pack" else 1)))
        tokens = 1 + (size - 1) % capacity if kind in ("short", "pack") else capacity + size
        lens += [tokens] * len(ids)
        ring = min(num_ranks, 1 + size % 3) if kind == "ring" else 1
        units.append(Unit(kind, ids, ring, 1e-3 * size, tokens, 0.25 if kind == "long" else 0.0))
    runs = [[] for _ in range(num_ranks)]
    for u, unit in enumerate(units):
        for r in rng.sample(range(num_ranks), unit.ring_size):
            runs[r].insert(rng.randint(0, len(runs[r])), u)
    assignment = Assignment(runs, {}, np.zeros(num_ranks), np.zeros(num_ranks), np.zeros(num_ranks))
    cost = small_cost()

    def flat(items):
        return [x if isinstance(x, int) else (x.seq_ids, x.ratio, x.time) for x in items]

    fast = planner._rank_items(lens, units, assignment, capacity, cost)
    with mock.patch.object(compiled, "stretch_packs", lambda: None):
        slow = planner._rank_items(lens, units, assignment, capacity, cost)
    assert [flat(r) for r in fast] == [flat(r) for r in slow]
