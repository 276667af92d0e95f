"""The pipeline graph's and the slot alignment's fast paths give what their plain versions
give: operation sequences mapped from cached per-count patterns, micro-batch edges unrolled
instead of asked of ``next_op`` per operation, the longest paths level by level with numpy
(``pipeline_times``) instead of node by node, each rank's cut of one long pipeline shared by
ranks with the same slots, a rank's view after a ring derived from its view before instead of
from its queue."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_bytescale.planner.contract import PipelineGraph, encode_stage_orders, interleaved_order, longest_paths
from megatron_bytescale.planner.pipeline_times import PipelineArrays, graph_ends
from megatron_bytescale.planner.slot_alignment import (
    LocalBatch,
    _cut_per_rank,
    _RankView,
    _run_one_pipeline,
    slot_offsets,
)


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


@settings(max_examples=100, deadline=None)
@given(ring_keys(), st.integers(1, 4), st.integers(1, 3), st.data())
def test_numpy_longest_paths_match_the_contracts_walk(keys, stages, chunks, data):
    """The same end of every node, to the bit (one sum and one maximum per node either way),
    barriers included; on a deadlock both give None and leave the same nodes waiting."""
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
    """``_RankView.after_place`` (slices of the view before) gives what a pass over the queue
    left gives, to the bit, through several rings in a row."""
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
        view, queue = view.after_place(queue, take, u, clock, ring_time, split)
        assert queue == left
        _same_view(view, _RankView.of_queue(queue, clock, ring_time, split))
