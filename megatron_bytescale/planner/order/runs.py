"""What the ordering passes read and give: each rank's items in run order (a ring unit's
index, or a ``LocalBatch`` of whole sequences), ``Ordered`` (the runs with their estimated
clocks and what the order changed), the items as arrays, and splitting a pack in two."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate, chain, compress, pairwise
from operator import attrgetter

import numpy as np

from ..cost_model import CostModel
from ..jit import jitable
from ..lengths import lengths_array


@dataclass(eq=False, slots=True)  # slots: ~6 x 10^4 a step at 16K ranks, built and read fast
class LocalBatch:
    """A micro-batch of whole sequences on one rank (whichever rank it ends up on)."""

    seq_ids: tuple[int, ...]
    ratio: float
    time: float  # estimated seconds on one stage


Item = int | LocalBatch  # a ring unit's index, or a local micro-batch


@dataclass(frozen=True, eq=False)
class PackSplitter:
    """The planner's split of a pack into two micro-batches of about equal tokens (to fill a
    slot): ``pack_halves``' halves, each timed as a pack by the cost model. The aligned pass
    (``order.aligned``) splits the same way inside its kernel."""

    lens: Sequence[int]  # tokens per sequence of the batch
    cost: CostModel

    def __call__(self, batch: LocalBatch) -> tuple[LocalBatch, LocalBatch]:
        lens = lengths_array(self.lens)
        part = np.array(batch.seq_ids, dtype=np.int64)
        side = pack_halves(part, lens)
        halves = (part[~side], part[side])
        return tuple(LocalBatch(tuple(h.tolist()), batch.ratio, self._time(lens[h])) for h in halves)

    def _time(self, seq_lens: np.ndarray) -> float:
        """Seconds (all layers) of whole sequences packed into one micro-batch."""
        tokens, pairs = int(seq_lens.sum()), int((seq_lens * seq_lens).sum())  # whole numbers: exact
        return self.cost.num_layers * self.cost.layer_time(tokens, pairs)


@jitable
def pack_halves(part: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """A pack's sequences ``part`` sorted in place longest first (ties: the lower index), and
    which half each goes to (True: the second): each to the half with fewer tokens so far
    (ties: the first)."""
    m = part.size
    for i in range(1, m):  # an insertion sort: packs are small
        v = part[i]
        j = i - 1
        while j >= 0 and (lens[part[j]] < lens[v] or (lens[part[j]] == lens[v] and part[j] > v)):
            part[j + 1] = part[j]
            j -= 1
        part[j + 1] = v
    side = np.zeros(m, dtype=np.bool_)
    tokens0, tokens1 = 0, 0
    for i in range(m):
        if tokens0 <= tokens1:
            tokens0 += lens[part[i]]
        else:
            side[i] = True
            tokens1 += lens[part[i]]
    return side


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
    # where a pass made the runs from arrays: every item's ring (-1: local work) and the
    # local items' seconds (NaN for rings), rank after rank, which ``rank_estimates`` reads
    # instead of a Python step per item (``item_arrays``); the runs are not changed after
    items: tuple[np.ndarray, np.ndarray] | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True, eq=False)
class RunArrays:
    """Every rank's items (runs) as arrays, as the kernels read them: ``codes`` per item, rank
    after rank (``counts`` per rank): a ring its index, the k-th local micro-batch (in rank
    order, ``pool[k]``) ``-k - 1``; per local micro-batch its seconds, its sequence count and
    (``seqs``) its sequences end to end. A PP-balance candidate's runs are read by the aligned
    pass and the level placement: ``run_arrays`` once for both."""

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


def unit_keys(runs: Sequence[Sequence[Item]]) -> list[list[int | None]]:
    """Per rank and item: its ring unit, None for local work (``find_pipeline_deadlock``'s keys)."""
    return [[None if isinstance(x, LocalBatch) else x for x in run] for run in runs]


def sequential(runs, ring_order, members, ring_time) -> Ordered:
    """Every rank runs its items as given, each ring starting when its last member reaches it
    (``ring_order``: the rings in an order every rank's runs follow): only the clocks are
    computed."""
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
