"""Best-fit packing of short sequences: into micro-batches of at most the capacity (best-fit
decreasing), and into the spare room of ring micro-batches (hdp-naive)."""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Sequence

from ...errors import PlanError


def pack_best_fit(items: Sequence[tuple[int, int]], capacity: int) -> list[list[int]]:
    """Pack ``(item, size)`` pairs (each size <= capacity) into bins of ``capacity`` tokens,
    best-fit decreasing (each item, longest first, ties by the lower item, to the open bin it
    leaves least room in, ties to the earlier bin); returns the bins' items in the order opened."""
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (free tokens, bin index), ascending
    for item, size in sorted(items, key=lambda x: (-x[1], x[0])):
        i = bisect_left(free, (size, -1))
        if i == len(free):
            if size > capacity:
                raise PlanError(f"a {size}-token sequence does not fit a {capacity}-token micro-batch")
            b = len(bins)
            bins.append([item])
            left = capacity - size
        else:
            left, b = free.pop(i)
            bins[b].append(item)
            left -= size
        if left > 0:
            insort(free, (left, b))
    return bins


def fill_ring_spare(
    spare: Sequence[int], items: Sequence[tuple[int, int]]
) -> tuple[list[list[int]], list[tuple[int, int]]]:
    """Best-fit ``(item, size)`` pairs into the spare tokens of existing micro-batches
    (decreasing size, each to the slot it leaves least room in); returns each slot's added
    items and the items left over."""
    bins: list[list[int]] = [[] for _ in spare]
    free = sorted((f, b) for b, f in enumerate(spare) if f > 0)  # (free tokens, bin), ascending
    left = []
    for item, size in sorted(items, key=lambda x: (-x[1], x[0])):
        i = bisect_left(free, (size, -1))
        if i == len(free):
            left.append((item, size))
            continue
        room, b = free.pop(i)
        bins[b].append(item)
        room -= size
        if room > 0:
            insort(free, (room, b))
    return bins, left
