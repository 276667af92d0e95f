"""The ordering passes' invariants: the aligned pass (every ring at one slot on all its
members, no micro-batch lost or made up, the clocks of the runs it gives) run compiled and as
Python, the items' arrays the estimates read, and how ``rank_estimates`` walks and bounds the
orders it compares."""

from collections import Counter
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_bytescale.planner import jit
from megatron_bytescale.planner.contract import pipelined_finish_times as walked_finish_times
from megatron_bytescale.planner.order import aligned as aligned_module
from megatron_bytescale.planner.order import slots
from megatron_bytescale.planner.order.aligned import DONE, FULL, aligned
from megatron_bytescale.planner.order.runs import (
    LocalBatch,
    Ordered,
    PackSplitter,
    item_arrays,
    ordered_item_arrays,
    run_arrays,
    run_lists,
    unit_keys,
)
from megatron_bytescale.planner.order.walk import ArrayOrders, Longer, PipelineArrays

from planner_cases import ring_keys, small_cost
from planner_oracles import plain_slot_offsets

BOTH = pytest.mark.parametrize("mode", ["python", "compiled"])


@st.composite
def schedules(draw, max_ranks=12):
    """``order_runs``' input: per rank its rings (in one global order) among local packs of
    1-6 sequences whose seconds often tie, the rings' members and seconds, and the sequences'
    lengths (for the planner's splitter)."""
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
            size = draw(st.integers(1, 6))
            batch = LocalBatch(tuple(next(seq) for _ in range(size)), 0.25 * r, draw(st.sampled_from([0.5, 1.0, 2.0])))
            runs[r].insert(draw(st.integers(0, len(runs[r]))), batch)
    ring_time = {u: draw(st.sampled_from([1.0, 1.5, 3.0])) for u in members}
    seqs = next(seq)
    lens = tuple(draw(st.lists(st.sampled_from([1, 2, 3, 5, 8]), min_size=seqs, max_size=seqs)))
    return runs, list(members), members, ring_time, lens


def _clocks(runs, ring_time):
    """Each rank's finish when it runs its items in order and a ring starts once all its
    members reach it (every member holds each ring once)."""
    at, clock, holders = [0] * len(runs), [0.0] * len(runs), {}
    for r, run in enumerate(runs):
        for x in run:
            if isinstance(x, int):
                holders.setdefault(x, []).append(r)
    moved = True
    while moved:
        moved = False
        for r, run in enumerate(runs):
            while at[r] < len(run) and not isinstance(run[at[r]], int):
                clock[r] += run[at[r]].time
                at[r] += 1
                moved = True
            if at[r] < len(run):
                u = run[at[r]]
                ring = holders[u]
                if all(at[m] < len(runs[m]) and runs[m][at[m]] == u for m in ring):
                    end = max(clock[m] for m in ring) + ring_time[u]
                    for m in ring:
                        clock[m] = end
                        at[m] += 1
                    moved = True
    assert all(a == len(run) for a, run in zip(at, runs))
    return clock


def _sequences(runs):
    return Counter(i for run in runs for x in run if not isinstance(x, int) for i in x.seq_ids)


@BOTH
@settings(max_examples=120, deadline=None)
@given(
    schedules(),
    st.booleans(),
    st.sampled_from(["none", "selective", "full"]),
    st.sampled_from([1, 2, 16]),
    st.sampled_from([aligned_module.ROW_ROOM, 0]),
)
def test_the_aligned_pass_puts_every_ring_at_one_slot_and_keeps_every_sequence(
    mode, case, split, recompute, lookahead, room
):
    """``order.aligned.aligned`` in every mode of the pass, with the planner's splitter
    (recompute changes its halves' times) or none, and rows that must grow (``ROW_ROOM`` 0):
    each member runs its rings once each, in the schedule's order unless rings were reordered;
    every sequence stays in exactly one micro-batch (splits and borrows only move them); a split
    adds one micro-batch; where no ring is left unaligned, every ring sits at one slot on all
    its members; the clocks are those of the runs it gives; and compiled or as Python, the same
    result."""
    runs, order, members, ring_time, lens = case
    cost = {"none": small_cost(), "selective": small_cost().with_recompute("selective")}.get(
        recompute, small_cost().with_recompute("full", "block", 2)
    )
    splitter = PackSplitter(lens, cost) if split else None
    with jit.use(mode), mock.patch.object(aligned_module, "ROW_ROOM", room):
        out = aligned(runs, order, members, ring_time, splitter, lookahead)
    rings = lambda rs: [[x for x in run if isinstance(x, int)] for run in rs]  # noqa: E731
    assert [sorted(r) for r in rings(out.runs)] == [sorted(r) for r in rings(runs)]  # each ring once per member
    assert rings(out.runs) == rings(runs) or out.reordered
    assert _sequences(out.runs) == _sequences(runs)
    locals_in = sum(1 for run in runs for x in run if not isinstance(x, int))
    assert sum(1 for run in out.runs for x in run if not isinstance(x, int)) == locals_in + out.splits
    assert out.splits == 0 or split
    if not out.unaligned:
        assert plain_slot_offsets(unit_keys(out.runs)) is not None
    assert out.clock == pytest.approx(_clocks(out.runs, ring_time), rel=1e-12)
    want = item_arrays(out.runs, ring_time)  # the arrays the estimates read, every float to the bit
    got = ordered_item_arrays(out, ring_time)
    assert got[0].tolist() == want[0].tolist() and got[1].tolist() == want[1].tolist() and got[2] == want[2]
    with jit.use("python" if mode == "compiled" else "compiled"):
        other = aligned(runs, order, members, ring_time, splitter, lookahead)
    flat = lambda o: [[x if isinstance(x, int) else (x.seq_ids, x.ratio, x.time) for x in r] for r in o.runs]  # noqa: E731
    assert flat(other) == flat(out) and other.clock == out.clock and other.unaligned == out.unaligned


@BOTH
def test_a_pass_whose_row_fills_up_runs_again_with_longer_rows(mode):
    """Rank 0 (the longest row: its rings A, C, D, E) is two slots behind rank 1 at ring C and
    has no local work: it borrows rank 2's two packs (the second split in two), which fills
    its row; the pass runs again with rows twice as long."""
    a, b1, b2, c, d, e = range(6)
    members = {a: (0, 1), b1: (1, 2), b2: (1, 2), c: (0, 1), d: (0,), e: (0,)}
    packs = [LocalBatch((0, 1), 0.0, 2.0), LocalBatch((2, 3), 0.0, 2.0)]
    runs = [[a, c, d, e], [a, b1, b2, c], [b1, b2, *packs]]
    ring_time = dict.fromkeys(members, 1.0)
    split = PackSplitter((4, 4, 4, 4), small_cost())
    kernel = aligned_module.aligned_pass
    statuses = []

    def watched(*args):
        out = kernel(*args)
        statuses.append(out[0])
        return out

    with (
        jit.use(mode),
        mock.patch.object(aligned_module, "ROW_ROOM", 0),
        mock.patch.object(aligned_module, "aligned_pass", watched),
    ):
        out = aligned(runs, list(members), members, ring_time, split, 1)
    assert statuses == [FULL, DONE]
    assert (out.moved, out.splits) == (2, 1) and not out.unaligned
    assert plain_slot_offsets(unit_keys(out.runs)) is not None


@settings(max_examples=40, deadline=None)
@given(schedules(max_ranks=16))
def test_run_arrays_hold_every_item_of_the_runs(case):
    """``run_arrays``: the runs' items as the kernels read them (rings by index, the local
    micro-batches numbered in rank order with their seconds, sequence counts and sequences),
    and each rank's local micro-batches as its slice of the pool."""
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


@settings(max_examples=60, deadline=None)
@given(ring_keys(), st.integers(2, 4), st.integers(1, 3), st.data())
def test_rank_estimates_from_item_arrays_are_the_contracts_walk(keys, stages, chunks, data):
    """``rank_estimates`` reads the graph from ``item_arrays``: the same rings and seconds as
    ``unit_keys`` and the times lists, the same graph arrays as ``PipelineArrays`` of those
    lists, and the default order's finish per rank the contract's walk gives (a deadlock too)."""
    ring_time = {u: data.draw(st.floats(0.5, 4.0)) for u in {k for row in keys for k in row if k is not None}}
    runs = [
        [k if k is not None else LocalBatch((0,), 0.0, data.draw(st.floats(0.0, 4.0))) for k in row] for row in keys
    ]
    times = [[x.time if isinstance(x, LocalBatch) else ring_time[x] for x in run] for run in runs]
    rings, seconds, counts = item_arrays(runs, ring_time)
    assert rings.tolist() == [-1 if k is None else k for row in keys for k in row]
    assert seconds.tolist() == [t for row in times for t in row] and counts == [len(row) for row in keys]
    assert run_lists(rings, seconds, counts) == (keys, times)
    fast = PipelineArrays.of_rings(rings, seconds, counts, stages, 0.4, chunks)
    plain = PipelineArrays(keys, times, stages, 0.4, chunks)
    assert fast.unit.tolist() == plain.unit.tolist() and fast.dur.tolist() == plain.dur.tolist()
    assert fast.rank.tolist() == plain.rank.tolist() and fast.units == plain.units
    known = {}
    estimate = slots.rank_estimates(Ordered(runs, [0.0] * len(runs)), stages, ring_time, 0.4, chunks, known)
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
        mock.patch.object(slots, "slot_offsets", lambda keys: [0, 0]),
        mock.patch.object(slots, "slot_interleaved_orders", lambda *a, megatron, **k: orders[megatron]),
        mock.patch.object(slots, "finish_times", walk),
    ):
        got = slots.rank_estimates(Ordered(runs, [0.0, 0.0]), 2, {0: 1.0, 1: 1.0}, 0.4, 2, None, 3.0)
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
        with mock.patch.object(slots, "finish_times", walk):
            got = slots.rank_estimates(Ordered(runs, [0.0, 0.0]), 2, {0: 1.0}, 0.4, chunks, known, 3.0)
        assert got == ends and bounds == [(None, 3.0)] and known == {None: (None, ends)}
