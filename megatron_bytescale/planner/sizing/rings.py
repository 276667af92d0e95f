"""Ring sizes: how many ranks each long sequence gets (design 2.1).

* A sequence of ``s <= C`` tokens (``C``: the capacity) runs whole on one rank.
* A longer sequence gets a ring of ``D`` ranks, any size from 1 to ``d_hdp`` (never rounded
  to a power of two). The memory floor ``D_mem(s)`` comes from the offload policy. The
  balanced modes may use more ranks when the batch asks for it: a ring's members run for
  its share time (``sizing.curves``), and no rank can finish before its longest ring share,
  so a sequence whose share would outlast the step's target time gets the smallest ring that
  fits the target (or the fastest ring, if none does). Its offload ratio is then the
  smallest that fits the smaller share, often 0.

``balanced_target`` picks the step time rings are sized for; ``ring_decisions`` applies it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..cost_model import CostModel
from ..fields import FieldError
from . import two_level
from .curves import ring_curves_of
from .offload import OffloadDecision, decide, ratio_for_ranks


def memory_floor(
    seq_len: int,
    capacity: int,
    cost: CostModel,
    offload: bool,
    num_ranks: int,
    host: int | None = None,
) -> OffloadDecision:
    """D_mem(s) and its ratio (``host``: the host budget in token-equivalents, None: none);
    an error naming the fields to change when even that needs more ranks than there are."""
    d = decide(seq_len, capacity, cost, offload, host)
    if d.ranks > num_ranks:
        fixes = "raise {capacity}, " + ("" if offload else "enable {offload}, ") + "or add GPUs ({num_ranks})"
        if offload and host is not None:
            fixes = "raise {capacity} or {host_memory}, or add GPUs ({num_ranks})"
        raise FieldError(
            f"capacity too small: sequence of {seq_len} tokens needs {d.ranks} ranks at capacity {capacity}"
            f"{' with offloading' if offload else ''}, only {num_ranks} ranks; {fixes}"
        )
    return d


class RingSizer:
    """Ring size and time for each long sequence, for a given target time (cached by length)."""

    def __init__(
        self,
        capacity: int,
        cost: CostModel,
        offload: bool,
        num_ranks: int,
        ranks_per_node: int,
        pipeline_stages: int = 1,
        host: int | None = None,
    ):
        self.capacity = capacity
        self.host = host  # host budget per micro-batch in token-equivalents (None: unbounded)
        # a rank that runs a share alone fills and drains its pipeline with it: p times the
        # share's stage time is what the step target is compared with
        self.stages = pipeline_stages
        self.cost = cost
        self.offload = offload
        self.num_ranks = num_ranks
        self.ranks_per_node = min(ranks_per_node, num_ranks)
        # the curves, computed many lengths at a time: blocks of (sizes, times, two-level group
        # sizes per entry, 1: the plain ring), each length's curve where it sits in its block
        self._blocks: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self._where: dict[int, tuple[int, int, int]] = {}  # length -> (block, start, count)
        self._floors: dict[int, OffloadDecision] = {}
        self._table: _CurveTable | None = None  # the last lengths' curves end to end (balanced_target)
        self._sized: dict[tuple[int, int], tuple[int, float, int]] = {}  # size_arrays' offloading rings
        self.two_level = two_level.valid_splits(cost, self.ranks_per_node) if num_ranks > self.ranks_per_node else []

    def floor(self, seq_len: int) -> OffloadDecision:
        d = self._floors.get(seq_len)
        if d is None:  # asked per length several times a step (range, sizing): decided once
            d = self._floors[seq_len] = memory_floor(
                seq_len, self.capacity, self.cost, self.offload, self.num_ranks, self.host
            )
        return d

    def prepare(self, seq_lens) -> None:
        """The curves of many lengths at once (one ``ring_curves`` pass over all of a step's
        lengths): each from its memory floor up to a few times the size where the ring turns
        communication-bound (``_range_ends``), two-level group sizes where the rings may span
        nodes."""
        todo = [int(s) for s in dict.fromkeys(seq_lens) if int(s) not in self._where]
        if not todo:
            return
        lo = [self.floor(s).ranks for s in todo]
        hi = self._range_ends(todo, lo, 1).tolist()
        wide = self._range_ends(todo, lo, max(self.two_level)).tolist() if self.two_level else hi
        spans = [bool(self.two_level) and b > self.ranks_per_node for b in hi]  # rings that may span nodes
        ends = [w if x else b for b, w, x in zip(hi, wide, spans)]
        sizes, times, splits, counts = ring_curves_of(
            self.cost, todo, lo, ends, spans, self.ranks_per_node, self.two_level
        )
        self._store(todo, counts, sizes, times, splits)

    def _store(self, lengths: list[int], counts, sizes, times, splits) -> None:
        """A block of curves: ``lengths``' end to end."""
        block = len(self._blocks)
        self._blocks.append((sizes, times, splits))
        starts = (np.cumsum(counts) - counts).tolist()
        self._where.update(zip(lengths, zip([block] * len(lengths), starts, counts.tolist())))

    def _entries(self, seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A length's curve: its ring sizes, times and two-level group sizes."""
        if seq_len not in self._where:
            self.prepare((seq_len,))
        block, start, count = self._where[seq_len]
        return tuple(a[start : start + count] for a in self._blocks[block])

    def _range_ends(self, seq_lens: list[int], d_min: list[int], reach: int) -> np.ndarray:
        """The largest ring size each length's curve covers: beyond ~ a1 s bw / bytes-per-token
        ranks a ring is communication-bound (more ranks only add hops), so a few times past that
        point (and ``reach`` times further for two-level rings, whose hops meet ``reach`` x the
        compute), at least the memory floor ``d_min``, at most the ranks and the tokens."""
        cost = self.cost
        per_token = 2 * cost.kv_bytes_per_token + cost.grad_bytes_per_token
        s = np.array(seq_lens, dtype=np.int64)
        # a ring size, not a time: where a step's attention a1 s^2 / N^2 meets its hop's bytes
        comm_bound = cost.a1 * s.astype(np.float64) * cost.bw_inter_node / max(per_token, 1e-30)
        x = 4 * comm_bound
        if reach != 1:
            x = x * reach
        # int(): toward zero; capped first, as free hops (no KV bytes) make x astronomically
        # large, which int() keeps but int64 cannot hold (both end at min(ranks, s) below)
        ahead = np.trunc(np.minimum(x, 2.0**62)).astype(np.int64) + 2 * self.ranks_per_node
        return np.minimum(np.minimum(self.num_ranks, s), np.maximum(np.array(d_min, dtype=np.int64), ahead))

    def curve(self, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
        """Candidate ring sizes (from the memory floor up to where communication dominates)
        and the share time of each."""
        sizes, times, _ = self._entries(seq_len)
        return sizes, times

    def heads_split(self, seq_len: int, ring_size: int) -> int:
        """The two-level group size the curve chose for this ring size (1: plain ring)."""
        sizes, _, splits = self._entries(seq_len)
        k = ring_size - int(sizes[0])
        return int(splits[k]) if 0 <= k < sizes.size else 1

    def fastest(self, seq_len: int) -> float:
        """The least time any ring gives this sequence's members (pipeline fill included)."""
        return self.stages * float(self.curve(seq_len)[1].min())

    def _table_of(self, seq_lens: list[int]) -> _CurveTable:
        """The curves of ``seq_lens`` end to end: ``balanced_target``'s table when it holds
        these lengths in this order (it does in a planned step), else a new one."""
        table = self._table
        if table is not None and table.seq_lens == seq_lens:
            return table
        return _CurveTable(self, seq_lens)

    def first_within(self, seq_lens: Sequence[int], target: float) -> list[int]:
        """``size``'s starting point for many lengths at once: per length, the index of the
        first ring whose share time is within ``target``, else of the first within 0.1% of
        its fastest ring (one pass over all their curves end to end)."""
        if not len(seq_lens):
            return []
        return self._first_within(self._table_of([int(s) for s in seq_lens]), target).tolist()

    def _first_within(self, table: _CurveTable, target: float) -> np.ndarray:
        # each length's first entry within the target is in its curve up to its first minimum
        # (where any entry is within, that one is), which most targets of a step read: cut once
        pt, first, counts = table.to_first_min(self.stages)
        k = _first_true(pt <= target, first, counts)
        if (k < 0).any():
            k = np.where(k < 0, table.near_fastest(), k)
        return k

    def size_many(self, seq_lens: list[int], target: float) -> list[tuple[int, float, int]]:
        """``(ring size, offload ratio, two-level group size)`` of each length for ``target``:
        ``size(s, target)`` and ``heads_split`` of its ring, the same values (``size_arrays``)."""
        return list(zip(*(a.tolist() for a in self.size_arrays(seq_lens, target))))

    def size_arrays(self, seq_lens: list[int], target: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``size_many``'s ring sizes, offload ratios and two-level group sizes as arrays, read
        off the curves for all lengths at once: the floor ring takes the floor's ratio, a
        larger ring on which every share fits offloads nothing; only larger rings that offload
        (a few lengths a step) go through ``size``."""
        if not seq_lens:
            return np.zeros(0, dtype=np.int64), np.zeros(0), np.zeros(0, dtype=np.int64)
        table = self._table_of(seq_lens)
        k = self._first_within(table, target)
        at = table.first + k
        ranks = table.sizes[at]
        ratios = np.where(k == 0, table.floor_ratios(self), 0.0)
        splits = table.splits[at]
        sized = self._sized  # from a given start ``size`` does not read the target: once per step
        for i in np.flatnonzero((k > 0) & (-(-table.lengths // ranks) > self.capacity)).tolist():
            key = (seq_lens[i], int(k[i]))
            if key not in sized:
                d, r, _ = self.size(key[0], target, key[1])
                sized[key] = (d, r, self.heads_split(key[0], d))
            ranks[i], ratios[i], splits[i] = sized[key]
        return ranks, ratios, splits

    def size(self, seq_len: int, target: float | None, start: int | None = None) -> tuple[int, float, float]:
        """(ring size, offload ratio, share time): the memory floor when ``target`` is None,
        else the smallest ring whose share time is within ``target`` (or the fastest ring).
        ``start``: that ring's index on the curve when known (``first_within``)."""
        sizes, times = self.curve(seq_len)
        if target is None:
            k = 0
        elif start is not None:
            k = start
        else:
            fits = np.flatnonzero(self.stages * times <= target)
            k = int(fits[0]) if fits.size else int(np.flatnonzero(times <= times.min() * (1 + 1e-3))[0])
        for j in range(k, len(sizes)):
            d = int(sizes[j])
            if j == 0:
                r = self.floor(seq_len).ratio
            elif -(-seq_len // d) <= self.capacity:
                r = 0.0  # what ratio_for_ranks gives when every share fits: nothing to offload, no copy
            else:
                r = ratio_for_ranks(seq_len, d, self.capacity, self.cost, self.host)
            if r is not None:
                return d, r, float(times[j])
        d = self.floor(seq_len)  # unreachable for sane profiles: larger rings need smaller ratios
        return d.ranks, d.ratio, float(times[0])


def _first_true(mask: np.ndarray, first: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Per segment of ``mask`` (starting at ``first``, ``counts`` long), the index within it
    of its first True, else -1."""
    at = np.flatnonzero(mask)  # ascending, so each segment's first hit is where it starts
    if not at.size:
        return np.full(counts.size, -1)
    found = at[np.minimum(np.searchsorted(at, first), at.size - 1)]
    ok = (found >= first) & (found < first + counts)  # the hit is in this segment
    return np.where(ok, found - first, -1)


def _prefixes(first: np.ndarray, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The first ``keep`` entries of segments starting at ``first``, end to end: where each
    segment starts among them, and the index of every entry kept."""
    start = np.concatenate(([0], np.cumsum(keep)[:-1]))
    return start, np.repeat(first - start, keep) + np.arange(int(keep.sum()))


class _CurveTable:
    """The curves of many lengths end to end (``balanced_target``'s view of them)."""

    def __init__(self, sizer: RingSizer, seq_lens: list[int]):
        sizer.prepare(seq_lens)
        self.seq_lens = seq_lens
        self.lengths = np.array(seq_lens, dtype=np.int64)
        where = np.array([sizer._where[s] for s in seq_lens], dtype=np.int64).reshape(-1, 3)
        self.counts = where[:, 2]
        self.first = np.concatenate(([0], np.cumsum(self.counts)[:-1]))  # where each length starts
        block, start = (int(where[0, 0]), int(where[0, 1])) if len(seq_lens) else (0, 0)
        if len(seq_lens) and (where[:, 0] == block).all() and np.array_equal(where[:, 1] - start, self.first):
            # the lengths lie end to end in one block (a step's: prepared at once): its entries
            end = start + int(self.counts.sum())
            self.sizes, self.times, splits = (a[start:end] for a in sizer._blocks[block])
        else:
            curves = [sizer._entries(s) for s in seq_lens]
            self.sizes, self.times, splits = (np.concatenate([c[i] for c in curves]) for i in range(3))
        self.least = np.minimum.reduceat(self.times, self.first)  # each length's fastest ring
        self.splits = splits  # each entry's two-level group size (1: the plain ring)
        self._floor_ratios: np.ndarray | None = None
        self._stage_min: tuple | None = None  # (stages, stages x times, each first minimum's index)
        self._to_first_min: tuple | None = None
        self._near: np.ndarray | None = None

    def floor_ratios(self, sizer: RingSizer) -> np.ndarray:
        """Each length's offload ratio on its floor ring (its first entry)."""
        if self._floor_ratios is None:
            self._floor_ratios = np.array([sizer.floor(s).ratio for s in self.seq_lens], dtype=np.float64)
        return self._floor_ratios

    def first_min(self, values: np.ndarray) -> np.ndarray:
        """Per length, the index within its curve of the first minimum of ``values``."""
        low = np.repeat(np.minimum.reduceat(values, self.first), self.counts)
        at = np.flatnonzero(values == low)  # ascending: each length's first hit first
        return at[np.searchsorted(at, self.first)] - self.first

    def stage_times(self, stages: int) -> tuple[np.ndarray, np.ndarray]:
        """``stages`` x the times (pipeline fill included) and, per length, the index of their
        first minimum, made once (``balanced_target`` and every target's sizing read them)."""
        if self._stage_min is None or self._stage_min[0] != stages:
            pt = stages * self.times
            self._stage_min = (stages, pt, self.first_min(pt))
        return self._stage_min[1], self._stage_min[2]

    def to_first_min(self, stages: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``stage_times`` with each length's curve cut after its first minimum, end to end:
        the entries, where each length starts and how many it keeps."""
        if self._to_first_min is None or self._to_first_min[0] != stages:
            pt, low = self.stage_times(stages)
            stop = low + 1
            start, take = _prefixes(self.first, stop)
            self._to_first_min = (stages, pt[take], start, stop)
        return self._to_first_min[1:]

    def near_fastest(self) -> np.ndarray:
        """Per length, the index of the first entry within 0.1% of its fastest ring."""
        if self._near is None:
            self._near = _first_true(
                self.times <= np.repeat(self.least * (1 + 1e-3), self.counts), self.first, self.counts
            )
        return self._near


def balanced_target(lens: np.ndarray, sizer: RingSizer) -> float:
    """The step time rings are sized for: the smallest ``T`` that passes three tests.

    1. No rank finishes before the slowest unsplittable work (the longest short sequence,
       the fastest ring of each long sequence): ``T`` is at least that floor.
    2. ``W(T) / N <= T``, where ``W(T)`` is all work in rank-seconds when each long
       sequence gets the smallest ring whose share time is within ``T``.
    3. Work longer than ``T / 2`` cannot share a rank with other such work within ``T``,
       so the ranks it takes must fit in ``N``.

    Larger ``T`` means smaller rings: less exposed communication (2) and fewer ranks held
    (3), so both tests are monotone and bisection finds the smallest passing ``T``.
    """
    cost = sizer.cost
    cap = sizer.capacity
    p = sizer.stages
    n_ranks = sizer.num_ranks
    short = lens[lens <= cap].astype(np.float64)
    short_times = cost.short_time(short, cap)  # as units.short_units times them
    work = float(short_times.sum())
    short_times = np.sort(p * short_times)
    floor = float(short_times[-1]) if short.size else 0.0
    long_lens, counts = np.unique(lens[lens > cap], return_counts=True)
    table = _CurveTable(sizer, long_lens.tolist()) if long_lens.size else None
    sizer._table = table  # ring_decisions reads the same curves next (``size_arrays``)
    if table is not None:  # per length: its floor ring and its fastest ring
        floor = max(floor, float((p * table.least).max()))
        best0 = p * table.times[table.first]  # the floor ring's time, pipeline fill included
        fixed = best0 <= floor  # these keep their floor ring for every T >= floor
        varying = np.flatnonzero(~fixed)
        fixed = np.flatnonzero(fixed)
        rs0 = table.sizes[table.first] * table.times[table.first]  # rank-seconds of the floor ring
        work += sum((counts[fixed] * rs0[fixed]).tolist())  # added one by one, in the lengths' order
        held_t = np.concatenate([short_times, best0[fixed]])
        held_r = np.concatenate(
            [np.ones(short_times.size), (counts[fixed] * table.sizes[table.first][fixed]).astype(np.float64)]
        )
    else:
        varying = []
        held_t, held_r = short_times, np.ones(short_times.size)
    # ranks held by fixed work longer than T/2: sorted times, suffix sums of ranks
    order = np.argsort(held_t, kind="stable")
    held_t = held_t[order]
    held_suffix = np.concatenate([np.cumsum(held_r[order][::-1])[::-1], [0.0]])

    # Per varying length, the first ring size whose time is within t, else its last size.
    # All lengths at once: their curves up to the first minimum, end to end. (The running
    # minimum ``best`` of a curve first falls to t or below where the curve itself first
    # does, and there it equals the curve: so the first entry within t is read, and past
    # the first minimum neither falls.)
    if len(varying):
        pt, low = table.stage_times(p)  # share times, pipeline fill included
        stop = low[varying] + 1
        first, take = _prefixes(table.first[varying], stop)
        last_k = stop - 1
        cut_pt = pt[take]
        rank_seconds_all = table.sizes * table.times
        cut_rs = rank_seconds_all[take]
        cut_sizes = table.sizes[take]
        end = table.first[varying] + table.counts[varying] - 1
        end_best = p * table.least[varying]  # the running minimum's last entry
        end_rs = rank_seconds_all[end]
        end_sizes = table.sizes[end]
        n_seqs = counts[varying].astype(np.int64)

    def passes(t: float) -> bool:
        total = work
        held = float(held_suffix[np.searchsorted(held_t, t / 2, side="right")])
        if len(varying):
            hits = np.flatnonzero(cut_pt <= t)  # ascending: each length's first hit first
            k = np.searchsorted(hits, first)
            at = hits[np.minimum(k, max(hits.size - 1, 0))] if hits.size else first + last_k
            inside = (k < hits.size) & (at < first + stop)  # else no size is within t: the last one
            at = np.where(inside, at, first + last_k)
            rank_seconds = np.where(inside, cut_rs[at], end_rs)
            best = np.where(inside, cut_pt[at], end_best)
            sizes = np.where(inside, cut_sizes[at], end_sizes)
            # added in the lengths' order, as one running sum (the same float result)
            total = float(np.cumsum(np.concatenate(([work], n_seqs * rank_seconds)))[-1])
            big = best > t / 2
            held += float((n_seqs[big] * sizes[big]).sum())  # whole numbers: exact in any order
        return total / n_ranks <= t and held <= n_ranks

    lo = floor
    if passes(lo):
        return lo
    hi = 2 * max(lo, work / n_ranks, 1e-12)
    while not passes(hi):
        hi *= 2
        if hi > 1e12:  # more big work than ranks at any T: fall back to the spread test alone
            return max(floor, work / n_ranks)
    while hi - lo > 1e-4 * hi:
        mid = 0.5 * (lo + hi)
        if passes(mid):
            hi = mid
        else:
            lo = mid
    return hi


@dataclass(frozen=True, eq=False)
class RingDecisions:
    """The ring decisions of every sequence longer than the capacity, in sequence order: its
    id, length, ring size, offload ratio and two-level group size (the planner reads these
    for each candidate target)."""

    seq_ids: np.ndarray
    seq_lens: np.ndarray
    ring_size: np.ndarray
    ratio: np.ndarray
    heads_split: np.ndarray

    def same_rings(self, other: RingDecisions | None) -> bool:
        """Whether ``other`` gives every sequence the same ring size and offload ratio."""
        return (
            other is not None
            and np.array_equal(self.seq_ids, other.seq_ids)
            and np.array_equal(self.ring_size, other.ring_size)
            and np.array_equal(self.ratio, other.ratio)
        )


def ring_decisions(seq_lens: Sequence[int], sizer: RingSizer, target: float | None, resize=None) -> RingDecisions:
    """Every sequence longer than the capacity sized for ``target``: the smallest ring whose
    share time is within it (or the fastest ring), or the memory floor when ``target`` is None
    (hdp-naive); decided once per distinct length (``resize``: a function of (length, ring
    size, ratio, two-level group) giving them anew, EP's rounding to whole groups)."""
    lens = np.asarray(seq_lens, dtype=np.int64)
    long_ids = np.flatnonzero(lens > sizer.capacity)
    long_lens = lens[long_ids]
    distinct, which = np.unique(long_lens, return_inverse=True)  # as balanced_target lists them
    distinct_list = distinct.tolist()
    if target is None or resize is not None:
        if target is None:  # the memory floor needs no time curve
            decided = [(d.ranks, d.ratio, 1) for d in map(sizer.floor, distinct_list)]
        else:  # its curves are reused
            decided = sizer.size_many(distinct_list, target)
        if resize is not None:
            decided = [resize(s, *d) for s, d in zip(distinct_list, decided)]
        ring_size = np.array([d[0] for d in decided], dtype=np.int64)
        ratio = np.array([d[1] for d in decided], dtype=np.float64)
        heads_split = np.array([d[2] for d in decided], dtype=np.int64)
    else:
        ring_size, ratio, heads_split = sizer.size_arrays(distinct_list, target)
    return RingDecisions(long_ids, long_lens, ring_size[which], ratio[which], heads_split[which])
