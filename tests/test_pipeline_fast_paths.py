"""The pipeline graph's and the slot alignment's fast paths give what their plain versions
give: operation sequences mapped from cached per-count patterns, micro-batch edges unrolled
instead of asked of ``next_op`` per operation, the longest paths in compiled code or level by
level with numpy (``pipeline_times``) instead of node by node in Python, each rank's cut of one long pipeline shared by
ranks with the same slots, a rank's view after a ring derived from its view before instead of
from its queue, a wide ring's shortfall from per-rank counts instead of its members' views,
rings placed again by level for all nodes at once instead of node by node, and in compiled
code rank by rank."""

from contextlib import nullcontext
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_bytescale.planner import compiled, compiled_alignment, slot_alignment
from megatron_bytescale.planner.contract import PipelineGraph, encode_stage_orders, interleaved_order, longest_paths
from megatron_bytescale.planner.contract import pipelined_finish_times as walked_finish_times
from megatron_bytescale.planner.pipeline_times import (
    ArrayOrders,
    Longer,
    PipelineArrays,
    _first_of_unit,
    _operation_ids,
    _shared_rows,
    edge_arrays,
    graph_ends,
    longest_path_ends_by_level,
    walk_ends,
)
from megatron_bytescale.planner.slot_alignment import (
    LocalBatch,
    Ordered,
    PackSplitter,
    _cut_per_rank,
    _level_pick,
    _place_by_level,
    _RankView,
    _run_one_pipeline,
    item_arrays,
    order_runs,
    run_arrays,
    slot_offsets,
)

from planner_cases import small_cost


@st.composite
def ring_keys(draw):
    """Per rank, its micro-batches' keys: rings (shared ints, in one order on every member) or None."""
    n = draw(st.integers(2, 6))
    rings = draw(st.lists(st.lists(st.integers(0, n - 1), min_size=2, max_size=n, unique=True), max_size=5))
    keys = [[] for _ in range(n)]
    for u, members in enumerate(rings):
        for r in members:
            keys[r] += [None] * draw(st.integers(0, 2)) + [u]
    for r in range(n):
        keys[r] += [None] * draw(st.integers(0 if keys[r] else 1, 3))
    return keys


@settings(max_examples=80, deadline=None)
@given(ring_keys(), st.integers(1, 4), st.integers(1, 3))
def test_default_sequences_match_the_ids_of_the_default_orders(keys, stages, chunks):
    graph = PipelineGraph(keys, stages, chunks)
    plain = [
        [graph.id_of(r, k, op) for op in interleaved_order(len(row), stages, k, chunks)]
        for r, row in enumerate(keys)
        for k in range(stages)
    ]
    assert graph.sequences() == plain
    assert graph.sequences(graph.default_orders()) == plain  # explicit orders, no barriers
    times = [[float(m + r) for m in range(len(row))] for r, row in enumerate(keys)]
    pipes = PipelineArrays(keys, times, stages, 0.4, chunks)  # the same ids, over all ranks at once
    flat, lens = pipes.sequences()
    assert lens.tolist() == [len(x) for x in plain] and flat.tolist() == [i for x in plain for i in x]
    timed = PipelineGraph.of_times(keys, times, stages, 0.4, chunks)  # the same units and durations
    assert pipes.unit.tolist() == [u for row in timed.unit_at for u in row] and pipes.dur.tolist() == timed.dur
    end = timed.evaluate(timed.sequences())
    if end is not None:
        assert pipes.finish(np.array(end)) == timed.finish(end)


@settings(max_examples=80, deadline=None)
@given(ring_keys(), st.integers(1, 4), st.integers(1, 3))
def test_unrolled_micro_batch_edges_match_next_op(keys, stages, chunks):
    graph = PipelineGraph(keys, stages, chunks)
    seqs = graph.sequences()
    succ, indeg = graph.edges(seqs)
    plain_succ = [[] for _ in range(graph.total)]
    plain_indeg = [0] * graph.total
    for seq in seqs:
        for a, b in zip(seq, seq[1:]):
            if a != b:
                plain_succ[a].append(b)
                plain_indeg[b] += 1
    for op in range(graph.total):
        nxt = graph.next_op(op)
        if nxt is not None:
            plain_succ[op].append(nxt)
            plain_indeg[nxt] += 1
    assert [sorted(s) for s in succ] == [sorted(s) for s in plain_succ]
    assert indeg == plain_indeg


@pytest.mark.parametrize("walk", ["compiled", "by_level"])
@settings(max_examples=100, deadline=None)
@given(keys=ring_keys(), stages=st.integers(1, 4), chunks=st.integers(1, 3), data=st.data())
def test_numpy_longest_paths_match_the_contracts_walk(walk, keys, stages, chunks, data):
    """The same end of every node, to the bit (one sum and one maximum per node either way),
    barriers included; on a deadlock both give None and leave the same nodes waiting. Both
    walks of ``graph_ends``: the compiled kernel and the numpy levels (numba missing)."""
    with mock.patch.object(compiled, "pipeline_ends", lambda: None) if walk == "by_level" else nullcontext():
        _check_longest_paths(keys, stages, chunks, data)


def _check_longest_paths(keys, stages, chunks, data):
    times = [[data.draw(st.floats(0.0, 4.0)) for _ in row] for row in keys]
    graph = PipelineGraph.of_times(keys, times, stages, 0.4, chunks)
    barriers = []
    if chunks == 1 and data.draw(st.booleans()):  # one barrier after some micro-batches of every rank
        barriers = [[data.draw(st.integers(0, len(row))) for row in keys]]
    seqs = graph.sequences(None, barriers)
    succ, indeg = graph.edges(seqs, len(barriers))
    plain = longest_paths(succ, indeg, graph.dur + [0.0] * len(barriers))
    end, left = graph_ends(graph, seqs, len(barriers))
    if plain is None:
        assert end is None
        assert left.tolist() == indeg
    else:
        assert end is not None and end.tolist() == plain


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 40), st.data())
def test_compiled_longest_paths_match_the_levels_on_any_graph(nodes, data):
    """Any graph (several edges between two nodes, fan-in and fan-out of a ring's operation,
    cycles), each edge given to the kernel as a resource of two operations and no chains:
    the kernel's ends are the levels' to the bit, or both None with the same in-degrees left."""
    pairs = data.draw(st.lists(st.tuples(st.integers(0, nodes - 1), st.integers(0, nodes - 1)), max_size=4 * nodes))
    pairs = [(a, b) for a, b in pairs if a != b]  # two equal ids in a row are no edge
    if not data.draw(st.booleans()):  # mostly acyclic: edges only forward
        pairs = [(a, b) if a < b else (b, a) for a, b in pairs]
    src = np.array([a for a, _ in pairs], dtype=np.int64)
    dst = np.array([b for _, b in pairs], dtype=np.int64)
    duration = np.array(data.draw(st.lists(st.floats(0.0, 5.0), min_size=nodes, max_size=nodes)))
    assert compiled.pipeline_ends() is not None  # numba is a dependency
    flat = np.stack([src, dst], axis=1).ravel()
    end, indeg, done = walk_ends(flat, np.full(src.size, 2, dtype=np.int64), 0, 1, duration)
    plain_end, plain_indeg = longest_path_ends_by_level(nodes, src, dst, duration)
    assert indeg.tolist() == plain_indeg.tolist()
    if plain_end is None:
        assert done < nodes
    else:
        assert done == nodes and end.tolist() == plain_end.tolist()


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 4), st.integers(1, 3), st.integers(0, 3), st.data())
def test_the_pipeline_walk_matches_the_walk_over_edge_arrays(units, vp, barriers, data):
    """``compiled._pipeline_ends`` (a cursor per resource, chains by arithmetic) against
    the numpy levels over ``edge_arrays``: any sequences of any nodes (repeats, cycles,
    barrier nodes past the chains, empty resources) give the same ends to the bit, or both a
    cycle with the same in-degrees left. Given a limit, the walk stops exactly where some
    chain operation it reaches ends after it: on a graph walked to the end, where the latest
    finish of a micro-batch (its first virtual stage's backward) is after the limit."""
    nodes = 2 * units * vp + barriers
    rows = data.draw(st.lists(st.lists(st.integers(0, nodes - 1), max_size=8), min_size=1, max_size=5))
    flat = np.array([v for row in rows for v in row], dtype=np.int64)
    lens = np.array([len(row) for row in rows], dtype=np.int64)
    duration = np.array(data.draw(st.lists(st.floats(0.0, 5.0), min_size=nodes, max_size=nodes)))
    graph = mock.Mock(units=units, vp=vp)
    src, dst = edge_arrays(graph, flat, lens, barriers)
    want, left = longest_path_ends_by_level(nodes, src, dst, duration)
    end, indeg, done = walk_ends(flat, lens, units, vp, duration)
    end, indeg = end.copy(), indeg.copy()  # the walk's kept arrays: the next walk writes them
    assert indeg.tolist() == left.tolist() and (done == nodes) == (want is not None)
    if want is not None:
        assert end.tolist() == want.tolist()
    narrow = walk_ends(flat.astype(np.int32), lens, units, vp, duration)  # the planner's 32-bit ids
    assert narrow[1].tolist() == indeg.tolist() and narrow[2] == done
    assert done != nodes or narrow[0].tolist() == end.tolist()
    limit = data.draw(st.floats(0.0, 30.0))
    _, _, stopped = walk_ends(flat, lens, units, vp, duration, limit)
    if want is not None:
        latest = max(want[np.arange(units) * 2 * vp + 1], default=0.0)  # each micro-batch's last operation
        assert (stopped == -1) == (latest > limit)
        assert stopped == -1 or stopped == nodes
    elif stopped != -1:  # a deadlock reached before any chain operation ended after the limit
        assert stopped == done


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 4), st.integers(1, 3), st.integers(1, 4), st.booleans(), st.data())
def test_compiled_operation_ids_match_the_array_operations(p, v, n, chunked, data):
    """``compiled._operation_ids`` against ``pipeline_times._operation_ids``' array operations:
    the same id for every op of any devices' rows (empty devices included; some devices
    sharing an earlier device's array, as ``_shared_rows`` gives them), chunk or
    virtual-stage numbering, ranks of any micro-batch counts; and both against the ids of
    each device's rows read one by one."""
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
    want = _operation_ids(ops, at, lens, unit.astype(np.int64), row_start, p, vp, chunked)
    for dtype in (np.int32, np.int64):  # the planner's 32-bit ids, and 64-bit past 2^31 nodes
        out = np.empty(int(lens.sum()), dtype=dtype)
        got = compiled.operation_ids()(ops, at, lens, unit.astype(np.int64), row_start, p, vp, chunked, out)
        assert got is out and got.tolist() == want.tolist()
    one_by_one = [
        (unit[row_start[d // p] + m] * vp + (c * p + d % p if chunked else c)) * 2 + direction
        for d, a in enumerate(per_device)
        for direction, m, c in a.tolist()
    ]
    assert want.tolist() == one_by_one


@settings(max_examples=200, deadline=None)
@given(st.one_of(ring_keys(), st.lists(st.lists(st.one_of(st.none(), st.integers(0, 4)), max_size=6), max_size=6)))
def test_compiled_slot_offsets_match_the_python_walk(keys):
    """``compiled._slot_offsets`` against ``slot_offsets``' walk in Python: the same offsets, or
    both None (rings whose members' index differences disagree, a ring twice on one rank)."""
    with mock.patch.object(compiled, "slot_offsets", lambda: None):
        plain = slot_offsets(keys)
    assert slot_offsets(keys) == plain


@settings(max_examples=60, deadline=None)
@given(ring_keys(), st.integers(1, 4), st.integers(1, 3))
def test_cut_per_rank_matches_cutting_each_rank_alone(keys, stages, chunks):
    off = slot_offsets(keys)
    if off is None:
        return
    slots = max(o + len(k) for o, k in zip(off, keys))
    full = _run_one_pipeline([1.0] * slots, [2.0] * slots, stages, chunks)
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


def _same_view(a: _RankView, b: _RankView) -> None:
    assert a.locals == b.locals and a.times == b.times and a.rings == b.rings
    assert [a.natural(u) for u in a.rings] == [b.natural(u) for u in b.rings]
    assert a.own == b.own and a.prefix == b.prefix and a.load == b.load and a.queue_times == b.queue_times


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_a_view_after_a_ring_is_the_view_of_the_queue_left(data):
    """``_RankView.advance`` (the view before, changed in place) gives what a pass over the
    queue left gives, to the bit, through several rings in a row."""
    rings = data.draw(st.integers(1, 5))
    queue = [u for u in range(rings)]
    for _ in range(data.draw(st.integers(0, 8))):
        size = data.draw(st.integers(1, 3))
        batch = LocalBatch(tuple(range(size)), 1.0, data.draw(st.floats(0.001, 3.0)))
        queue.insert(data.draw(st.integers(0, len(queue))), batch)
    ring_time = {u: data.draw(st.floats(0.001, 3.0)) for u in range(rings)}
    split = data.draw(st.booleans())
    clock = data.draw(st.floats(0.0, 5.0))
    view = _RankView.of_queue(queue, clock, ring_time, split)
    for _ in range(rings):
        u = data.draw(st.sampled_from(view.rings))
        take = data.draw(st.integers(0, len(view.locals)))
        clock = view.prefix[take] + ring_time[u]
        left = [x for x in queue if x is not u and not any(x is y for y in view.locals[:take])]
        view.advance(queue, take, u, clock, ring_time, split)
        assert queue == left
        _same_view(view, _RankView.of_queue(queue, clock, ring_time, split))


@st.composite
def schedules(draw, max_ranks=12):
    """``order_runs``' input: per rank its rings (in one global order) among local packs of
    1-3 sequences whose seconds often tie, the rings' members and seconds."""
    n = draw(st.integers(2, max_ranks))
    count = draw(st.integers(1, 6))
    members = {}
    for u in range(count):
        size = draw(st.integers(1, n))
        members[u] = tuple(sorted(draw(st.lists(st.integers(0, n - 1), min_size=size, max_size=size, unique=True))))
    seq = iter(range(10**6))
    runs = [[] for _ in range(n)]
    for u in range(count):
        for r in members[u]:
            runs[r].append(u)
    for r in range(n):
        for _ in range(draw(st.integers(0, 4))):
            size = draw(st.integers(1, 3))
            batch = LocalBatch(tuple(next(seq) for _ in range(size)), 0.0, draw(st.sampled_from([0.5, 1.0, 2.0])))
            runs[r].insert(draw(st.integers(0, len(runs[r]))), batch)
    ring_time = {u: draw(st.sampled_from([1.0, 1.5, 3.0])) for u in members}
    return runs, list(members), members, ring_time


def _halves(batch: LocalBatch):
    k = len(batch.seq_ids) // 2
    return tuple(LocalBatch(ids, batch.ratio, batch.time / 2) for ids in (batch.seq_ids[:k], batch.seq_ids[k:]))


def _outcome(ordered):
    runs = [[x if isinstance(x, int) else (x.seq_ids, x.time) for x in run] for run in ordered.runs]
    counts = (ordered.reordered, ordered.pulled, ordered.deferred, ordered.splits, ordered.moved)
    return runs, ordered.clock, ordered.unaligned, ordered.deadlock, ordered.members, counts


@settings(max_examples=120, deadline=None)
@given(schedules(), st.booleans())
def test_a_wide_rings_shortfall_from_counts_matches_the_one_from_its_members_views(case, fallback):
    """Every ring checked with ``_State._missing`` (and each stuck one asked whether it is
    ``hopeless``) orders the runs exactly as every ring checked member by member from the
    views (and never given up early)."""
    runs, order, members, ring_time = case
    counted = slot_alignment._State._missing

    def checked(state, u, ring):  # each call against the members' views
        got = counted(state, u, ring)
        fixed = [r for r in ring if state.offset[r] is not None]
        lo = max((state.cursor(r) for r in fixed), default=0)
        views = [state.view(r) for r in fixed]
        assert got == sum(max(0, lo - state.cursor(r) - len(v.locals) - v.own) for r, v in zip(fixed, views))
        return got

    out = {}
    for wide in (10**9, 1):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(slot_alignment, "WIDE_RING", wide)
            mp.setattr(slot_alignment._State, "_missing", checked)
            ordered = order_runs(runs, order, members, ring_time, stages=2, split=_halves, fallback=fallback)
        out[wide] = _outcome(ordered)
    if not fallback and (out[1][3] or out[10**9][3]):
        # a pass that stops at its first unaligned ring may stop earlier on a ring that
        # ``_State.hopeless`` shows can never align: only whether it deadlocks counts
        assert bool(out[1][3]) == bool(out[10**9][3])
    else:
        assert out[1] == out[10**9]


def _level_pick_node_by_node(load, level, size: int, rpn: int):
    """``_level_pick`` as it reads, one node and one level at a time (its reference)."""
    n = load.size
    nodes = [np.arange(k, min(k + rpn, n)) for k in range(0, n, rpn)]
    best = None
    for lv in np.unique(level).tolist():
        if size > rpn:
            parts = [node[level[node] == lv] for node in nodes]
            parts = sorted((p for p in parts if p.size), key=lambda p: (-p.size, float(load[p].max()), int(p[0])))
            picks = [np.concatenate(parts)[:size]] if sum(p.size for p in parts) >= size else []
        else:
            picks = []
            for node in nodes:
                cand = node[level[node] == lv]
                if cand.size >= size:
                    picks.append(cand[np.lexsort((cand, load[cand]))[:size]])
        for chosen in picks:
            chosen = np.sort(chosen)
            # the loads summed in rank order (``_level_pick``'s cumulative sum)
            key = (float(load[chosen].max()), float(load[chosen].max() * size - sum(load[chosen].tolist())), lv)
            if best is None or key < best[0]:
                best = (key, chosen)
    return None if best is None else best[1]


@settings(max_examples=300, deadline=None)
@given(st.data(), st.sampled_from([1, 2, 4, 8]))
def test_a_level_pick_for_all_nodes_at_once_matches_node_by_node(data, rpn):
    nodes = data.draw(st.integers(1, 6))
    n = nodes * rpn
    # few distinct loads and levels: ties, which the orders must break the same way
    load = np.array(data.draw(st.lists(st.sampled_from([0.0, 1.0, 2.5]), min_size=n, max_size=n)))
    level = np.array(data.draw(st.lists(st.integers(0, 1), min_size=n, max_size=n)), dtype=np.int64)
    size = data.draw(st.integers(1, n))
    got = _level_pick(load, level, size, np.arange(n).reshape(nodes, rpn))
    want = _level_pick_node_by_node(load, level, size, rpn)
    assert (got is None and want is None) or got.tolist() == want.tolist()


@settings(max_examples=200, deadline=None)
@given(st.data(), st.sampled_from([1, 2, 4, 8]))
def test_compiled_level_placement_matches_its_numpy_version(data, rpn):
    """``compiled._level_placement`` (rank by rank) against ``_level_placement`` (level by
    level with numpy): the same members for every ring, bit for bit, and the same stop where
    a ring fits no level, with loads and seconds that tie often."""
    kernel = compiled.level_placement()
    assert kernel is not None  # numba is a dependency
    n = rpn * data.draw(st.integers(1, 6))
    load = np.array(data.draw(st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.5, 0.1]), min_size=n, max_size=n)))
    sizes = np.array(sorted(data.draw(st.lists(st.integers(1, n), min_size=1, max_size=12)), reverse=True))
    times = np.array(data.draw(st.lists(st.sampled_from([0.3, 1.0, 1.5]), min_size=sizes.size, max_size=sizes.size)))
    got, placed = kernel(load, sizes, times, rpn)
    want, want_placed = slot_alignment._level_placement(load, sizes, times, rpn)
    assert placed == want_placed
    assert got[: sizes[:placed].sum()].tolist() == want.tolist()


def test_a_higher_level_that_starts_a_ring_as_early_wins_on_less_idle():
    """One rank per node: the second ring starts at 1.0 on level 0 (ranks 0 and 3, one idle
    0.5 s) and on level 1 (ranks 1 and 2, none idle), so level 1 takes it; both paths."""
    load, sizes, times = np.array([0.5, 0.0, 0.0, 1.0]), np.array([2, 2]), np.array([1.0, 1.0])
    want, placed = slot_alignment._level_placement(load, sizes, times, 1)
    assert placed == 2 and want.tolist() == [1, 2, 1, 2]
    got, placed = compiled.level_placement()(load, sizes, times, 1)
    assert placed == 2 and got.tolist() == [1, 2, 1, 2]


def test_a_level_pick_takes_tied_part_nodes_from_the_lowest_rank():
    """A ring of 9 on nodes of 8: node 2 whole at level 0, then one of two part-nodes tied in
    size and load: node 0's rank 1 comes before node 1's rank 8."""
    level = np.ones(24, dtype=np.int64)
    level[[1, 8]] = 0
    level[16:] = 0
    got = _level_pick(np.zeros(24), level, 9, np.arange(24).reshape(3, 8))
    assert got.tolist() == [1, *range(16, 24)] == _level_pick_node_by_node(np.zeros(24), level, 9, 8).tolist()


@settings(max_examples=40, deadline=None)
@given(schedules(max_ranks=16), st.sampled_from([1, 2, 4, 8]))
def test_rings_placed_again_by_level_all_have_run_as_many_rings_before(case, ranks_per_node):
    """Every ring placed again by level meets each member after the same number of rings;
    the ranks' clocks (rings compiled, then local work) are ``_sequential``'s to the bit."""
    runs, order, members, ring_time = case
    n = len(runs) - len(runs) % ranks_per_node if len(runs) > ranks_per_node else len(runs)
    runs = [[x for x in run if not isinstance(x, int)] for run in runs[:n]]  # ranks of whole nodes
    members = {u: tuple(r for r in m if r < n) for u, m in members.items()}
    members = {u: m for u, m in members.items() if m}
    placed = _place_by_level(runs, list(members), members, ring_time, ranks_per_node, run_arrays(runs))
    if placed is None:
        return
    new_runs, new_members, ring_order, clock, _ = placed
    with mock.patch.object(compiled, "ring_clocks", lambda: None):  # the clocks by _sequential
        plain = slot_alignment.order_by_level(runs, list(members), members, ring_time, ranks_per_node)
    assert plain.runs == new_runs and plain.members == new_members and plain.clock == clock
    _check_items(plain, ring_time)
    assert sorted(ring_order) == sorted(members) and {u: len(m) for u, m in new_members.items()} == {
        u: len(m) for u, m in members.items()
    }
    for u, ring in new_members.items():
        assert len({[x for x in new_runs[r] if isinstance(x, int)].index(u) for r in ring}) == 1


@settings(max_examples=60, deadline=None)
@given(schedules(max_ranks=16))
def test_run_arrays_hold_every_item_of_the_runs(case):
    """``run_arrays``: the runs' items as the compiled passes read them (rings by index, the
    local micro-batches numbered in rank order with their seconds, sequence counts and
    sequences), and each rank's local micro-batches as its slice of the pool."""
    runs = case[0]
    arrays = run_arrays(runs)
    pool = [x for run in runs for x in run if not isinstance(x, int)]
    assert arrays.pool == pool and arrays.counts.tolist() == [len(run) for run in runs]
    it = iter(range(len(pool)))
    assert arrays.codes.tolist() == [x if isinstance(x, int) else -1 - next(it) for run in runs for x in run]
    assert arrays.local_time.tolist() == [x.time for x in pool]
    assert arrays.local_size.tolist() == [len(x.seq_ids) for x in pool]
    assert arrays.seqs.tolist() == [i for x in pool for i in x.seq_ids]
    bounds = arrays.local_bounds()
    assert [pool[a:b] for a, b in zip(bounds, bounds[1:])] == [
        [x for x in run if not isinstance(x, int)] for run in runs
    ]


def test_a_bounded_walk_stops_where_a_resources_work_left_passes_the_limit():
    """Micro-batch 0 (forward 0, backward 1) runs on resource 0 around micro-batch 1's backward
    (node 3), which resource 1 holds before its own forward (node 2): a cycle, so neither node 3
    nor node 1 ever ends, and no operation that ends after the limit is reached. Once node 0
    ends (1 s), resource 0 still has 2 + 4 s to run, so its last operation cannot end before
    7 s: given a limit under that, the walk stops there rather than walking on to the
    deadlock; given 7 s, it walks on."""
    flat, lens = np.array([0, 3, 1, 3, 2]), np.array([3, 2])
    duration = np.array([1.0, 4.0, 0.5, 2.0])
    assert walk_ends(flat, lens, 2, 1, duration)[2] == 1  # unbounded: node 0 ends, then the cycle
    assert walk_ends(flat, lens, 2, 1, duration, limit=6.9)[2] == -1
    assert walk_ends(flat, lens, 2, 1, duration, limit=7.0)[2] == 1  # 1 + 2 + 4 is not over 7


def test_the_kernel_compiles_where_no_cache_directory_is_writable(monkeypatch):
    """numba refuses ``cache=True`` when it finds no writable cache directory (a read-only
    install, no home): the kernel is then compiled without a cache, not an error."""
    import numba.core.caching as caching
    from numba.core.dispatcher import Dispatcher

    monkeypatch.setattr(caching.CacheImpl, "_locator_classes", [])
    with pytest.raises(RuntimeError, match="no locator"):  # what the fallback is for
        caching.FunctionCache(compiled._pipeline_ends)
    kernel = compiled.pipeline_ends.__wrapped__()
    assert isinstance(kernel, Dispatcher)
    wait, end = np.empty((3, 2), dtype=np.int32), np.empty(3)
    done = kernel(
        np.array([0, 1, 2]), np.array([3]), 0, 1, np.array([1.0, 2.0, 0.5]), np.inf, wait, end, np.empty(3, np.int32)
    )
    assert end.tolist() == [1.0, 3.0, 3.5] and wait[:, 0].tolist() == [0, 0, 0] and done == 3


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.none(),
            st.integers(-1, 6),
            st.sampled_from([1.0, 2.5, (1, 2), (3,), "a", 2**70]),
        ),
        max_size=40,
    )
)
def test_first_micro_batch_of_each_unit_with_numpy_matches_the_dict(keys):
    """``_first_of_unit`` with numpy (integer keys) or, for any other keys (-1 beside None,
    floats equal to integers, tuples, strings, huge integers), with a dict: the plain dict walk."""
    seen, want = {}, []
    for i, key in enumerate(keys):
        want.append(i if key is None else seen.setdefault(key, i))
    assert _first_of_unit(keys).tolist() == want


def _python_alignment():
    """``slot_alignment._aligned`` in Python (what runs where numba is missing), not compiled."""
    return mock.patch.object(compiled_alignment, "aligned_pass", lambda: None)


def _every_field(ordered):
    """An ``Ordered`` as plain values: items as ring indices or (sequences, ratio, seconds)."""
    runs = [[x if isinstance(x, int) else (x.seq_ids, x.ratio, x.time) for x in run] for run in ordered.runs]
    counts = (ordered.reordered, ordered.pulled, ordered.deferred, ordered.splits, ordered.moved)
    return runs, ordered.clock, ordered.unaligned, counts


@settings(max_examples=250, deadline=None)
@given(
    schedules(),
    st.data(),
    st.sampled_from(["none", "selective", "full"]),
    st.booleans(),
    st.booleans(),
    st.sampled_from([1, 2, 16]),
    st.sampled_from([slot_alignment.ROW_ROOM, 0]),
    st.sampled_from([slot_alignment.WIDE_RING, 1]),
)
def test_the_compiled_aligned_pass_matches_its_python_version(
    case, data, recompute, frugal, stop, lookahead, room, wide
):
    """``compiled_alignment`` against ``slot_alignment._aligned`` in Python: the same runs (the
    split halves' sequences, ratios and seconds too), clocks, counts and unaligned rings, with
    the planner's splitter (recompute changes its halves' times) or none, every mode of the
    pass, rows that must grow (``ROW_ROOM`` 0) and wide-ring give-ups on small rings."""
    runs, order, members, ring_time = case
    fresh = iter(range(10**6))  # packs of up to 6 sequences: more to split
    runs = [[LocalBatch(tuple(next(fresh) for _ in range(data.draw(st.integers(1, 6)))), 0.25 * r, x.time)
             if isinstance(x, LocalBatch) else x for x in run] for r, run in enumerate(runs)]  # fmt: skip
    seqs = next(fresh)
    lens = tuple(data.draw(st.lists(st.sampled_from([1, 2, 3, 5, 8]), min_size=seqs, max_size=seqs)))
    cost = small_cost()
    if recompute == "selective":
        cost = cost.with_recompute("selective")
    elif recompute == "full":
        cost = cost.with_recompute("full", "block", 2)
    split = PackSplitter(lens, cost) if data.draw(st.booleans()) else None
    args = (runs, order, members, ring_time, split, lookahead)
    with mock.patch.object(slot_alignment, "ROW_ROOM", room), mock.patch.object(slot_alignment, "WIDE_RING", wide):
        fast = slot_alignment._aligned_compiled(*args, frugal, stop)
        with _python_alignment():
            slow = slot_alignment._aligned(*args, frugal=frugal, stop_unaligned=stop)
    assert fast is not None  # numba is a dependency: the compiled pass ran
    assert _every_field(fast) == _every_field(slow)
    _check_items(fast, ring_time)


def _check_items(ordered, ring_time):
    """``Ordered.items`` as the compiled passes leave them: what ``item_arrays`` makes of the
    runs, every float to the bit (``rank_estimates`` reads them instead)."""
    assert ordered.items is not None
    want = item_arrays(ordered.runs, ring_time)
    got = slot_alignment.ordered_item_arrays(ordered, ring_time)
    assert got[0].tolist() == want[0].tolist() and got[1].tolist() == want[1].tolist() and got[2] == want[2]


def test_a_compiled_pass_whose_row_fills_up_runs_again_with_longer_rows():
    """Rank 0 (the longest row: its rings A, C, D, E) is two slots behind rank 1 at ring C and
    has no local work: it borrows rank 2's two packs (the second split in two), which fills
    its row; the pass runs again with rows twice as long and gives the Python pass's order."""
    a, b1, b2, c, d, e = range(6)
    members = {a: (0, 1), b1: (1, 2), b2: (1, 2), c: (0, 1), d: (0,), e: (0,)}
    packs = [LocalBatch((0, 1), 0.0, 2.0), LocalBatch((2, 3), 0.0, 2.0)]
    runs = [[a, c, d, e], [a, b1, b2, c], [b1, b2, *packs]]
    ring_time = dict.fromkeys(members, 1.0)
    split = PackSplitter((4, 4, 4, 4), small_cost())
    kernel = compiled_alignment.aligned_pass()
    statuses = []

    def watched(*args):
        out = kernel(*args)
        statuses.append(out[0])
        return out

    args = (runs, list(members), members, ring_time, split, 1)
    with mock.patch.object(slot_alignment, "ROW_ROOM", 0):
        with mock.patch.object(compiled_alignment, "aligned_pass", lambda: watched):
            fast = slot_alignment._aligned_compiled(*args, False, False)
        with _python_alignment():
            slow = slot_alignment._aligned(*args)
    assert statuses == [compiled_alignment.FULL, compiled_alignment.DONE]
    assert (fast.moved, fast.splits) == (2, 1)
    assert _every_field(fast) == _every_field(slow)


@settings(max_examples=100, deadline=None)
@given(ring_keys(), st.integers(2, 4), st.integers(1, 3), st.data())
def test_rank_estimates_from_item_arrays_match_the_lists(keys, stages, chunks, data):
    """``rank_estimates`` reads the graph from ``item_arrays`` (no Python step per item): the
    same rings and seconds as ``unit_keys`` and the times lists, the same graph arrays as
    ``PipelineArrays`` of those lists, and the same finish per rank as the lists' estimate
    (the contract's walk where the graph is small, forced past it here); a deadlock too."""
    ring_time = {u: data.draw(st.floats(0.5, 4.0)) for u in {k for row in keys for k in row if k is not None}}
    runs = [
        [k if k is not None else LocalBatch((0,), 0.0, data.draw(st.floats(0.0, 4.0))) for k in row] for row in keys
    ]
    times = [[x.time if isinstance(x, LocalBatch) else ring_time[x] for x in run] for run in runs]
    rings, seconds, counts = item_arrays(runs, ring_time)
    assert rings.tolist() == [-1 if k is None else k for row in keys for k in row]
    assert seconds.tolist() == [t for row in times for t in row] and counts == [len(row) for row in keys]
    assert slot_alignment.run_lists(rings, seconds, counts) == (keys, times)
    fast = PipelineArrays.of_rings(rings, seconds, counts, stages, 0.4, chunks)
    plain = PipelineArrays(keys, times, stages, 0.4, chunks)
    assert fast.unit.tolist() == plain.unit.tolist() and fast.dur.tolist() == plain.dur.tolist()
    assert fast.rank.tolist() == plain.rank.tolist() and fast.units == plain.units
    known = {}
    with mock.patch.object(slot_alignment, "is_small", lambda *a: False):
        estimate = slot_alignment.rank_estimates(
            Ordered(runs, [0.0] * len(runs)), stages, ring_time, 0.4, chunks, known
        )
    walked = walked_finish_times(keys, times, stages, 0.4, None, chunks)
    assert known[None][1] == walked
    if walked is not None:
        assert estimate == walked


@pytest.mark.parametrize(
    "not_megatron, megatron, kept",
    [
        ([2.0, 1.0], [1.0, 2.0], "not_megatron"),  # equal steps: not Megatron's, as when it came first
        ([1.0, 3.0], [2.0, 2.0], "megatron"),
        ([1.0, 1.5], [2.0, 2.0], "not_megatron"),
        (Longer(2.0), [2.0, 2.0], "megatron"),  # its walk stopped at Megatron's step
        ([1.0, 1.0], Longer(3.0), "not_megatron"),  # Megatron's stopped at the caller's limit
    ],
)
def test_slot_aligned_orders_are_walked_megatrons_first_and_the_shorter_kept(not_megatron, megatron, kept):
    """Where the interleaved order deadlocks, Megatron's slot-aligned order is walked first
    (given the caller's limit) and the other one stopped at its step: the shorter estimate
    kept, the other on a tie, as when they were walked in the other order without limits."""
    orders = {False: ArrayOrders([], 2), True: ArrayOrders([], 2)}
    finish = {id(orders[False]): not_megatron, id(orders[True]): megatron}
    bounds = []

    def walk(pipes, o=None, bound=np.inf):
        bounds.append(bound)
        return None if o is None else finish[id(o)]  # the interleaved order deadlocks

    runs = [[0, 1], [1, 0]]  # the rings cross: the interleaved order may deadlock, so it is walked to the end
    with (
        mock.patch.object(slot_alignment, "is_small", lambda *a: False),
        mock.patch.object(slot_alignment, "slot_offsets", lambda keys: [0, 0]),
        mock.patch.object(slot_alignment, "slot_interleaved_orders", lambda *a, megatron, **k: orders[megatron]),
        mock.patch.object(slot_alignment, "finish_times", walk),
    ):
        got = slot_alignment.rank_estimates(Ordered(runs, [0.0, 0.0]), 2, {0: 1.0, 1: 1.0}, 0.4, 2, None, 3.0)
    assert got == {"not_megatron": not_megatron, "megatron": megatron}[kept]
    step = max(megatron) if isinstance(megatron, list) else 3.0
    assert bounds == [np.inf, 3.0, step]  # the interleaved order to the end; Megatron's; the other


@pytest.mark.parametrize("chunks", [1, 2])
def test_the_default_order_of_rings_at_one_index_stops_at_the_callers_step(chunks):
    """Rings at one index cannot deadlock under the default order (``rings_at_one_index``),
    so its walk is given the caller's limit and, stopped there, the estimate is ``Longer``
    with nothing else walked; where it finishes, that is the estimate."""
    for ends in (Longer(3.0), [2.0, 2.5]):
        bounds = []

        def walk(pipes, o=None, bound=np.inf):
            bounds.append((o, bound))
            return ends

        known = {}
        runs = [[0, LocalBatch((0,), 0.0, 1.0)], [0]]
        with (
            mock.patch.object(slot_alignment, "is_small", lambda *a: False),
            mock.patch.object(slot_alignment, "finish_times", walk),
        ):
            got = slot_alignment.rank_estimates(Ordered(runs, [0.0, 0.0]), 2, {0: 1.0}, 0.4, chunks, known, 3.0)
        assert got == ends and bounds == [(None, 3.0)] and known == {None: (None, ends)}


@settings(max_examples=150, deadline=None)
@given(
    st.integers(1, 4),
    st.integers(1, 5),
    st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), max_size=14),
)
def test_compiled_one_pipeline_matches_the_python_run(stages, chunks, slot_times):
    """``compiled.one_pipeline`` runs ``_run_one_pipeline``'s pipeline: the same ops on every
    device in the same order, with tied starts (equal and zero times: a backward first, then the
    lower device) and partial groups (micro-batch counts not a multiple of ``stages``)."""
    fwd = [float(f) for f, _ in slot_times]
    bwd = [float(b) for _, b in slot_times]
    plain = [[tuple(op) for op in order] for order in _run_one_pipeline(fwd, bwd, stages, chunks)]
    fast = slot_alignment._one_pipeline_rows(fwd, bwd, stages, chunks)
    assert [[tuple(row) for row in order.tolist()] for order in fast] == plain
