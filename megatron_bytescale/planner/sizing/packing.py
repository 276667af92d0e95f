"""Best-fit packing of short sequences: into micro-batches of at most the capacity (best-fit
decreasing), and into the spare room of ring micro-batches (hdp-naive)."""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Sequence

from ...errors import PlanError


class BestFit:
    """Best-fit bin packing: each item goes to the open bin it fills most tightly.

    Bins are kept sorted by free space, so a placement is a binary search. Feed items in
    decreasing size for best-fit decreasing.
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.bins: list[list[int]] = []
        self.free_space: list[int] = []
        self._free: list[tuple[int, int]] = []  # (free tokens, bin index), ascending

    def open_bin(self, free: int, items: Sequence[int] = ()) -> int:
        """Add a bin that already holds ``items`` and has ``free`` tokens left."""
        b = len(self.bins)
        self.bins.append(list(items))
        self.free_space.append(free)
        if free > 0:
            insort(self._free, (free, b))
        return b

    def add(self, item: int, size: int) -> int:
        i = bisect_left(self._free, (size, -1))
        if i == len(self._free):
            if size > self.capacity:
                raise PlanError(f"a {size}-token sequence does not fit a {self.capacity}-token micro-batch")
            return self.open_bin(self.capacity - size, (item,))
        free, b = self._free.pop(i)
        self.bins[b].append(item)
        free -= size
        self.free_space[b] = free
        if free > 0:
            insort(self._free, (free, b))
        return b

    def try_add(self, item: int, size: int) -> int | None:
        """Place into an open bin only (no new bin); None if none has room."""
        i = bisect_left(self._free, (size, -1))
        if i == len(self._free):
            return None
        return self.add(item, size)


def pack_best_fit(items: Sequence[tuple[int, int]], capacity: int) -> list[list[int]]:
    """Pack ``(item, size)`` pairs (each size <= capacity) into bins of ``capacity`` tokens,
    best-fit decreasing; returns the bins' items, fullest-first order of opening."""
    # ``BestFit.add`` for each item, inlined (every stretch of a step is packed)
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
    (decreasing size); returns each slot's added items and the items left over."""
    # ``BestFit.open_bin`` per slot, then ``try_add`` per item, inlined (hdp-naive fills every
    # ring's spare room)
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
