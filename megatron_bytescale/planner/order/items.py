"""Each rank's items in run order, from the balance scheduler's assignment: ring units stay
units, and the short sequences between two of a rank's other units are packed into
micro-batches of whole sequences (best-fit decreasing where they do not fit one)."""

from __future__ import annotations

from itertools import chain, pairwise, repeat
from operator import attrgetter, itemgetter

import numpy as np

from ..balance import Assignment, Unit
from ..cost_model import CostModel
from ..jit import kernel
from ..lengths import lengths_array
from .runs import Item, LocalBatch


def rank_items(lens, units: list[Unit], assignment: Assignment, capacity: int, cost: CostModel) -> list[list[Item]]:
    """Each rank's work in run order: ring unit indices and local micro-batches. The short
    sequences between two of a rank's other units are packed best-fit within that stretch
    (``stretch_packs``), so the rank still reaches each ring when the schedule expects."""
    n = len(units)
    kind = np.fromiter(map(_KIND_CODES.get, map(_kind_of, units), repeat(2, n)), dtype=np.int8, count=n)
    seq = np.fromiter(map(itemgetter(0), map(_seq_ids_of, units)), dtype=np.int64, count=n)
    runs = assignment.runs
    bounds = np.zeros(len(runs) + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, runs), dtype=np.int64, count=len(runs)), out=bounds[1:])
    flat = np.fromiter(chain.from_iterable(runs), dtype=np.int64, count=int(bounds[-1]))
    lens_array = lengths_array(lens)
    codes, item_bounds, pack_seq, pack_ends = stretch_packs(flat, bounds, kind, seq, lens_array, capacity)
    starts = np.concatenate((np.zeros(1, dtype=np.int64), pack_ends))[:-1]
    seqs = pack_seq.tolist()
    packs = [
        LocalBatch(tuple(seqs[a:b]), 0.0, t)
        for a, b, t in zip(starts.tolist(), pack_ends.tolist(), segment_times(lens_array, pack_seq, starts, cost))
    ]
    # every item by its code shifted by the number of packs: packs (last first), then units
    # (a ring: its index; a local unit, on one rank only: its micro-batch)
    lookup = packs[::-1] + list(range(n))
    for u in np.flatnonzero(kind == 2).tolist():
        unit = units[u]
        lookup[len(packs) + u] = LocalBatch(unit.seq_ids, unit.ratio, unit.time)
    items = list(map(lookup.__getitem__, (codes + len(packs)).tolist()))
    return [items[a:b] for a, b in pairwise(item_bounds.tolist())]


_KIND_CODES = {"short": 0, "ring": 1}  # anything else: 2, a local micro-batch of its own
_kind_of = attrgetter("kind")
_seq_ids_of = attrgetter("seq_ids")


def segment_times(lens: np.ndarray, flat: np.ndarray, first: np.ndarray, cost: CostModel) -> list[float]:
    """Seconds (all layers) of packs of whole sequences given end to end (``flat``, each pack
    from its ``first`` index on; none empty): ``pack_times``' arithmetic."""
    if not first.size:
        return []
    s = lens[flat]
    tokens = np.add.reduceat(s, first)  # whole numbers: exact
    pairs = np.add.reduceat(s * s, first)
    return (cost.num_layers * cost.layer_time(tokens, pairs)).tolist()


def pack_times(lens, packs: list[tuple[int, ...]], cost: CostModel) -> list[float]:
    """Seconds (all layers) of each pack of whole sequences: ``num_layers * layer_time(tokens, pairs)``,
    for all packs at once."""
    if not packs:
        return []
    sizes = np.fromiter((len(b) for b in packs), dtype=np.int64, count=len(packs))
    flat = np.fromiter((i for b in packs for i in b), dtype=np.int64, count=int(sizes.sum()))
    first = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    return segment_times(lengths_array(lens), flat, first, cost)


@kernel(size=lambda flat, *_: flat.size)
def stretch_packs(
    flat: np.ndarray, bounds: np.ndarray, kind: np.ndarray, seq: np.ndarray, lens: np.ndarray, capacity: int
):
    """The walk over every rank's run (``flat``, rank ``r``'s units at ``bounds[r]:bounds[r +
    1]``; ``kind`` per unit: 0 a short sequence ``seq[u]``, 1 a ring, 2 a local micro-batch of
    its own): the short sequences between two of a rank's other units (a stretch) make one
    micro-batch in run order where they fit ``capacity`` together (or are one), else are packed
    best-fit decreasing as ``sizing.packing.pack_best_fit`` packs them (longest first, ties by
    the lower id; each to the open bin it leaves least room in, ties by the earlier bin; bins
    in the order opened). Returns each rank's items (``codes`` at ``item_bounds[r]:item_bounds[r
    + 1]``: a unit's index, or ``-p - 1`` for micro-batch ``p``) and the micro-batches'
    sequences (``pack_seq`` at ``pack_ends[p - 1]:pack_ends[p]``), rank by rank."""
    n_ranks = bounds.size - 1
    codes = np.empty(flat.size, dtype=np.int64)
    item_bounds = np.zeros(n_ranks + 1, dtype=np.int64)
    pack_seq = np.empty(flat.size, dtype=np.int64)
    pack_ends = np.empty(flat.size + 1, dtype=np.int64)
    stretch = np.empty(flat.size, dtype=np.int64)
    sizes = np.empty(flat.size, dtype=np.int64)
    bin_of = np.empty(flat.size, dtype=np.int64)  # per placed item (sorted order): its bin
    free_room = np.empty(flat.size, dtype=np.int64)  # open bins with room: (room, bin) ascending
    free_bin = np.empty(flat.size, dtype=np.int64)
    fill = np.empty(flat.size, dtype=np.int64)
    n_codes = 0
    n_packs = 0
    n_seq = 0
    for r in range(n_ranks):
        n = 0
        tokens = 0
        for j in range(bounds[r], bounds[r + 1] + 1):
            u = flat[j] if j < bounds[r + 1] else -1
            if u >= 0 and kind[u] == 0:
                stretch[n] = seq[u]
                tokens += lens[seq[u]]
                n += 1
                continue
            if n > 0:
                if n == 1 or tokens <= capacity:  # one micro-batch, in run order
                    for i in range(n):
                        pack_seq[n_seq] = stretch[i]
                        n_seq += 1
                    codes[n_codes] = -n_packs - 1
                    n_codes += 1
                    pack_ends[n_packs] = n_seq
                    n_packs += 1
                else:
                    for i in range(n):
                        sizes[i] = lens[stretch[i]]
                    # longest first, ties by the lower id: a stable sort by size of the ids sorted
                    by_id = np.argsort(stretch[:n], kind="mergesort")
                    order = by_id[np.argsort(-sizes[:n][by_id], kind="mergesort")]
                    n_bins = 0
                    n_free = 0
                    for i in range(n):
                        size = sizes[order[i]]
                        lo, hi = 0, n_free  # the first open bin with at least ``size`` room
                        while lo < hi:
                            mid = (lo + hi) // 2
                            if free_room[mid] < size:
                                lo = mid + 1
                            else:
                                hi = mid
                        if lo == n_free:
                            b = n_bins
                            n_bins += 1
                            left = capacity - size
                        else:
                            b = free_bin[lo]
                            left = free_room[lo] - size
                            for k in range(lo, n_free - 1):
                                free_room[k] = free_room[k + 1]
                                free_bin[k] = free_bin[k + 1]
                            n_free -= 1
                        bin_of[i] = b
                        if left > 0:  # back in the list at its (room, bin) place
                            at = n_free
                            while at > 0 and (
                                free_room[at - 1] > left or (free_room[at - 1] == left and free_bin[at - 1] > b)
                            ):
                                free_room[at] = free_room[at - 1]
                                free_bin[at] = free_bin[at - 1]
                                at -= 1
                            free_room[at] = left
                            free_bin[at] = b
                            n_free += 1
                    # the bins in the order opened, each with its items in the order placed
                    for b in range(n_bins):
                        fill[b] = 0
                    for i in range(n):
                        fill[bin_of[i]] += 1
                    start = n_seq
                    for b in range(n_bins):
                        count = fill[b]
                        fill[b] = start
                        start += count
                    for i in range(n):
                        pack_seq[fill[bin_of[i]]] = stretch[order[i]]
                        fill[bin_of[i]] += 1
                    for b in range(n_bins):
                        codes[n_codes] = -n_packs - 1
                        n_codes += 1
                        n_seq = fill[b]
                        pack_ends[n_packs] = n_seq
                        n_packs += 1
                n = 0
                tokens = 0
            if u >= 0:
                codes[n_codes] = u
                n_codes += 1
        item_bounds[r + 1] = n_codes
    return codes[:n_codes], item_bounds, pack_seq[:n_seq], pack_ends[:n_packs]
