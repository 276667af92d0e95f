"""Ring slots: order each rank's micro-batches so that ring micro-batches cannot deadlock
under 1F1B (and give the interleaved orders that stay safe with model chunks).

``order_runs`` takes each rank's work in schedule order and gives every ring one *slot* on
all its members (each rank's index plus its offset): members run some of their local
micro-batches before or after a ring, split packs, or borrow local work, and only when no
local work is left may a ring miss its slot, in which case the shortest safe candidate order
wins and ``Ordered.deadlock`` says why if none is safe. ``rank_estimates`` times the result.
``slot_offsets`` and ``slot_interleaved_orders`` give chunk orders that cannot deadlock when
rings sit at one slot. Why one slot per ring is safe under 1F1B, and the passes in detail:
docs/design.md, "Pipeline order".
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate, chain, compress, pairwise
from operator import attrgetter

import numpy as np

from . import compiled, compiled_alignment
from .contract import BACKWARD, FORWARD, Op, find_pipeline_deadlock
from .contract.ops import megatron_interleaved_orders
from .cost_model import FORWARD_SHARE, CostModel
from .estimate import one_f_one_b_time
from .lengths import lengths_array
from .pipeline_times import ArrayOrders, Longer, PipelineArrays, finish_times, is_small, pipelined_finish_times

LOOKAHEAD = 16  # rings of the schedule tried for the next slot before local work moves between ranks
# Rings with at least this many members check their shortfall with numpy over the members'
# counts (``_State._missing``): fewer are faster one by one in Python.
WIDE_RING = 64
# The compiled pass's rows hold a rank's items and this many more (splits and borrowed work
# lengthen them; a row that fills up runs the pass again with rows twice as long).
ROW_ROOM = 8


@dataclass(eq=False, slots=True)  # slots: ~6 x 10^4 a step at 16K ranks, built and read fast
class LocalBatch:
    """A micro-batch of whole sequences on one rank (whichever rank it ends up on)."""

    seq_ids: tuple[int, ...]
    ratio: float
    time: float  # estimated seconds on one stage


Item = int | LocalBatch  # a ring unit's index, or a local micro-batch
Splitter = Callable[[LocalBatch], tuple[LocalBatch, LocalBatch]]


@dataclass(frozen=True, eq=False)
class PackSplitter:
    """The planner's split of a pack into two micro-batches of about equal tokens (to fill a
    slot): its sequences longest first (ties: the lower index), each to the half with fewer
    tokens so far (ties: the first), each half timed as a pack by the cost model. The
    compiled aligned pass (``compiled_alignment``) splits the same way from ``lens`` and the
    cost model's coefficients; another splitter runs the Python pass."""

    lens: Sequence[int]  # tokens per sequence of the batch
    cost: CostModel

    def __call__(self, batch: LocalBatch) -> tuple[LocalBatch, LocalBatch]:
        lens = self.lens
        halves: tuple[list[int], list[int]] = ([], [])
        tokens = [0, 0]
        for i in sorted(batch.seq_ids, key=lambda i: (-lens[i], i)):
            k = 0 if tokens[0] <= tokens[1] else 1
            halves[k].append(i)
            tokens[k] += lens[i]
        return tuple(LocalBatch(tuple(h), batch.ratio, self.cost.num_layers * self._layer_time(h)) for h in halves)

    def _layer_time(self, seq_ids: Sequence[int]) -> float:
        """Seconds per layer of whole sequences packed into one micro-batch."""
        lens = self.lens
        if len(seq_ids) == 1:
            return self.cost.layer_time(lens[seq_ids[0]])
        return self.cost.layer_time(sum(lens[i] for i in seq_ids), sum(lens[i] * lens[i] for i in seq_ids))


@dataclass
class Ordered:
    runs: list[list[Item]]  # per rank, in run order
    clock: list[float]  # estimated finish per rank (no pipeline fill and drain)
    pulled: int = 0  # local micro-batches run before a ring instead of after it
    deferred: int = 0  # local micro-batches run after a ring instead of before it
    splits: int = 0  # packs split in two to fill a slot
    moved: int = 0  # local micro-batches given to another rank to fill a slot
    reordered: int = 0  # rings run before an earlier ring of the schedule, to take one slot
    # rings the schedule-order pass could not give one slot (a pass that stops at the first: that one)
    unaligned: list[int] = field(default_factory=list)
    searched: bool = False  # the slots came from the time-blind search over the ring structure
    members: dict[int, tuple[int, ...]] | None = None  # new ring members, if the rings had to be placed again
    deadlock: str | None = None  # set when no order safe for 1F1B was found
    # where a compiled pass made the runs: every item's ring (-1: local work) and the local
    # items' seconds (NaN for rings), rank after rank, which ``rank_estimates`` reads instead
    # of a Python step per item (``item_arrays``); the runs are not changed after
    items: tuple[np.ndarray, np.ndarray] | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True, eq=False)
class RunArrays:
    """Every rank's items (runs) as arrays, as the compiled passes read them: ``codes`` per
    item, rank after rank (``counts`` per rank): a ring its index, the k-th local micro-batch
    (in rank order, ``pool[k]``) ``-k - 1``; per local micro-batch its seconds, its sequence
    count and (``seqs``) its sequences end to end. A PP-balance candidate's runs are read by
    the slot-aligned pass and the placement at levels: ``run_arrays`` once for both."""

    codes: np.ndarray
    counts: np.ndarray
    pool: list[LocalBatch]
    local_time: np.ndarray
    local_size: np.ndarray
    seqs: np.ndarray

    def local_bounds(self) -> list[int]:
        """Where each rank's local micro-batches start in ``pool``, and the end."""
        n = self.counts.size
        rank = np.repeat(np.arange(n, dtype=np.int64), self.counts)  # each item's
        return [0, *accumulate(np.bincount(rank[self.codes < 0], minlength=n).tolist())]


def run_arrays(runs: Sequence[Sequence[Item]]) -> RunArrays:
    """``runs`` as ``RunArrays``."""
    items = list(chain.from_iterable(runs))
    local, ring_items, pool = _split_items(items)
    codes = np.empty(len(items), dtype=np.int64)
    codes[local] = -np.arange(1, len(pool) + 1)
    codes[~local] = ring_items
    sizes = np.fromiter((len(x.seq_ids) for x in pool), dtype=np.int64, count=len(pool))
    return RunArrays(
        codes,
        np.fromiter(map(len, runs), dtype=np.int64, count=len(runs)),
        pool,
        np.fromiter((x.time for x in pool), dtype=np.float64, count=len(pool)),
        sizes,
        np.fromiter(chain.from_iterable(x.seq_ids for x in pool), dtype=np.int64, count=int(sizes.sum())),
    )


def order_runs(
    runs: Sequence[Sequence[Item]],
    ring_order: Sequence[int],
    members: dict[int, tuple[int, ...]],
    ring_time: dict[int, float],
    stages: int = 1,
    split: Splitter | None = None,
    ranks_per_node: int = 1,
    lookahead: int = LOOKAHEAD,
    fallback: bool = True,
    forward_share: float = FORWARD_SHARE,
    arrays: RunArrays | None = None,
) -> Ordered:
    """Each rank's items in run order, and the estimated finish of each rank when every ring
    starts as soon as its last member reaches it. ``runs[r]`` holds ``r``'s rings in
    ``ring_order``. With ``stages > 1`` the order is made safe for 1F1B (see above);
    ``Ordered.deadlock`` says why if no safe order was found. ``fallback=False`` skips the
    searches of step 2 (slow on large plans): the first ring left unaligned then sets
    ``deadlock`` and ends the pass (the runs are then incomplete: only ``deadlock`` counts).
    ``forward_share``: the forward's share of a stage's time (``CostModel.forward_share``);
    ``arrays``: ``run_arrays(runs)``, where the caller has it."""
    if stages <= 1:
        return _sequential(runs, ring_order, members, ring_time)
    if arrays is None and compiled_alignment.aligned_pass() is not None:
        arrays = run_arrays(runs)  # what the compiled passes below read of the runs, made once
    result = _aligned(
        runs, ring_order, members, ring_time, split, lookahead, stop_unaligned=not fallback, arrays=arrays
    )
    if not result.unaligned:
        return result
    if not fallback:
        result.deadlock = f"ring micro-batch {result.unaligned[0]} could not take one slot on all its members"
        return result
    # Local work ran out: some rings could not take one slot. The candidates, of which the
    # shortest estimated step wins: the same pass keeping local work for later slots rather
    # than filling waits; either order if 1F1B runs through it anyway; slots from the ring
    # structure alone; and, if the placement admits no safe order (three rings on three
    # ranks, each pair sharing a rank, nothing else to run), the rings placed again.
    safe = []
    frugal = _aligned(runs, ring_order, members, ring_time, split, lookahead, frugal=True, arrays=arrays)
    for candidate in (result, frugal):
        if not candidate.unaligned or not _deadlocks(candidate.runs, stages):
            safe.append(candidate)
    for order in (ring_order, sorted(ring_order, key=lambda u: -len(members[u]))):
        placed = _slot_search(runs, order, members, split)
        if placed is not None and not _deadlocks(placed[0], stages):
            runs_by_slot, slots = placed
            again = _in_schedule_order(runs_by_slot, sorted(slots, key=slots.get), members, ring_time)
            again.searched = True
            safe.append(again)
    again = order_by_level(runs, ring_order, members, ring_time, ranks_per_node, arrays)
    if again is not None:
        safe.append(again)
    if not safe:
        result.deadlock = _deadlock_of(result.runs, stages)
        return result
    best = min(safe, key=lambda o: max(rank_estimates(o, stages, ring_time, forward_share)))  # first of equals
    best.unaligned = result.unaligned
    return best


def rank_estimates(
    ordered: Ordered,
    stages: int,
    ring_time: dict[int, float],
    forward_share: float = FORWARD_SHARE,
    chunks: int = 1,
    known: dict | None = None,
    limit: float = math.inf,
) -> list[float] | Longer:
    """Estimated seconds per rank. Without pipelines: its clock (micro-batches back to back,
    each ring starting when its last member reaches it). With pipelines: its finish when
    every rank runs 1F1B and rings start on each stage when all members are ready there
    (``pipelined_finish_times``; a ring counts its slowest member's time), which is how the
    simulator runs them; with ``chunks`` model chunks per device, the interleaved order, or
    where it deadlocks the shorter slot-aligned one, ``slot_interleaved_orders``: the greedy
    run's or Megatron's fixed schedule, as ``stage_schedule.chunk_schedule`` will choose); an
    order that would deadlock gets each rank's 1F1B makespan
    (``estimate.one_f_one_b_time``) or clock, the longer. With chunks, ``known`` (a dict)
    receives each order evaluated, for ``stage_schedule.chunk_schedule`` to reuse: None (the
    interleaved order) or (slot_times, megatron, shift) -> (orders, finish). ``limit``: a
    step the caller already has; the slot-aligned orders' walks stop once they are bound to be
    longer (they cannot deadlock, ``slot_interleaved_orders``, so one stopped is longer
    whatever follows), and so does the default order's where every ring is the same
    micro-batch of all its members (``rings_at_one_index``: it cannot deadlock either; the
    level orders of ``order_by_level``); where every order the estimate could come from is
    longer, this is ``Longer(limit)`` (``known`` then holds ``Longer`` for the orders stopped)."""
    if stages <= 1:
        return list(ordered.clock)
    rings, seconds, counts = ordered_item_arrays(ordered, ring_time)
    # the graph's arrays, made once from the items' arrays for every order evaluated; the
    # lists of keys and times only where the contract's walk or the slot orders read them
    pipes = None
    if not is_small(rings.size, stages, chunks):
        pipes = PipelineArrays.of_rings(rings, seconds, counts, stages, forward_share, chunks)
    lists = []

    def keys_and_times():
        if not lists:
            lists[:] = run_lists(rings, seconds, counts)
        return lists

    def finish_of(orders, bound=math.inf):
        if pipes is not None and (orders is None or isinstance(orders, ArrayOrders)):
            return finish_times(pipes, orders, bound)
        return pipelined_finish_times(*keys_and_times(), stages, forward_share, orders, chunks)

    known = {} if known is None else known
    # walked to the end where it might deadlock (whether it does decides what follows); where
    # it cannot, an order longer than the caller's step loses whatever follows: stopped there
    # (checked only where there is a step to stop at)
    safe = math.isfinite(limit) and pipes is not None and rings_at_one_index(rings, counts)
    finish = finish_of(None, limit if safe else math.inf)
    known[None] = (None, finish)
    if isinstance(finish, Longer):
        return finish
    if finish is None and chunks > 1:  # the slot-aligned interleaved orders are safe where rings share slots
        keys, times = keys_and_times()
        offsets = slot_offsets(keys)
        # Megatron's first (the shorter on most batches), so that the other's walk may stop
        # at its step; the first of (not Megatron, Megatron) wins a tie, as in that order
        found = {}
        for megatron in (True, False):
            orders = (
                None
                if offsets is None
                else slot_interleaved_orders(
                    keys, times, stages, chunks, forward_share, megatron=megatron, offsets=offsets
                )
            )
            bound = limit if finish is None else min(limit, max(finish))
            found[megatron] = None if orders is None else finish_of(orders, bound)
            known[False, megatron, 0] = (orders, found[megatron])
            if isinstance(found[megatron], list) and (
                finish is None
                or max(found[megatron]) < max(finish)
                or (not megatron and max(found[megatron]) == max(finish))
            ):
                finish = found[megatron]
        if finish is None and any(isinstance(f, Longer) for f in found.values()):
            return Longer(limit)
    if finish is not None:
        return finish
    return [
        max(clock, one_f_one_b_time(t, stages, forward_share)) for clock, t in zip(ordered.clock, keys_and_times()[1])
    ]


def rings_at_one_index(rings: np.ndarray, counts: Sequence[int]) -> bool:
    """Whether every ring is the same micro-batch (index) of all its members (``rings``,
    ``counts``: ``item_arrays``'). Then the default orders (1F1B, Megatron's interleaved one)
    cannot deadlock: each rank's is one order, that of the largest count, cut down to its own
    micro-batches, so every edge of the pipelines' graph maps onto a path of one pipeline's,
    which has no cycle (docs/design.md, "Virtual pipeline stages")."""
    at = np.flatnonzero(rings >= 0)
    if not at.size:
        return True
    index = np.arange(rings.size) - np.repeat(np.cumsum(counts) - counts, counts)  # within its rank
    ring, index = rings[at], index[at]
    seen = np.full(int(ring.max()) + 1, -1, dtype=np.int64)
    seen[ring] = index  # one member's index per ring (the last written)
    return bool(np.array_equal(seen[ring], index))


def item_arrays(
    runs: Sequence[Sequence[Item]], ring_time: dict[int, float]
) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Every rank's items one after the other as arrays: each item's ring (-1: local work) and
    seconds (a ring's from ``ring_time``), and each rank's count: ``unit_keys`` and the times
    ``rank_estimates`` reads, without a Python step per item (~6 x 10^4 items a 512M-token step)."""
    local, ring_items, local_items = _split_items(list(chain.from_iterable(runs)))
    rings = np.full(local.size, -1, dtype=np.int64)
    rings[~local] = ring_items
    seconds = np.empty(local.size)
    seconds[~local] = np.fromiter(map(ring_time.__getitem__, ring_items), dtype=np.float64, count=len(ring_items))
    seconds[local] = np.fromiter(map(_time_of, local_items), dtype=np.float64, count=len(local_items))
    return rings, seconds, list(map(len, runs))


def run_lists(rings: np.ndarray, seconds: np.ndarray, counts: list[int]) -> tuple[list, list]:
    """``item_arrays``' arrays as the lists the contract's walk and the slot orders read: per
    rank, each item's ring (None: local work, ``unit_keys``) and its seconds."""
    keys = [None if k < 0 else k for k in rings.tolist()]
    times = seconds.tolist()
    bounds = list(accumulate(counts, initial=0))
    return [keys[a:b] for a, b in pairwise(bounds)], [times[a:b] for a, b in pairwise(bounds)]


def ordered_item_arrays(ordered: Ordered, ring_time: dict[int, float]) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """``item_arrays(ordered.runs, ring_time)``, from ``Ordered.items`` where a compiled pass
    left them (the rings' seconds looked up once per ring)."""
    if ordered.items is None:
        return item_arrays(ordered.runs, ring_time)
    rings, seconds = ordered.items
    seconds = seconds.copy()
    at = np.flatnonzero(rings >= 0)
    if at.size:  # every ring's seconds by its unit, looked up in one table
        units = np.fromiter(ring_time.keys(), np.int64, len(ring_time))
        table = np.full(max(int(rings[at].max()), int(units.max(initial=-1))) + 1, np.nan)
        table[units] = np.fromiter(ring_time.values(), np.float64, len(ring_time))
        seconds[at] = table[rings[at]]
        if np.isnan(seconds[at]).any():
            raise KeyError(f"rings without a time: {sorted(set(rings[at][np.isnan(seconds[at])].tolist()))[:5]}")
    return rings, seconds, list(map(len, ordered.runs))


def _split_items(items: list[Item]) -> tuple[np.ndarray, list[int], list[LocalBatch]]:
    """Which items are local micro-batches (a mask), the others (rings) and those, each in
    order, without a Python branch per item. (``type is``: the planner makes LocalBatch
    itself; anything else is a ring, which must convert to an int.)"""
    is_local = [type(x) is LocalBatch for x in items]
    local = np.array(is_local, dtype=bool)
    return local, list(compress(items, (~local).tolist())), list(compress(items, is_local))


_time_of = attrgetter("time")


def order_by_level(
    runs: Sequence[Sequence[Item]],
    ring_order: Sequence[int],
    members: dict[int, tuple[int, ...]],
    ring_time: dict[int, float],
    ranks_per_node: int = 1,
    arrays: RunArrays | None = None,
) -> Ordered | None:
    """The rings placed again at levels (``_place_by_level``: every member of a ring has run
    as many rings before it, local micro-batches after a rank's last ring) and timed like
    ``order_runs``' result, ``Ordered.members`` holding the new members; None if no placement
    fits. Each ring takes one slot on all its members (its level), so 1F1B cannot deadlock
    (docs/design.md, "Pipeline order"; tests/test_planner_pipeline.py checks it), also where
    the schedule's placement admits no slot alignment (rings over most ranks, little short
    work between them); the long rings run back to back on all their members. ``arrays``:
    ``run_arrays(runs)``, where the caller has it."""
    placed = _place_by_level(runs, ring_order, members, ring_time, ranks_per_node, arrays or run_arrays(runs))
    if placed is None:
        return None
    runs_by_level, new_members, order, clock, items = placed
    if clock is None:  # no local work before a ring: rings one after another, then the rest
        again = _sequential(runs_by_level, order, new_members, ring_time)
    else:
        again = Ordered(runs_by_level, clock)
    again.members = new_members
    again.items = items
    return again


def _place_by_level(runs, ring_order, members, ring_time, ranks_per_node: int, arrays: RunArrays):
    """Place every ring again so that all its members have run the same number of rings
    before it; local micro-batches run after a rank's last ring. Rings go largest first,
    each to the least-loaded ranks at one level (a ring that fits a node, inside one node),
    so the level its members reach holds at least as many ranks as any later ring needs
    (node bounds aside: then None). Returns the runs, the new members, the ring order,
    where numba is, each rank's clock as ``_sequential`` gives it for these runs (the rings'
    clocks compiled, ``compiled.ring_clocks``; else None), and the runs' ``Ordered.items``.
    ``arrays``: ``run_arrays(runs)``."""
    n = len(runs)
    # each rank's local micro-batches, in run order: its slice of the pool
    bounds_local = arrays.local_bounds()
    pool, times_local = arrays.pool, arrays.local_time.tolist()
    locals_ = [pool[a:b] for a, b in pairwise(bounds_local)]
    load = np.array([sum(times_local[a:b]) for a, b in pairwise(bounds_local)])  # locals run last, but count
    order = sorted(ring_order, key=lambda u: -len(members[u]))  # stable: schedule order among equals
    rpn = max(1, min(ranks_per_node, n))
    sizes = np.fromiter((len(members[u]) for u in order), dtype=np.int64, count=len(order))
    times = np.fromiter((ring_time[u] for u in order), dtype=np.float64, count=len(order))
    kernel = compiled.level_placement()
    flat, placed = (kernel or _level_placement)(load, sizes, times, rpn)
    if placed < len(order):
        return None
    # each ring's members: its slice of ``flat``; each rank's rings in the order placed (a
    # stable sort of the placements by rank)
    ends = np.cumsum(sizes).tolist()
    chosen = flat.tolist()
    new_members = {u: tuple(chosen[a:b]) for u, a, b in zip(order, [0, *ends], ends)}
    by_rank = np.argsort(flat, kind="stable")
    ring_of = np.repeat(np.asarray(order, dtype=np.int64), sizes)[by_rank].tolist()
    bounds = [0, *np.cumsum(np.bincount(flat, minlength=n)).tolist()]
    runs_by_level = [ring_of[bounds[r] : bounds[r + 1]] + locals_[r] for r in range(n)]
    # the items' arrays: each rank's rings, then its local work
    rings_per_rank = np.diff(bounds)
    local_counts = np.diff(bounds_local)
    before = np.cumsum(rings_per_rank + local_counts) - local_counts  # each rank's first local item
    local_at = np.repeat(before - np.cumsum(local_counts) + local_counts, local_counts) + np.arange(local_counts.sum())
    item_rings = np.full(len(flat) + int(local_counts.sum()), -1, dtype=np.int64)
    ring_at = np.ones(item_rings.size, dtype=bool)
    ring_at[local_at] = False
    item_rings[ring_at] = ring_of
    seconds = np.full(item_rings.size, np.nan)
    seconds[local_at] = arrays.local_time
    clock = None
    if (ring_clocks := compiled.ring_clocks()) is not None:
        clock = ring_clocks(flat, sizes, times, n).tolist()
        for r, (a, b) in enumerate(pairwise(bounds_local)):  # then the local work, summed in run order
            c = clock[r]
            for t in times_local[a:b]:
                c += t
            clock[r] = c
    return runs_by_level, new_members, order, clock, (item_rings, seconds)


def _level_placement(load: np.ndarray, sizes: np.ndarray, times: np.ndarray, rpn: int):
    """``compiled._level_placement`` level by level with numpy (``_level_pick``), the same
    picks and floats: where numba is missing, and what the tests check the kernel against."""
    n = load.size
    load = load.copy()
    level = np.zeros(n, dtype=np.int64)
    # node by node (whole nodes: the planner's rank counts are, RingPlacer checks it): rows of
    # ``by_node`` are nodes
    by_node = np.arange(n).reshape(n // rpn, rpn)
    out = []
    for u, size in enumerate(sizes.tolist()):
        chosen = _level_pick(load, level, size, by_node)
        if chosen is None:
            return np.concatenate(out or [np.zeros(0, dtype=np.int64)]), u
        out.append(chosen)
        load[chosen] = load[chosen].max() + times[u]
        level[chosen] += 1
    return np.concatenate(out or [np.zeros(0, dtype=np.int64)]), sizes.size


def _level_pick(load: np.ndarray, level: np.ndarray, size: int, by_node: np.ndarray) -> np.ndarray | None:
    """``_place_by_level``'s ranks for a ring of ``size``, in rank order, or None: at each
    level, ranks at that level (a ring larger than a node: whole nodes of the level first,
    then the fullest part-nodes, ties to the least busy, then the lower node; else inside one
    node, its least-loaded ranks of the level, ties to lower ranks); of all picks the one
    that starts first, then leaves its members least idle, then the lower level and node.
    Every choice is made for all nodes (rows of ``by_node``) at once."""
    rpn = by_node.shape[1]
    best = None
    load2, level2 = load.reshape(by_node.shape), level.reshape(by_node.shape)
    for lv in np.unique(level).tolist():
        here = level2 == lv
        count = here.sum(axis=1)
        if size > rpn:
            if count.sum() < size:
                continue
            # nodes by (-ranks at the level, busiest of them, first of them), as a stable sort
            busiest = np.where(here, load2, -np.inf).max(axis=1)
            first = by_node[:, 0] + here.argmax(axis=1)  # global rank
            nodes = np.flatnonzero(count)
            nodes = nodes[np.lexsort((first[nodes], busiest[nodes], -count[nodes]))]
            chosen = np.sort(by_node[nodes][here[nodes]][:size])  # row by row: each node's in rank order
            loads = load[chosen][None, :]
        else:
            nodes = np.flatnonzero(count >= size)
            if not nodes.size:
                continue
            least = np.argsort(np.where(here[nodes], load2[nodes], np.inf), axis=1, kind="stable")[:, :size]
            chosen = np.sort(np.take_along_axis(by_node[nodes], least, axis=1), axis=1)
            loads = load[chosen]
        # per pick: (start, idle of the members that wait); the first least wins (the loads
        # summed in rank order, as the compiled kernel does: a cumulative sum, not numpy's pairwise)
        start = loads.max(axis=1)
        idle = start * size - np.cumsum(loads, axis=1)[:, -1]
        k = int(np.lexsort((np.arange(start.size), idle, start))[0])
        key = (float(start[k]), float(idle[k]), lv)
        if best is None or key < best[0]:
            best = (key, chosen if chosen.ndim == 1 else chosen[k])
    return None if best is None else best[1]


def _deadlock_of(runs: Sequence[Sequence[Item]], stages: int) -> str | None:
    """Where 1F1B over ``runs`` gets stuck, or None (the contract's walk: slow on large
    plans, for the message; ``_deadlocks`` answers yes or no)."""
    return find_pipeline_deadlock(unit_keys(runs), stages)


def _deadlocks(runs: Sequence[Sequence[Item]], stages: int) -> bool:
    """Whether 1F1B over ``runs`` deadlocks: the planner's graph walk (compiled where numba
    is), which finds a cycle exactly where the contract's does (tests/test_pipeline_fast_paths.py)."""
    keys = unit_keys(runs)
    return pipelined_finish_times(keys, [[1.0] * len(run) for run in keys], stages, FORWARD_SHARE) is None


def unit_keys(runs: Sequence[Sequence[Item]]) -> list[list[int | None]]:
    """Per rank and item: its ring unit, None for local work (``find_pipeline_deadlock``'s keys)."""
    return [[None if isinstance(x, LocalBatch) else x for x in run] for run in runs]


def _sequential(runs, ring_order, members, ring_time) -> Ordered:
    """Without pipelines every rank runs its items as the schedule gave them: only the
    clocks are computed (what ``_in_schedule_order`` gives for one stage, in one pass over
    the items instead of one pass over a member's queue per ring)."""
    n = len(runs)
    out = [list(run) for run in runs]
    clock = [0.0] * n
    pos = [0] * n
    for u in ring_order:
        ring = members[u]
        start = 0.0
        for r in ring:
            run, i, c = out[r], pos[r], clock[r]
            while run[i] != u:  # the rank's local micro-batches before this ring
                c += run[i].time
                i += 1
            pos[r], clock[r] = i + 1, c
            if c > start:
                start = c
        end = start + ring_time[u]
        for r in ring:
            clock[r] = end
    for r in range(n):
        run, c = out[r], clock[r]
        for x in run[pos[r] :]:
            c += x.time
        clock[r] = c
    return Ordered(out, clock)


def _in_schedule_order(runs, ring_order, members, ring_time) -> Ordered:
    state = _State(runs, None, ring_time)
    result = Ordered(state.out, state.clock)
    for u in ring_order:
        ring = members[u]
        state.place(u, ring, {r: state.natural(r, u) for r in ring}, ring_time[u], result)
    state.finish()
    return result


def _aligned(
    runs,
    ring_order,
    members,
    ring_time,
    split,
    lookahead,
    frugal: bool = False,
    stop_unaligned: bool = False,
    arrays: RunArrays | None = None,
) -> Ordered:
    fast = _aligned_compiled(runs, ring_order, members, ring_time, split, lookahead, frugal, stop_unaligned, arrays)
    if fast is not None:
        return fast
    state = _State(runs, split, ring_time, frugal)
    result = Ordered(state.out, state.clock)
    pending = list(ring_order)
    while pending:
        # the first ring (in schedule order) that can take one slot from what its members
        # have; if none of the next few can, the first takes local work from other ranks
        for k, u in enumerate(pending[:lookahead]):  # noqa: B007 - k is read after the loop
            take = state.aligned_take(u, members[u], result, borrow=False)
            if take is not None:
                break
            if stop_unaligned and len(members[u]) >= WIDE_RING and state.hopeless(u, members[u]):
                result.unaligned.append(u)  # it would end the pass when its turn came
                return result
        else:
            k, u = 0, pending[0]
            take = state.aligned_take(u, members[u], result, borrow=True)
            if take is None:  # no local work left anywhere: this ring cannot be aligned
                result.unaligned.append(u)
                if stop_unaligned:
                    return result
                take = state.unaligned_take(u, members[u])
        result.reordered += k > 0
        del pending[k]
        state.place(u, members[u], take, ring_time[u], result)
    state.finish()
    return result


def _aligned_compiled(
    runs, ring_order, members, ring_time, split, lookahead, frugal: bool, stop_unaligned: bool, arrays=None
) -> Ordered | None:
    """``_aligned`` by the compiled pass (``compiled_alignment``): the same ``Ordered``, its
    split packs new ``LocalBatch``es like those ``split`` gives. None where numba is missing
    or ``split`` is not the planner's ``PackSplitter`` (the Python pass then runs).
    ``arrays``: ``run_arrays(runs)``, where the caller has it."""
    kernel = compiled_alignment.aligned_pass()
    if kernel is None or not (split is None or isinstance(split, PackSplitter)):
        return None
    n = len(runs)
    arrays = arrays or run_arrays(runs)
    flat, lengths, pool, sizes, seqs = arrays.codes, arrays.counts, arrays.pool, arrays.local_size, arrays.seqs
    supply = int(sizes.sum())
    room = len(pool) + 2 * supply  # two halves per split, at most one split per sequence
    plen = np.zeros(room, dtype=np.int64)
    plen[: len(pool)] = sizes
    pstart = np.zeros(room, dtype=np.int64)
    pstart[1 : len(pool)] = np.cumsum(sizes)[:-1]
    ptime = np.zeros(room)
    ptime[: len(pool)] = arrays.local_time
    proot = np.arange(room, dtype=np.int64)
    order = np.asarray(ring_order, dtype=np.int64)
    units = int(order.max(initial=-1)) + 1
    times = np.zeros(units)
    times[order] = [ring_time[u] for u in ring_order]
    counts = np.zeros(units + 1, dtype=np.int64)
    counts[order + 1] = [len(members[u]) for u in ring_order]
    mptr = np.cumsum(counts)
    # each ring's members at mptr[u]:mptr[u + 1], the rings in index order
    mem = np.fromiter(chain.from_iterable(map(members.__getitem__, sorted(ring_order))), np.int64, int(mptr[-1]))
    if split is None:
        lens, coef, layers, recomputed, recomputed_attention = np.zeros(1, dtype=np.int64), np.zeros(4), 1, 0, 0
    else:
        c = split.cost
        lens = lengths_array(split.lens)
        coef = np.array([c.a1, c.b1, c.g, c.forward_share])
        layers, recomputed, recomputed_attention = c.num_layers, c.recomputed_layers, c.recomputed_attention_layers
    rows = np.repeat(np.arange(n), lengths)
    cols = np.arange(flat.size) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    cap = int(lengths.max(initial=0)) + ROW_ROOM
    while True:  # a row that fills up: again with longer rows (rows grow by splits and gifts)
        q = np.zeros((n, cap), dtype=np.int64)
        q[rows, cols] = flat
        pool_arrays = ptime.copy(), pstart.copy(), plen.copy(), proot.copy()
        halves = seqs.copy()
        status, log_rank, log_item, state, clock, counters, unaligned = kernel(
            q, lengths.copy(), *pool_arrays, len(pool), halves, lens, times, mptr, mem, order, coef, layers,
            recomputed, recomputed_attention, split is not None, lookahead, frugal, stop_unaligned, WIDE_RING,
        )  # fmt: skip
        if status != compiled_alignment.FULL:
            break
        cap = max(2 * cap, 1)
    # the split packs' halves as LocalBatches (those placed), then each rank's items in order
    new_time, new_start, new_len, new_root = pool_arrays
    placed = int(state[0])
    ranks, codes = log_rank[:placed], log_item[:placed]
    table: list[Item | None] = [*pool, *[None] * (int(state[1]) - len(pool))]
    for k in np.unique(-1 - codes[codes < -len(pool)]).tolist():
        at = int(new_start[k])
        seq_ids = tuple(halves[at : at + int(new_len[k])].tolist())
        table[k] = LocalBatch(seq_ids, pool[int(new_root[k])].ratio, float(new_time[k]))
    # code x looked up at x + len(table): table[~x] for a local micro-batch, x for a ring
    lookup = [*reversed(table), *range(units)]
    in_order = codes[np.argsort(ranks, kind="stable")]
    placed_items = list(map(lookup.__getitem__, (in_order + len(table)).tolist()))
    bounds = np.cumsum(np.bincount(ranks, minlength=n)).tolist()
    out = [placed_items[a:b] for a, b in zip([0, *bounds[:-1]], bounds)]
    pulled, deferred, splits, moved, reordered = counters.tolist()
    # the items' arrays: a local item's seconds are its LocalBatch's (the pool's own, or a
    # split half's from the pass)
    local = in_order < 0
    local_time = np.concatenate((ptime[: len(pool)], new_time[len(pool) : len(table)]))
    seconds = np.full(in_order.size, np.nan)
    seconds[local] = local_time[-1 - in_order[local]]
    items = (np.where(local, -1, in_order), seconds)
    unaligned_rings = unaligned[: int(state[2])].tolist()
    return Ordered(out, clock.tolist(), pulled, deferred, splits, moved, reordered, unaligned_rings, items=items)


def _slot_search(runs, order, members, split: Splitter | None):
    """Slots for rings from the ring structure alone: each ring, in ``order``, takes the slot
    that opens the fewest gaps on its members: after or before the slots a member holds, or
    in one of its gaps. A rank's gaps must be filled by its own local micro-batches (packs
    may be split); the rest run after its last ring. Returns the runs in slot order and the
    slots, or None."""
    n = len(runs)
    locals_ = [[x for x in run if isinstance(x, LocalBatch)] for run in runs]
    supply = [sum(len(x.seq_ids) for x in batches) if split else len(batches) for batches in locals_]
    used: list[dict[int, int]] = [{} for _ in range(n)]
    span: list[tuple[int, int] | None] = [None] * n
    slots: dict[int, int] = {}

    def fits(r: int, lo: int, hi: int, count: int) -> bool:
        return hi - lo + 1 - count <= supply[r]

    for u in order:
        ring = members[u]
        cands = set()
        for r in ring:
            if span[r] is not None:
                lo, hi = span[r]
                cands.update((lo - 1, hi + 1))
                cands.update(v for v in range(lo + 1, hi) if v not in used[r])
        best = None
        for v in sorted(cands or {0}, reverse=True):  # ties: the latest slot, as the schedule runs
            cost = 0
            for r in ring:
                if span[r] is None:
                    continue
                if v in used[r]:
                    break
                lo, hi = min(span[r][0], v), max(span[r][1], v)
                if not fits(r, lo, hi, len(used[r]) + 1):
                    break
                cost += (hi - lo) - (span[r][1] - span[r][0]) - 1
            else:
                if best is None or cost < best[0]:
                    best = (cost, v)
        if best is None:
            return None
        v = best[1]
        slots[u] = v
        for r in ring:
            used[r][v] = u
            span[r] = (v, v) if span[r] is None else (min(span[r][0], v), max(span[r][1], v))

    out = []
    for r in range(n):
        batches = list(locals_[r])
        if span[r] is None:
            out.append(batches)
            continue
        lo, hi = span[r]
        holes = hi - lo + 1 - len(used[r])
        while len(batches) < holes and split is not None and any(len(x.seq_ids) > 1 for x in batches):
            big = max((x for x in batches if len(x.seq_ids) > 1), key=lambda x: (len(x.seq_ids), x.time))
            _replace(batches, big, list(split(big)))
        run: list[Item] = []
        for v in range(lo, hi + 1):
            if v in used[r]:
                run.append(used[r][v])
            elif batches:
                run.append(batches.pop(0))
        out.append(run + batches)
    return out, slots


class _RankView:
    """What the alignment reads of one rank's queue (``_State.view``): its local micro-batches
    in order and their seconds, how many more splitting its packs gives, its rings in order
    and the local micro-batches before each, the clock after each local micro-batch, and its
    load (clock plus everything queued). Derived from the queue after a split or a borrow;
    after a ring is placed, the view before it changed in place (``advance``: no pass
    over the queue, which was most of the alignment's time at 512M tokens)."""

    __slots__ = ("locals", "times", "rings", "marks", "mark", "shift", "own", "prefix", "load", "queue_times")

    @classmethod
    def of_queue(cls, queue: list[Item], clock: float, ring_time: dict[int, float], split: bool) -> _RankView:
        v = cls()
        v.locals, v.times, v.rings, v.marks, v.queue_times = [], [], [], [], []
        # the lists' appends bound once: this runs for every rank after each split or borrow
        add_local, add_time, add_ring, add_mark, add_queued = (
            v.locals.append,
            v.times.append,
            v.rings.append,
            v.marks.append,
            v.queue_times.append,
        )
        count = 0  # local micro-batches so far
        for x in queue:
            if isinstance(x, LocalBatch):
                add_local(x)
                add_time(x.time)
                add_queued(x.time)
                count += 1
            else:
                add_ring(x)
                add_mark(count)
                add_queued(ring_time[x])
        v.mark = dict(zip(v.rings, v.marks))
        v.shift = 0  # local micro-batches run since the marks were taken
        v.own = sum(len(x.seq_ids) for x in v.locals) - len(v.locals) if split else 0
        v.prefix = list(accumulate(v.times, initial=clock))
        v.load = clock + sum(v.queue_times)  # summed in queue order: the same float as one sum() over it
        return v

    def natural(self, u: int) -> int:
        """Local micro-batches before ring ``u``."""
        return max(0, self.mark[u] - self.shift)

    def own_after(self, take: int, split: bool) -> int:
        """``own`` once the first ``take`` local micro-batches have run."""
        if not split:
            return 0
        return self.own - sum(len(x.seq_ids) for x in self.locals[:take]) + take if take else self.own

    def advance(
        self, queue: list[Item], take: int, u: int, clock: float, ring_time: dict[int, float], split: bool
    ) -> None:
        """This view and ``queue`` (its rank's), in place, once the first ``take`` local
        micro-batches and ring ``u`` have run and the clock reads ``clock``. The queue's head
        up to its ``take``-th local micro-batch holds those and the rings before it (the first
        ``head``: the marks rise along the rings), of which only the rings stay; ``u`` goes
        wherever it is (a ring sits after its natural local micro-batches and the rings
        before it). Nothing else holds the view's lists (``_split_own`` copies before it
        changes one), so they change in place rather than being copied."""
        rings, marks, times = self.rings, self.marks, self.queue_times
        j = rings.index(u)
        head = bisect_left(marks, take + self.shift)
        cut = take + head
        if j >= head:  # u after the head: at its natural local micro-batches plus the rings before it
            i = self.natural(u) + j
            del queue[i], times[i]
        kept = rings[:head]  # most often none
        if j < head:
            del kept[j]
        if kept:
            queue[:cut] = kept
            times[:cut] = [ring_time[x] for x in kept]
        else:
            del queue[:cut], times[:cut]
        del rings[j], marks[j]  # self.mark keeps u: it is not asked again
        self.own = self.own_after(take, split)
        if take:
            del self.locals[:take], self.times[:take]
        self.shift += take
        self.prefix = list(accumulate(self.times, initial=clock))
        self.load = clock + sum(times)  # summed in queue order, as ``of_queue`` does


class _State:
    """The alignment's state: per rank what is left (``queues``), what is placed (``out``),
    the clock and the slot offset. Every change of a queue or a clock goes through
    ``_touch``, so each rank's ``_RankView`` is derived again only after it changed (a large
    ring has ~1,500 members to ask, and a borrowed pack looks at every rank's load)."""

    def __init__(self, runs, split: Splitter | None, ring_time: dict[int, float], frugal: bool = False) -> None:
        n = len(runs)
        self.queues: list[list[Item]] = [list(run) for run in runs]  # per rank: what is left, in schedule order
        self.out: list[list[Item]] = [[] for _ in range(n)]  # per rank: placed, in run order
        self.clock = [0.0] * n  # per rank: estimated end of what is placed
        self.offset: list[int | None] = [None] * n  # per rank: slot of out[r][0]; None until its first ring
        self.split = split
        self.ring_time = ring_time
        self.frugal = frugal  # keep local work for later slots: run no more of it before a ring than needed
        self._views: list[_RankView | None] = [None] * n
        self._placed: dict[int, tuple[_RankView, int, int]] = {}  # rank -> its view before a ring, locals taken, ring
        self._dirty = set(range(n))  # ranks whose view (and _load) are out of date
        self._nloc = np.zeros(n, dtype=np.int64)  # per rank: local micro-batches queued
        self._load = np.zeros(n)  # per rank: _RankView.load
        self._own = np.zeros(n, dtype=np.int64)  # per rank: _RankView.own
        # ranks whose _nloc and _own are out of date (``_missing`` brings a placed rank's up
        # to date from its view before the ring, without deriving the view)
        self._stale = np.ones(n, dtype=bool)
        self._cursor = np.zeros(n, dtype=np.int64)  # per rank: ``cursor`` once it has a slot offset (kept by ``place``)
        self._fixed = np.zeros(n, dtype=bool)  # per rank: has a slot offset (its first ring is placed)
        self._ring_arrays: dict[int, np.ndarray] = {}  # wide ring -> its members as an array
        # for ``hopeless``: the sequences in local micro-batches not yet run (splits and
        # borrows keep the count), and per rank the rings not yet placed
        self._supply = sum(len(x.seq_ids) for q in self.queues for x in q if isinstance(x, LocalBatch))
        self._rings_left = [sum(1 for x in q if not isinstance(x, LocalBatch)) for q in self.queues]
        # Rings whose members cannot give them one slot from their own work, until one of the
        # members changes (a large ring stays first in the schedule while the rings after it
        # are placed: without this it is tried again, over all its members, before each)
        self._stuck: set[int] = set()
        self._stuck_by_rank: dict[int, list[int]] = defaultdict(list)

    def _touch(self, r: int) -> None:
        self._dirty.add(r)
        self._stale[r] = True
        for u in self._stuck_by_rank.pop(r, ()):
            self._stuck.discard(u)

    def _touch_all(self, ranks, idx: np.ndarray | None = None) -> None:
        """``_touch`` for each of ``ranks`` (``idx``: them as an array, for one numpy store)."""
        self._dirty.update(ranks)
        if idx is None:
            for r in ranks:
                self._stale[r] = True
        else:
            self._stale[idx] = True
        by_rank, stuck = self._stuck_by_rank, self._stuck
        if by_rank:
            for r in ranks:
                for u in by_rank.pop(r, ()):
                    stuck.discard(u)

    def view(self, r: int) -> _RankView:
        if r in self._dirty:
            placed = self._placed.pop(r, None)
            if placed is not None:  # the queue and the view after a ring, from the view before it
                v, take, u = placed
                v.advance(self.queues[r], take, u, self.clock[r], self.ring_time, self.split is not None)
            else:
                v = _RankView.of_queue(self.queues[r], self.clock[r], self.ring_time, self.split is not None)
            # the per-rank counts follow the view (one place: ~2.5 x 10^5 views a 512M step)
            self._views[r] = v
            self._nloc[r] = len(v.locals)
            self._load[r] = v.load
            self._own[r] = v.own
            self._stale[r] = False
            self._dirty.discard(r)
            return v
        return self._views[r]

    def queue(self, r: int) -> list[Item]:
        """Rank ``r``'s queue, brought up to date (a placed ring leaves it to ``view``)."""
        if r in self._placed:
            self.view(r)
        return self.queues[r]

    def finish(self) -> None:
        """What is left of every queue (local micro-batches) runs after the last ring."""
        for r in range(len(self.queues)):
            q = self.queue(r)
            for x in q:
                self.out[r].append(x)
                self.clock[r] += x.time
            q.clear()
            self._touch(r)

    def locals_of(self, r: int) -> list[LocalBatch]:
        return self.view(r).locals

    def natural(self, r: int, u: int) -> int:
        """Local micro-batches the schedule puts before ring ``u`` on rank ``r``."""
        return self.view(r).natural(u)

    def cursor(self, r: int) -> int:
        return self.offset[r] + len(self.out[r])

    def aligned_take(self, u: int, ring, result: Ordered, borrow: bool) -> dict[int, int] | None:
        """Local micro-batches each member runs before ring ``u`` so that the ring takes one
        slot on all of them, or None if the members do not have enough."""
        if not borrow:
            if u in self._stuck:
                return None  # as before: no member changed since
            if len(ring) >= WIDE_RING and self._missing(u, ring):
                self._remember_stuck(u, ring)
                return None
        offset, out, view = self.offset, self.out, self.view
        cursor = {}  # the members that hold slots (in ring order): their next slot
        for r in ring:
            if offset[r] is not None:
                cursor[r] = offset[r] + len(out[r])
        views = {r: view(r) for r in ring}
        lo = max(cursor.values(), default=0)
        shorts = {r: lo - c - len(views[r].locals) for r, c in cursor.items()}
        missing = sum(max(0, k - views[r].own) for r, k in shorts.items())
        if missing and not borrow:
            self._remember_stuck(u, ring)
            return None  # not even by splitting packs: leave everything as it is
        reserve = None  # per rank, what a member keeps to reach slot lo itself (cursors stay put here)
        if missing:
            reserve = np.zeros(len(self.queues), dtype=np.int64)
            for r, c in cursor.items():
                reserve[r] = max(0, lo - c)
            if missing > self._spare(reserve):
                return None  # not even by borrowing
        if any(short > 0 for short in shorts.values()):
            cands = {r: views[r].locals for r in ring}
            for r, short in shorts.items():
                if short > 0:
                    short = self._split_own(r, short, cands, result)
                if short > 0 and borrow:
                    short = self._borrow(r, short, u, ring, reserve, cands, result)
                if short > 0:
                    return None
            views = {r: view(r) for r in ring}  # splits and borrows changed some
        # else no member split or borrowed: the views stand, their locals are the candidates
        planned = max(v.prefix[v.natural(u)] for v in views.values())  # start without alignment
        slack = planned * (1 + 1e-12)
        take = {}
        if cursor:
            hi = min(c + len(views[r].locals) for r, c in cursor.items())
            shifted = [(views[r].prefix, c) for r, c in cursor.items()]

            def start(slot: int) -> float:
                return max(p[slot - c] for p, c in shifted)

            # start(slot) never falls as the slot rises: the largest slot whose start is no
            # later than planned (bisection over [lo, hi]), else the earliest start possible
            a, b = lo, hi
            if not self.frugal and start(lo) <= slack:
                while a < b:
                    mid = (a + b + 1) // 2
                    if start(mid) <= slack:
                        a = mid
                    else:
                        b = mid - 1
            for r, c in cursor.items():
                take[r] = a - c
            slack = max(slack, start(a))
        for r in ring:  # a member without rings yet may start at any slot: it fills the wait
            if r not in take:
                take[r] = 0 if self.frugal else bisect_right(views[r].prefix, slack) - 1
        return take

    def _remember_stuck(self, u: int, ring) -> None:
        """Ring ``u`` cannot take a slot from its members' own work, a function of their
        state alone: remembered until one of them changes (``_touch``)."""
        self._stuck.add(u)
        for r in ring:
            self._stuck_by_rank[r].append(u)

    def _members_array(self, u: int, ring) -> np.ndarray:
        """Ring ``u``'s members as an array (made once per wide ring)."""
        idx = self._ring_arrays.get(u)
        if idx is None:
            idx = self._ring_arrays[u] = np.fromiter(ring, dtype=np.int64, count=len(ring))
        return idx

    def _missing(self, u: int, ring) -> int:
        """``aligned_take``'s shortfall of ring ``u`` (local micro-batches its fixed members
        lack to reach the latest member's slot, beyond what splitting their packs gives),
        from the per-rank counts: the same integers, without a view per member."""
        idx = self._members_array(u, ring)
        stale = self._stale[idx]
        if stale.any():
            split = self.split is not None
            for r in idx[stale].tolist():
                placed = self._placed.get(r)
                if placed is None:
                    self.view(r)
                else:  # what the view after the ring will say, without deriving it
                    v, take, _ = placed
                    self._nloc[r] = len(v.locals) - take
                    self._own[r] = v.own_after(take, split)
                    self._stale[r] = False
        fixed = idx[self._fixed[idx]]
        if not fixed.size:
            return 0
        cursor = self._cursor[fixed]
        short = int(cursor.max()) - cursor - self._nloc[fixed] - self._own[fixed]
        return int(short[short > 0].sum())

    def hopeless(self, u: int, ring) -> bool:
        """True if ring ``u`` can no longer take one slot on all its members, however the
        rings still queued are placed and local work moves. With F its members that hold
        slots (cursors c_r, latest lo) and S the sequences left in local micro-batches on
        all ranks, phi = |F| lo - sum c_r - S = E - R, with E the shortfall ``aligned_take``
        counts and R what splits and borrows could still give F (what the other ranks hold,
        and F's own beyond their slot; ``_spare`` gives at most R). A split or a borrow
        leaves phi as it is (S counts sequences, not micro-batches); placing another ring
        lowers it by at most its members in F (each gains one slot), and nothing else lowers
        it. So while phi exceeds the places of other queued rings on ``u``'s members, E > R
        >= spare whenever ``u`` is tried: it stays unaligned. A pass that stops at the
        first unaligned ring can stop here."""
        idx = self._members_array(u, ring)
        fixed = idx[self._fixed[idx]]
        if not fixed.size:
            return False
        cursor = self._cursor[fixed]
        phi = fixed.size * int(cursor.max()) - int(cursor.sum()) - self._supply
        if phi <= 0:
            return False
        left = self._rings_left
        return phi > sum(left[r] for r in ring) - len(ring)

    def _refresh(self) -> None:
        for r in list(self._dirty):
            self.view(r)

    def _spare(self, reserve: np.ndarray) -> int:
        """Local micro-batches other ranks could give to the members of a ring, each member
        keeping its ``reserve``."""
        self._refresh()
        have = self._nloc - reserve
        giving = have > 0
        return int(have[giving].sum() + self._own[giving].sum())

    def unaligned_take(self, u: int, ring) -> dict[int, int]:
        fixed = [r for r in ring if self.offset[r] is not None]
        lo = max((self.cursor(r) for r in fixed), default=0)
        return {r: min(len(self.locals_of(r)), max(0, lo - self.cursor(r))) if r in fixed else 0 for r in ring}

    def place(self, u: int, ring, take: dict[int, int], seconds: float, result: Ordered) -> None:
        view, out, offset = self.view, self.out, self.offset
        before = [view(r) for r in ring]
        start, pulled, deferred, ran_seqs = 0.0, 0, 0, 0
        for r, v in zip(ring, before):
            t, nat = take[r], v.natural(u)
            if t > nat:
                pulled += t - nat
            else:
                deferred += nat - t
            if t:
                ran = v.locals[:t]
                out[r] += ran
                ran_seqs += sum(len(x.seq_ids) for x in ran)
            end = v.prefix[t]  # the member's clock after them: the same sums, in the same order
            if end > start:
                start = end
        result.pulled += pulled
        result.deferred += deferred
        self._supply -= ran_seqs
        slot = max((offset[r] + len(out[r]) for r in ring if offset[r] is not None), default=0)
        end = start + seconds
        clock, left, placed = self.clock, self._rings_left, self._placed
        for r, v in zip(ring, before):
            left[r] -= 1
            if offset[r] is None:
                offset[r] = slot - len(out[r])
            out[r].append(u)
            clock[r] = end
            # derived when next asked for: most members of a large ring are not asked again soon
            placed[r] = (v, take[r], u)
        cursors = [offset[r] + len(out[r]) for r in ring]
        if len(ring) >= WIDE_RING:  # the members' arrays at once
            idx = self._members_array(u, ring)
            self._cursor[idx] = cursors
            self._fixed[idx] = True
        else:
            for r, c in zip(ring, cursors):
                self._cursor[r] = c
                self._fixed[r] = True
        self._touch_all(ring, idx if len(ring) >= WIDE_RING else None)

    def _split_own(self, r: int, short: int, cands, result: Ordered) -> int:
        """Split ``r``'s own packs in two until it has ``short`` more micro-batches."""
        while short > 0 and self.split is not None:
            packs = [x for x in cands[r] if len(x.seq_ids) > 1]
            if not packs:
                break
            big = max(packs, key=lambda x: (len(x.seq_ids), x.time))
            halves = list(self.split(big))
            cands[r] = list(cands[r])  # the view's list stays as it was until the view is derived again
            _replace(cands[r], big, halves)
            _replace(self.queue(r), big, halves)
            self._touch(r)
            result.splits += 1
            short -= 1
        return short

    def _borrow(self, r: int, short: int, u: int, ring, reserve: np.ndarray, cands, result: Ordered) -> int:
        """Take local micro-batches for ``r`` from the most loaded ranks that have some to
        spare (a ring member keeps its ``reserve``, what it needs to reach the slot itself)."""
        members = set(ring)
        while short > 0:
            self._refresh()
            have = self._nloc - reserve
            have[r] = 0
            # the first of the most loaded ranks with a micro-batch to spare
            load = np.where(have > 0, self._load, -np.inf)
            donor = int(np.argmax(load))
            if load[donor] == -np.inf:
                return short
            spare = int(have[donor])
            last = self.locals_of(donor)[-1]  # the shortest: the schedule runs long work first
            if spare == 1 and self.split is not None and len(last.seq_ids) > 1:
                keep, gift = self.split(last)  # the donor keeps half of its only pack
                _replace(self.queue(donor), last, [keep])
                result.splits += 1
            else:
                gift = last
                _replace(self.queue(donor), last, [])
            self._touch(donor)
            if donor in members:
                cands[donor] = self.locals_of(donor)
            self.queue(r).insert(self.queue(r).index(u), gift)  # r runs all it has before the ring
            self._touch(r)
            cands[r] = self.locals_of(r)
            result.moved += 1
            short -= 1
        return short


def _replace(items: list, old, new: list) -> None:
    i = next(i for i, x in enumerate(items) if x is old)
    items[i : i + 1] = new


def _run_one_pipeline(fwd: Sequence[float], bwd: Sequence[float], stages: int, chunks: int) -> list[list[Op]]:
    """Every device's order from running one pipeline of ``len(fwd)`` micro-batches whose
    chunk forwards (backwards) last ``fwd[m] / chunks`` (``bwd[m] / chunks``): forwards in
    groups of ``stages`` micro-batches, each group chunk by chunk (Megatron's sequence),
    backwards in the same order with the chunks reversed; a device runs a ready backward
    first, else its next forward while it holds fewer chunk forwards than Megatron's warm-up
    allows (``2 (stages - 1 - device) + (chunks - 1) stages + 1``). Every device runs its
    forwards (backwards) in one fixed sequence, so two devices agree on the order of the
    messages between them; and the orders are those of a run that completed, so they cannot
    deadlock, whatever the count."""
    count, p, v = len(fwd), stages, chunks
    forwards, backwards = [], []
    for g in range(0, count, p):
        group = range(g, min(g + p, count))
        forwards.extend((m, c) for c in range(v) for m in group)
        backwards.extend((m, c) for c in reversed(range(v)) for m in group)
    last = p * v - 1
    done: dict[tuple[int, int, int], float] = {}  # (direction, micro-batch, virtual stage) -> end
    nf, nb = [0] * p, [0] * p  # next forward / backward per device
    free = [0.0] * p
    orders: list[list[Op]] = [[] for _ in range(p)]
    cap = [2 * (p - 1 - d) + (v - 1) * p + 1 for d in range(p)]
    for _ in range(2 * len(forwards) * p):
        best = None
        for d in range(p):
            cands = []
            if nb[d] < len(backwards):
                m, c = backwards[nb[d]]
                vs = c * p + d
                need = (FORWARD, m, vs) if vs == last else (BACKWARD, m, vs + 1)
                if need in done:
                    cands.append((max(free[d], done[need]), 0, BACKWARD, m, c, vs))
            if nf[d] < len(forwards) and nf[d] - nb[d] < cap[d]:
                m, c = forwards[nf[d]]
                vs = c * p + d
                if vs == 0 or (FORWARD, m, vs - 1) in done:
                    cands.append((max(free[d], done.get((FORWARD, m, vs - 1), 0.0)), 1, FORWARD, m, c, vs))
            for cand in cands:
                if best is None or cand[:2] < best[0][:2]:
                    best = (cand, d)
        if best is None:
            break
        (start, _, direction, m, c, vs), d = best
        end = start + (fwd[m] if direction == FORWARD else bwd[m]) / v
        done[direction, m, vs] = free[d] = end
        orders[d].append(Op(direction, m, c))
        if direction == FORWARD:
            nf[d] += 1
        else:
            nb[d] += 1
    if any(len(o) != 2 * len(forwards) for o in orders):  # cannot happen: the caps admit every warm-up
        raise AssertionError(f"interleaved order for {count} micro-batches over {p} x {v} stages did not complete")
    return orders


def slot_offsets(ring_keys: Sequence[Sequence[object | None]]) -> list[int] | None:
    """Per rank, the offset of its micro-batch indices such that every ring micro-batch sits at
    one slot (index + offset) on all its members (``order_runs``' alignment), the smallest
    offset of each group of ranks joined by rings 0; None if no such offsets exist. Compiled
    (``compiled.slot_offsets``) where the keys are the planner's (integers from 0)."""
    kernel = compiled.slot_offsets()
    if kernel is not None:
        try:
            ids = np.array([-1 if k is None else k for k in chain.from_iterable(ring_keys)])
        except ValueError:  # keys of different shapes (tuples)
            ids = None
        nones = sum(row.count(None) for row in ring_keys)
        if ids is not None and ids.ndim == 1 and ids.dtype.kind == "i" and np.count_nonzero(ids < 0) == nones:
            lens = np.fromiter(map(len, ring_keys), dtype=np.int64, count=len(ring_keys))
            off, ok = kernel(ids.astype(np.int64), lens, int(ids.max(initial=-1)) + 1)
            return off.tolist() if ok else None
    where: dict[object, list[tuple[int, int]]] = defaultdict(list)
    for r, keys in enumerate(ring_keys):
        for i, k in enumerate(keys):
            if k is not None:
                where[k].append((r, i))
    adj: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for ms in where.values():
        r0, i0 = ms[0]
        for r, i in ms[1:]:
            adj[r0].append((r, i0 - i))
            adj[r].append((r0, i - i0))
    off: list[int | None] = [None] * len(ring_keys)
    for s in range(len(ring_keys)):
        if off[s] is not None:
            continue
        off[s] = 0
        todo, comp = [s], [s]
        while todo:
            a = todo.pop()
            for b, d in adj[a]:
                if off[b] is None:
                    off[b] = off[a] + d
                    todo.append(b)
                    comp.append(b)
                elif off[b] != off[a] + d:
                    return None
        low = min(off[c] for c in comp)
        for c in comp:
            off[c] -= low
    return off


def slot_interleaved_orders(
    ring_keys: Sequence[Sequence[object | None]],
    times: Sequence[Sequence[float]],
    stages: int,
    chunks: int,
    forward_share: float = FORWARD_SHARE,
    slot_times: bool = False,
    megatron: bool = False,
    shift: int = 0,
    offsets: list[int] | None = None,
) -> ArrayOrders | None:
    """Interleaved orders that cannot deadlock when rings sit at one slot on all members: the
    order of one long pipeline over all slots (``_run_one_pipeline``; unit times, or with
    ``slot_times`` each slot's longest micro-batch; with ``megatron`` Megatron's fixed
    schedule, ``megatron_interleaved_orders``, its groups of ``stages`` slots starting
    ``shift`` phantom slots before the first), each rank running its own slots' part of it.
    Every operation then has one start time in that run, shared by a ring's members, and
    every device runs its operations in that time order, after all they wait for: no cycle.
    None if the rings admit no slot alignment (``slot_offsets``; ``offsets``: what it gave for
    these keys, where the caller has it)."""
    off = slot_offsets(ring_keys) if offsets is None else offsets
    if off is None:
        return None
    slots = max((o + len(k) for o, k in zip(off, ring_keys)), default=0)
    if megatron:
        full = megatron_interleaved_orders(slots + shift, stages, chunks)
        return _cut_per_rank(full, [o + shift for o in off], ring_keys, stages)
    if slot_times:
        longest = [0.0] * slots
        for o, ts in zip(off, times):
            for i, t in enumerate(ts):
                longest[o + i] = max(longest[o + i], float(t))
        fwd, bwd = [forward_share * t for t in longest], [(1.0 - forward_share) * t for t in longest]
    else:
        fwd, bwd = [1.0] * slots, [2.0] * slots
    return _cut_per_rank(_one_pipeline_rows(fwd, bwd, stages, chunks), off, ring_keys, stages)


def _one_pipeline_rows(fwd: Sequence[float], bwd: Sequence[float], stages: int, chunks: int) -> list:
    """``_run_one_pipeline``'s orders, each device's as (direction, micro-batch, chunk) rows:
    run by ``compiled.one_pipeline`` (the same run), in Python where numba is missing."""
    kernel = compiled.one_pipeline()
    if kernel is None:
        return _run_one_pipeline(fwd, bwd, stages, chunks)
    ops, ran = kernel(np.asarray(fwd, dtype=np.float64), np.asarray(bwd, dtype=np.float64), stages, chunks)
    if (ran != 2 * len(fwd) * chunks).any():  # cannot happen: the caps admit every warm-up
        raise AssertionError(
            f"interleaved order for {len(fwd)} micro-batches over {stages} x {chunks} stages did not complete"
        )
    return list(ops)


def _cut_per_rank(full: list[list[Op]], offsets: Sequence[int], ring_keys, stages: int) -> ArrayOrders:
    """Each rank's part of one long pipeline's orders: the ops of its slots ``[o, o + len)``,
    renumbered from 0 (ranks with the same slots share one array per device)."""
    whole = [np.asarray(order, dtype=np.int64).reshape(-1, 3) for order in full]  # Op lists or rows
    cut: dict[tuple[int, int], list[np.ndarray]] = {}
    per_device = []
    for o, keys in zip(offsets, ring_keys):
        span = (o, len(keys))
        if span not in cut:
            parts = []
            for ops in whole:
                part = ops[(ops[:, 1] >= o) & (ops[:, 1] < o + len(keys))]
                part[:, 1] -= o  # a copy: boolean indexing
                part.flags.writeable = False
                parts.append(part)
            cut[span] = parts
        per_device += cut[span]
    return ArrayOrders(per_device, stages)
