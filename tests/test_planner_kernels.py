"""The planner's kernels against their rules written plainly (``planner_oracles``), each run
both ways: compiled by numba and as Python (``jit.use``), on random inputs where ties are
common (the tie rules must agree)."""

import random
from unittest import mock

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from megatron_bytescale.planner import jit
from megatron_bytescale.planner.balance import Assignment, Unit, make_buckets, schedule
from megatron_bytescale.planner.contract import PipelineGraph, encode_stage_orders, interleaved_order, longest_paths
from megatron_bytescale.planner.cost_model import CostModel
from megatron_bytescale.planner.order.interleaved import _cut_per_rank, one_pipeline, slot_offsets
from megatron_bytescale.planner.order.items import rank_items
from megatron_bytescale.planner.order.levels import level_placement, order_by_level
from megatron_bytescale.planner.order.runs import LocalBatch, PackSplitter, pack_halves, run_arrays, sequential
from megatron_bytescale.planner.order.walk import PipelineArrays, _shared_rows, graph_ends, operation_ids, walk_ends
from megatron_bytescale.planner.placement import Ranks
from megatron_bytescale.planner.sizing.packing import fill_ring_spare, pack_best_fit
from megatron_bytescale.planner.sizing.rings import RingSizer
from megatron_bytescale.planner.specs import HardwareSpec, ModelSpec

from planner_cases import ring_keys, small_cost
from planner_oracles import (
    BestFit,
    plain_buckets,
    plain_curve,
    plain_level_pick,
    plain_level_placement,
    plain_one_pipeline,
    plain_rank_items,
    plain_schedule,
    plain_slot_offsets,
)

BOTH = pytest.mark.parametrize("mode", ["python", "compiled"])
coarse = st.integers(0, 6).map(lambda v: v / 4)  # equal keys and times: the tie rules must agree


# ------------------------------------------------------------------ the balance scheduler
@st.composite
def schedule_cases(draw):
    """Units of coarse times (ties common) over a cluster shape: rings inside a node, over
    several nodes, in two-level groups, on whole EP groups; a limit to give up above, sometimes."""
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
    return units, Ranks.of(n, rpn, ep), draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([0.0, 0.05])), limit


@BOTH
@settings(max_examples=150, deadline=None)
@given(schedule_cases(), st.sampled_from(["pp", "dp", "tokens"]), st.sampled_from([1, 16]))
def test_the_scheduler_gives_what_the_plain_rule_gives(mode, case, balance, tree_pick):
    """``balance.schedule`` (``balance.kernel.assign``) against the plain rule: the same runs,
    ring members (and their order), order of giving, clocks, keys and idle seconds, bit for
    bit, in every mode; None exactly where the schedule's largest key passes the limit.
    ``tree_pick`` 1: a ring over several nodes takes its least-loaded ranks from the kernel's
    tournament tree (at these cluster sizes the default takes none)."""
    units, ranks, stages, slack, limit = case
    with jit.use(mode), mock.patch("megatron_bytescale.planner.balance.scheduler.TREE_PICK", tree_pick):
        got = schedule(units, ranks, balance, slack, stages, give_up_above=limit)
    runs, members, clock, key, idle, order = plain_schedule(
        units, ranks.num_ranks, ranks.ranks_per_node, balance, slack, stages, ranks.expert_parallel
    )
    assert (got is None) == (max(key) > limit)
    if got is not None:
        assert got.runs == runs and got.members == members and got.order == order
        assert got.clock.tolist() == clock and got.key.tolist() == key and got.idle.tolist() == idle


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 20).map(float), min_size=1, max_size=40), st.integers(1, 10))
def test_buckets_cut_from_the_running_sum_match_the_loop(weights, num_buckets):
    order = sorted(range(len(weights)), key=lambda u: -weights[u])
    assert make_buckets(order, weights, num_buckets) == plain_buckets(order, weights, num_buckets)


def test_the_scheduler_refuses_the_columns_of_other_units():
    """``schedule`` reads the units' ``UnitColumns`` where the planner passes them: columns
    of another unit count are a caller's bug, refused rather than read past or short."""
    from megatron_bytescale.planner.balance import UnitColumns

    units = [Unit("short", (i,), 1, 0.5 + i, 10) for i in range(4)]
    given_columns = schedule(units, Ranks.of(4, 4), "pp", 0.05, 2, columns=UnitColumns.of(units))
    plain = schedule(units, Ranks.of(4, 4), "pp", 0.05, 2)
    assert given_columns.runs == plain.runs and given_columns.key.tolist() == plain.key.tolist()
    with pytest.raises(ValueError, match="columns of 3 units given for 4 units"):
        schedule(units, Ranks.of(4, 4), "pp", 0.05, 2, columns=UnitColumns.of(units[:3]))


# ------------------------------------------------------------------ packing
@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 40), max_size=30), st.integers(40, 64))
def test_best_fit_packing_is_one_item_at_a_time(sizes, capacity):
    items = [(100 + i, s) for i, s in enumerate(sizes)]
    packer = BestFit(capacity)
    for item, size in sorted(items, key=lambda x: (-x[1], x[0])):
        packer.add(item, size)
    assert pack_best_fit(items, capacity) == packer.bins


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 30), max_size=12), st.lists(st.integers(1, 40), max_size=30))
def test_ring_spare_filling_is_one_item_at_a_time(spare, sizes):
    items = [(100 + i, s) for i, s in enumerate(sizes)]
    packer = BestFit(max(spare, default=0))
    for free in spare:
        packer.open_bin(free)
    left = [(i, s) for i, s in sorted(items, key=lambda x: (-x[1], x[0])) if packer.try_add(i, s) is None]
    assert fill_ring_spare(spare, items) == (packer.bins, left)


@BOTH
@settings(max_examples=100, deadline=None)
@given(
    st.integers(1, 6),
    st.sampled_from([8, 20, 64]),
    st.lists(
        st.tuples(st.sampled_from(["short", "short", "short", "ring", "long", "pack"]), st.integers(1, 64)), max_size=60
    ),
    st.randoms(use_true_random=False),
)
# two bins left with equal room: the next sequence goes to the earlier one
@example(
    num_ranks=1,
    capacity=10,
    specs=[("short", 6), ("short", 6), ("short", 3), ("short", 3), ("ring", 1)],
    rng=random.Random(0),
)
def test_rank_items_are_the_plain_walk(mode, num_ranks, capacity, specs, rng):
    """``order.items.rank_items`` (``stretch_packs``) against the plain walk: the same items
    per rank (ring indices, micro-batches of the same sequences in the same order, the same
    ratios and seconds): stretches of short sequences that fit together or do not (then
    packed best-fit, with tied lengths), one alone, at a rank's start or end or between rings,
    long units and hdp-naive packs, ranks with nothing."""
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

    def flat(items):
        return [x if isinstance(x, int) else (x.seq_ids, x.ratio, x.time) for x in items]

    with jit.use(mode):
        got = rank_items(lens, units, assignment, capacity, small_cost())
    want = plain_rank_items(lens, units, assignment, capacity, small_cost())
    assert [flat(r) for r in got] == [flat(r) for r in want]


@BOTH
@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=1, max_size=9))
def test_a_pack_splits_longest_first_into_the_half_with_fewer_tokens(mode, lens):
    """``pack_halves``: the pack's sequences longest first (ties: the lower index), each to the
    half with fewer tokens so far (ties: the first); ``PackSplitter`` times each half as a pack."""
    ids = list(range(len(lens)))[::-1]
    part = np.array(ids, dtype=np.int64)
    with jit.use(mode):
        side = pack_halves(part, np.array(lens, dtype=np.int64))
    order = sorted(ids, key=lambda i: (-lens[i], i))
    halves, tokens = ([], []), [0, 0]
    for i in order:
        k = 0 if tokens[0] <= tokens[1] else 1
        halves[k].append(i)
        tokens[k] += lens[i]
    assert part.tolist() == order
    assert part[~side].tolist() == halves[0] and part[side].tolist() == halves[1]
    cost = small_cost().with_recompute("selective")
    a, b = PackSplitter(lens, cost)(LocalBatch(tuple(ids), 0.5, 1.0))
    for half, got in zip(halves, (a, b)):
        t, p = sum(lens[i] for i in half), sum(lens[i] ** 2 for i in half)
        assert got.seq_ids == tuple(half) and got.ratio == 0.5 and got.time == cost.num_layers * cost.layer_time(t, p)


# ------------------------------------------------------------------ ring curves
MODELS_BY_NODE = {8: ("llama-7b", 1), 2: ("mistral-8x7b", 4), 1: ("llama-70b", 8)}  # HDP ranks per node: model, TP


def _range_end(sizer: RingSizer, seq_len: int, floor: int) -> int:
    """The largest ring size a length's curve covers, as it reads: a few times past where a
    ring turns communication-bound, ``max(group sizes)`` times further where rings may span
    nodes two-level."""
    cost = sizer.cost
    per_token = 2 * cost.kv_bytes_per_token + cost.grad_bytes_per_token
    comm_bound = cost.a1 * seq_len * cost.bw_inter_node / max(per_token, 1e-30)
    rpn = sizer.ranks_per_node
    hi = min(sizer.num_ranks, seq_len, max(floor, int(4 * comm_bound) + 2 * rpn))
    if sizer.two_level and hi > rpn:
        hi = min(sizer.num_ranks, seq_len, max(floor, int(4 * comm_bound * max(sizer.two_level)) + 2 * rpn))
    return hi


def _check_curves(sizer: RingSizer, lengths) -> np.ndarray:
    """Every length's curve: its ring sizes from the memory floor to ``_range_end``, the times
    and two-level group sizes of ``plain_curve``; returns the group sizes, end to end."""
    splits = []
    for s in lengths:
        sizes, times = sizer.curve(s)
        floor = sizer.floor(s).ranks
        assert sizes.tolist() == list(range(floor, _range_end(sizer, s, floor) + 1))
        want_times, want_splits = plain_curve(sizer.cost, s, sizes, sizer.ranks_per_node, sizer.two_level)
        assert times.tolist() == want_times
        assert [sizer.heads_split(s, int(d)) for d in sizes] == want_splits
        splits += want_splits
    return np.array(splits)


@BOTH
@settings(max_examples=25, deadline=None)
@given(
    st.sampled_from(sorted(MODELS_BY_NODE)),
    st.sampled_from([64, 256]),
    st.lists(st.integers(8193, 2 << 20), min_size=1, max_size=8, unique=True),
    st.booleans(),
)
def test_ring_curves_are_the_plain_share_times(mode, per_node, num_ranks, lengths, offload):
    """``sizing.curves.ring_curves`` (``RingSizer.prepare``) against each ring size timed
    alone: the plain ring's ``ring_share_time``, or a two-level group size's
    ``two_level.share_time`` where strictly faster, bit for bit, over the sizes of the range."""
    model, tp = MODELS_BY_NODE[per_node]
    cost = CostModel.analytic(ModelSpec.load(model), HardwareSpec.load("h100"), tp=tp)
    lengths = sorted(s for s in lengths if s <= 8192 * num_ranks * (4 if offload else 1))
    sizer = RingSizer(8192, cost, offload, num_ranks, per_node)
    with jit.use(mode):
        sizer.prepare(lengths)
    _check_curves(sizer, lengths)


def test_ring_curves_take_every_two_level_group_size_somewhere():
    """A GitHub-like batch's long lengths over 1,024 ranks of 8 per node: two-level groups of
    every size win somewhere on the curves (the kernel's other branch), as the plain times say."""
    from megatron_bytescale.data.workloads import sample_lengths

    cost = CostModel.analytic(ModelSpec.load("llama-7b"), HardwareSpec.load("h100"))
    lens = sample_lengths("github", 32 << 20, 2 << 20, np.random.default_rng(0))
    lengths = sorted({int(s) for s in lens if s > 8192})[::6]  # a sample, each curve checked alone
    sizer = RingSizer(8192, cost, True, 1024, 8)
    with jit.use("compiled"):
        sizer.prepare(lengths)
    assert set(np.unique(_check_curves(sizer, lengths)).tolist()) == {1, 2, 4, 8}


def test_ring_sizes_without_offload_checks_where_shares_fit_match_ratio_for_ranks():
    """``RingSizer.size`` skips ``ratio_for_ranks`` where every share fits the capacity (it
    gives 0 there); the sizes, ratios and times are those of the check at every ring size."""
    from megatron_bytescale.planner.sizing.offload import ratio_for_ranks

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


def test_sizes_for_all_lengths_at_once_are_each_length_sized_alone():
    """The first ring within a target, found for all lengths at once, is where ``size``
    starts, and the sizes of all lengths at once (most read off the curves) are each length's
    ``size`` and the curve's group size there."""
    cost = small_cost().with_overrides(q_heads=32, kv_heads=8, q_bytes_per_token=4096.0)
    lengths = [3000, 3001, 5000, 12345, 40000]
    for stages in (1, 3):
        sizer = RingSizer(512, cost, True, 64, 8, stages)
        for target in (0.0, 1e-3, 0.05, 0.2, 1.0, 1e9):
            starts = sizer.first_within(lengths, target)
            one_by_one = [sizer.size(s, target) for s in lengths]
            assert [sizer.size(s, target, k) for s, k in zip(lengths, starts)] == one_by_one
            assert sizer.size_many(lengths, target) == [
                (d, r, sizer.heads_split(s, d)) for s, (d, r, _) in zip(lengths, one_by_one)
            ]


# ------------------------------------------------------------------ the pipeline walk
@BOTH
@settings(max_examples=60, deadline=None)
@given(keys=ring_keys(), stages=st.integers(1, 4), chunks=st.integers(1, 3), data=st.data())
def test_the_walk_gives_the_contracts_longest_paths(mode, keys, stages, chunks, data):
    """``order.walk.graph_ends`` against the contract's walk: the same end of every node, to
    the bit (one sum and one maximum per node either way), barriers included; on a deadlock
    both give None and leave the same nodes waiting."""
    times = [[data.draw(st.floats(0.0, 4.0)) for _ in row] for row in keys]
    graph = PipelineGraph.of_times(keys, times, stages, 0.4, chunks)
    barriers = []
    if chunks == 1 and data.draw(st.booleans()):  # one barrier after some micro-batches of every rank
        barriers = [[data.draw(st.integers(0, len(row))) for row in keys]]
    seqs = graph.sequences(None, barriers)
    succ, indeg = graph.edges(seqs, len(barriers))
    plain = longest_paths(succ, indeg, graph.dur + [0.0] * len(barriers))
    with jit.use(mode):
        end, left = graph_ends(graph, seqs, len(barriers))
    if plain is None:
        assert end is None and left.tolist() == indeg
    else:
        assert end is not None and end.tolist() == plain


def _plain_walk(flat, lens, units, vp, duration):
    """The graph of ``pipeline_ends``' input walked by the contract's ``longest_paths``: each
    resource's consecutive distinct operations, and each micro-batch's chain of virtual stages."""
    nodes = duration.size
    succ, indeg = [[] for _ in range(nodes)], [0] * nodes
    at = 0
    for count in lens.tolist():
        row = flat[at : at + count].tolist()
        at += count
        for a, b in zip(row, row[1:]):
            if a != b:
                succ[a].append(b)
                indeg[b] += 1
    for u in range(units):
        base = u * 2 * vp
        chain = [base + 2 * vs for vs in range(vp)] + [base + 2 * vs + 1 for vs in reversed(range(vp))]
        for a, b in zip(chain, chain[1:]):
            succ[a].append(b)
            indeg[b] += 1
    end = longest_paths(succ, indeg, duration.tolist())
    return end, indeg


@BOTH
@settings(max_examples=100, deadline=None)
@given(st.integers(1, 4), st.integers(1, 3), st.integers(0, 3), st.data())
def test_the_walk_on_any_sequences_gives_the_plain_longest_paths(mode, units, vp, barriers, data):
    """``pipeline_ends`` (a cursor per resource, chains by arithmetic) on any sequences of any
    nodes (repeats, cycles, barrier nodes past the chains, empty resources), 32- and 64-bit
    ids: the plain walk's ends to the bit, or both a cycle with the same in-degrees left.
    Given a limit, the walk stops exactly where some chain operation ends after it: on a graph
    walked to the end, where the latest finish of a micro-batch is after the limit."""
    nodes = 2 * units * vp + barriers
    rows = data.draw(st.lists(st.lists(st.integers(0, nodes - 1), max_size=8), min_size=1, max_size=5))
    flat = np.array([v for row in rows for v in row], dtype=np.int64)
    lens = np.array([len(row) for row in rows], dtype=np.int64)
    duration = np.array(data.draw(st.lists(st.floats(0.0, 5.0), min_size=nodes, max_size=nodes)))
    want, left = _plain_walk(flat, lens, units, vp, duration)
    with jit.use(mode):
        for ids in (flat, flat.astype(np.int32)):
            end, indeg, done = walk_ends(ids, lens, units, vp, duration)
            assert indeg.tolist() == left and (done == nodes) == (want is not None)
            if want is not None:
                assert end.tolist() == want
        limit = data.draw(st.floats(0.0, 30.0))
        _, _, stopped = walk_ends(flat, lens, units, vp, duration, limit)
    if want is not None:
        latest = max((want[u * 2 * vp + 1] for u in range(units)), default=0.0)  # each micro-batch's last op
        assert (stopped == -1) == (latest > limit)
        assert stopped == -1 or stopped == nodes
    elif stopped != -1:  # a deadlock reached before any chain operation ended after the limit
        assert stopped == done


@BOTH
def test_a_bounded_walk_stops_where_a_resources_work_left_passes_the_limit(mode):
    """Micro-batch 0 (forward 0, backward 1) runs on resource 0 around micro-batch 1's backward
    (node 3), which resource 1 holds before its own forward (node 2): a cycle, so neither node 3
    nor node 1 ever ends, and no operation that ends after the limit is reached. Once node 0
    ends (1 s), resource 0 still has 2 + 4 s to run, so its last operation cannot end before
    7 s: given a limit under that, the walk stops there rather than walking on to the
    deadlock; given 7 s, it walks on."""
    flat, lens = np.array([0, 3, 1, 3, 2]), np.array([3, 2])
    duration = np.array([1.0, 4.0, 0.5, 2.0])
    with jit.use(mode):
        assert walk_ends(flat, lens, 2, 1, duration)[2] == 1  # unbounded: node 0 ends, then the cycle
        assert walk_ends(flat, lens, 2, 1, duration, limit=6.9)[2] == -1
        assert walk_ends(flat, lens, 2, 1, duration, limit=7.0)[2] == 1  # 1 + 2 + 4 is not over 7


@BOTH
@settings(max_examples=60, deadline=None)
@given(ring_keys(), st.integers(1, 4), st.integers(1, 3))
def test_operation_ids_are_the_contracts(mode, keys, stages, chunks):
    """``PipelineArrays.sequences`` (``operation_ids``) gives the contract graph's ids of the
    default orders, its units and durations; the finish per rank too."""
    graph = PipelineGraph(keys, stages, chunks)
    plain = [
        [graph.id_of(r, k, op) for op in interleaved_order(len(row), stages, k, chunks)]
        for r, row in enumerate(keys)
        for k in range(stages)
    ]
    assert graph.sequences() == plain
    times = [[float(m + r) for m in range(len(row))] for r, row in enumerate(keys)]
    pipes = PipelineArrays(keys, times, stages, 0.4, chunks)
    with jit.use(mode):
        flat, lens = pipes.sequences()
    assert lens.tolist() == [len(x) for x in plain] and flat.tolist() == [i for x in plain for i in x]
    timed = PipelineGraph.of_times(keys, times, stages, 0.4, chunks)
    assert pipes.unit.tolist() == [u for row in timed.unit_at for u in row] and pipes.dur.tolist() == timed.dur
    end = timed.evaluate(timed.sequences())
    if end is not None:
        assert pipes.finish(np.array(end)) == timed.finish(end)


@BOTH
@settings(max_examples=80, deadline=None)
@given(st.integers(1, 4), st.integers(1, 3), st.integers(1, 4), st.booleans(), st.data())
def test_operation_ids_of_any_rows_are_each_row_read_alone(mode, p, v, n, chunked, data):
    """``operation_ids`` over any devices' rows (empty devices, devices sharing an earlier
    device's array as ``_shared_rows`` gives them, chunk or virtual-stage numbering, ranks of
    any micro-batch counts), 32- and 64-bit: each device's rows read one by one."""
    counts = data.draw(st.lists(st.integers(0, 4), min_size=n, max_size=n))
    units = max(sum(counts), 1)
    unit = np.array(data.draw(st.lists(st.integers(0, units - 1), min_size=sum(counts), max_size=sum(counts))))
    row_start = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)
    per_device = []
    for r in range(n):
        for _ in range(p):
            same = [a for d, a in enumerate(per_device) if counts[d // p] == counts[r]]
            if same and data.draw(st.booleans()):
                per_device.append(data.draw(st.sampled_from(same)))
                continue
            rows = (
                data.draw(st.lists(st.tuples(st.integers(0, 1), st.integers(0, counts[r] - 1), st.integers(0, v - 1))))
                if counts[r]
                else []
            )
            per_device.append(np.array(rows, dtype=np.int64).reshape(-1, 3))
    ops, at, lens = _shared_rows(per_device)
    assert lens.tolist() == [len(a) for a in per_device]
    vp = p * v
    one_by_one = [
        (unit[row_start[d // p] + m] * vp + (c * p + d % p if chunked else c)) * 2 + direction
        for d, a in enumerate(per_device)
        for direction, m, c in a.tolist()
    ]
    with jit.use(mode):
        for dtype in (np.int32, np.int64):
            out = np.empty(int(lens.sum()), dtype=dtype)
            got = operation_ids(ops, at, lens, unit.astype(np.int64), row_start, p, vp, chunked, out)
            assert got is out and got.tolist() == one_by_one


# ------------------------------------------------------------------ interleaved orders
@BOTH
@settings(max_examples=100, deadline=None)
@given(st.one_of(ring_keys(), st.lists(st.lists(st.one_of(st.none(), st.integers(0, 4)), max_size=6), max_size=6)))
def test_slot_offsets_are_the_plain_walk(mode, keys):
    """``slot_offsets`` against the plain walk: the same offsets, or both None (rings whose
    members' index differences disagree, a ring twice on one rank)."""
    with jit.use(mode):
        assert slot_offsets(keys) == plain_slot_offsets(keys)


@BOTH
@settings(max_examples=100, deadline=None)
@given(st.integers(1, 4), st.integers(1, 5), st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), max_size=14))
def test_one_pipeline_is_the_plain_run(mode, stages, chunks, slot_times):
    """``one_pipeline`` runs the plain run's pipeline: the same ops on every device in the same
    order, with tied starts (equal and zero times: a backward first, then the lower device) and
    partial groups (micro-batch counts not a multiple of ``stages``)."""
    fwd = np.array([float(f) for f, _ in slot_times])
    bwd = np.array([float(b) for _, b in slot_times])
    with jit.use(mode):
        ops, ran = one_pipeline(fwd, bwd, stages, chunks)
    plain = plain_one_pipeline(fwd.tolist(), bwd.tolist(), stages, chunks)
    assert [[tuple(row) for row in ops[d, : ran[d]].tolist()] for d in range(stages)] == [
        [tuple(op) for op in order] for order in plain
    ]


@settings(max_examples=40, deadline=None)
@given(ring_keys(), st.integers(1, 4), st.integers(1, 3))
def test_cut_per_rank_matches_cutting_each_rank_alone(keys, stages, chunks):
    off = slot_offsets(keys)
    if off is None:
        return
    slots = max(o + len(k) for o, k in zip(off, keys))
    full = plain_one_pipeline([1.0] * slots, [2.0] * slots, stages, chunks)
    plain = [
        [[(d, m - o, c) for d, m, c in full[dev] if o <= m < o + len(row)] for dev in range(stages)]
        for o, row in zip(off, keys)
    ]
    cut = _cut_per_rank(full, off, keys, stages)
    assert [[[tuple(op) for op in order] for order in rank] for rank in cut] == plain
    if len(cut) > 1:  # every rank owns its lists: callers may edit one rank's orders
        assert all(a is not b for a in cut[0] for b in cut[1])
    # the arrays behind them give the plan's codes and the graph's operation ids as the lists do
    assert cut.codes(chunks) == encode_stage_orders(plain, chunks)
    graph = PipelineGraph(keys, stages, chunks)
    flat, lens = PipelineArrays(keys, [[1.0] * len(row) for row in keys], stages, 0.4, chunks).sequences(cut)
    seqs = graph.sequences(plain)
    assert lens.tolist() == [len(x) for x in seqs] and flat.tolist() == [i for x in seqs for i in x]


# ------------------------------------------------------------------ the level order
@BOTH
@settings(max_examples=100, deadline=None)
@given(st.data(), st.sampled_from([1, 2, 4, 8]))
def test_level_placement_is_the_plain_level_picks(mode, data, rpn):
    """``level_placement`` against rings placed one by one at levels as the rule reads: the
    same members for every ring, and the same stop where a ring fits no level, with loads and
    seconds that tie often."""
    n = rpn * data.draw(st.integers(1, 6))
    load = np.array(data.draw(st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.5, 0.1]), min_size=n, max_size=n)))
    sizes = np.array(sorted(data.draw(st.lists(st.integers(1, n), min_size=1, max_size=12)), reverse=True))
    times = np.array(data.draw(st.lists(st.sampled_from([0.3, 1.0, 1.5]), min_size=sizes.size, max_size=sizes.size)))
    with jit.use(mode):
        got, placed = level_placement(load, sizes, times, rpn)
    want, want_placed = plain_level_placement(load, sizes, times, rpn)
    assert placed == want_placed and got[: sizes[:placed].sum()].tolist() == want


@BOTH
def test_a_higher_level_that_starts_a_ring_as_early_wins_on_less_idle(mode):
    """One rank per node: the second ring starts at 1.0 on level 0 (ranks 0 and 3, one idle
    0.5 s) and on level 1 (ranks 1 and 2, none idle), so level 1 takes it."""
    load, sizes, times = np.array([0.5, 0.0, 0.0, 1.0]), np.array([2, 2]), np.array([1.0, 1.0])
    with jit.use(mode):
        got, placed = level_placement(load, sizes, times, 1)
    assert placed == 2 and got.tolist() == [1, 2, 1, 2] == plain_level_placement(load, sizes, times, 1)[0]


def test_a_level_pick_takes_tied_part_nodes_from_the_lowest_rank():
    """The rule (the kernels are checked against it above): a ring of 9 on nodes of 8, node 2
    whole at level 0, then one of two part-nodes tied in size and load: node 0's rank 1 comes
    before node 1's rank 8."""
    level = np.ones(24, dtype=np.int64)
    level[[1, 8]] = 0
    level[16:] = 0
    assert plain_level_pick(np.zeros(24), level, 9, 8).tolist() == [1, *range(16, 24)]


@BOTH
@settings(max_examples=40, deadline=None)
@given(st.data(), st.sampled_from([1, 2, 4]))
def test_rings_placed_again_by_level_run_at_one_level_and_keep_the_plain_clocks(mode, data, rpn):
    """Every ring placed again by level meets each member after the same number of rings; the
    ranks' clocks (``ring_clocks``, then the local work) are ``sequential``'s to the bit."""
    n = rpn * data.draw(st.integers(1, 4))
    seconds = st.sampled_from([0.1, 0.5, 1.0])
    runs = [
        [LocalBatch((r, m), 0.0, data.draw(seconds)) for m in range(data.draw(st.integers(0, 3)))] for r in range(n)
    ]
    members = {u: tuple(data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=n, unique=True)))
               for u in range(data.draw(st.integers(0, 6)))}  # fmt: skip
    ring_time = {u: data.draw(st.sampled_from([0.5, 1.0, 2.0])) for u in members}
    with jit.use(mode):
        again = order_by_level(runs, list(members), members, ring_time, rpn, run_arrays(runs))
    if again is None:
        return
    order = sorted(members, key=lambda u: -len(members[u]))
    plain = sequential(again.runs, order, again.members, ring_time)
    assert plain.runs == again.runs and plain.clock == again.clock
    for u, ring in again.members.items():
        assert len(ring) == len(members[u])
        assert len({[x for x in again.runs[r] if isinstance(x, int)].index(u) for r in ring}) == 1


# ------------------------------------------------------------------ the helper itself
@jit.kernel(size=lambda x: x.size, small=4)
def _total(x):
    s = 0.0
    for v in x:
        s += v
    return s


def test_a_kernel_runs_as_python_on_small_inputs_and_compiled_on_large_ones(monkeypatch):
    """``jit.kernel``: below its ``small`` size the function runs as Python (no compile), from
    it compiled, and once compiled for some argument types small calls of those types run
    compiled too; ``BYTESCALE_JIT``'s modes (``jit.use``) override the size either way."""
    compiled, as_python = [], []
    real, plain = _total.compiled, _total.function

    def spy(args):
        compiled.append(len(args[0]))
        return real(args)

    def python_spy(x):
        as_python.append(len(x))
        return plain(x)

    monkeypatch.setattr(_total, "compiled", spy)
    with jit.use("auto"):
        assert _total(np.ones(3)) == 3.0 and compiled == []
        assert _total(np.ones(5)) == 5.0 and compiled == [5]
    monkeypatch.setattr(_total, "function", python_spy)  # Python runs counted (the compiled code is made)
    with jit.use("auto"):
        assert _total(np.ones(3)) == 3.0 and compiled == [5] and as_python == []  # compiled already
        assert _total(np.ones(3, np.float32)) == 3.0 and compiled == [5] and as_python == [3]  # other types
    with jit.use("python"):
        assert _total(np.ones(50)) == 50.0 and compiled == [5] and as_python == [3, 50]
    with jit.use("compiled"):
        assert _total(np.ones(1, np.float32)) == 1.0 and compiled == [5, 1] and as_python == [3, 50]
    with pytest.raises(ValueError, match="jit mode"), jit.use("fast"):
        pass


def test_a_kernel_compiles_where_no_cache_directory_is_writable(monkeypatch):
    """numba refuses ``cache=True`` when it finds no writable cache directory (a read-only
    install, no home): the kernel is then compiled without a cache (and without the lock)."""
    import numba
    import numba.core.caching as caching

    from megatron_bytescale.planner.order.walk import pipeline_ends

    monkeypatch.setattr(caching.CacheImpl, "_locator_classes", [])
    with pytest.raises(RuntimeError, match="no locator"):  # what the fallback is for
        caching.FunctionCache(pipeline_ends.function)
    dispatcher = jit._dispatcher(numba, pipeline_ends.function)
    assert jit._cache_path(dispatcher) is None
    wait, end = np.empty((3, 2), dtype=np.int32), np.empty(3)
    args = (
        np.array([0, 1, 2]),
        np.array([3]),
        0,
        1,
        np.array([1.0, 2.0, 0.5]),
        np.inf,
        wait,
        end,
        np.empty(3, np.int32),
    )
    jit._compile(dispatcher, tuple(numba.typeof(a) for a in args), pipeline_ends.function)
    assert dispatcher(*args) == 3 and end.tolist() == [1.0, 3.0, 3.5] and wait[:, 0].tolist() == [0, 0, 0]


def test_the_compile_notice_is_one_line_of_its_own_above_a_progress_bar(capsys, monkeypatch):
    """The first compile says so once per process, on its own line: the simulator's progress bar
    redraws below it rather than over it."""
    import sys

    from tqdm import tqdm

    from megatron_bytescale.planner import jit

    monkeypatch.setattr(jit, "_told", [False])
    with tqdm(total=2, file=sys.stderr, desc="step 1/1 hdp-balanced") as bar:
        bar.update(1)
        jit._announce()
        jit._announce(waiting=True)  # once per process: not again
    lines = capsys.readouterr().err.replace("\r", "\n").split("\n")
    notices = [line for line in lines if "planner's kernels" in line]
    assert len(notices) == 1 and notices[0].startswith("bytescale: compiling the planner's kernels"), lines
