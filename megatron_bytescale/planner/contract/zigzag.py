"""Per-sequence zigzag split of one sequence over a ring of N ranks (design 2.3).

The sequence is cut into 2N chunks; rank i holds chunks i and 2N-1-i, so every rank gets the
same causal attention work. Any length is exact: when ``seq_len`` does not divide by 2N the
chunks differ by at most one token and ranks by at most one token (never padded).
"""

from functools import lru_cache

Ranges = tuple[tuple[int, int], ...]


def rank_tokens(seq_len: int, ring_size: int, index: int) -> int:
    """Tokens held by ring member ``index``: the split is as even as integers allow."""
    base, extra = divmod(seq_len, ring_size)
    return base + (1 if index < extra else 0)


@lru_cache(maxsize=1 << 16)  # a 16K-rank step has ~6,000 distinct (length, ring size)
def zigzag_ranges(seq_len: int, ring_size: int) -> tuple[Ranges, ...]:
    """Token ranges ``[start, end)`` held by each ring member, in sequence order.

    Adjacent chunks are merged (ring size 1 gives ``((0, seq_len),)``); empty chunks are
    dropped. Every token of ``[0, seq_len)`` is in exactly one member's ranges.
    """
    if seq_len <= 0 or ring_size <= 0:
        raise ValueError(f"zigzag needs seq_len > 0 and ring_size > 0, got {seq_len}, {ring_size}")
    if ring_size > seq_len:
        raise ValueError(f"ring of {ring_size} ranks for a {seq_len}-token sequence leaves ranks empty")
    # chunk c's size: front chunk of rank i is chunk i, back chunk is 2N-1-i
    sizes = [0] * (2 * ring_size)
    for i in range(ring_size):
        t = rank_tokens(seq_len, ring_size, i)
        sizes[i] = (t + 1) // 2
        sizes[2 * ring_size - 1 - i] = t // 2
    bounds = [0]
    for size in sizes:
        bounds.append(bounds[-1] + size)
    result = []
    for i in range(ring_size):
        chunks = [(bounds[i], bounds[i + 1]), (bounds[2 * ring_size - 1 - i], bounds[2 * ring_size - i])]
        result.append(merge_ranges(chunks))
    return tuple(result)


def merge_ranges(ranges) -> Ranges:
    """Drop empty ranges and merge touching ones; input must be sorted and disjoint."""
    merged: list[tuple[int, int]] = []
    for start, end in ranges:
        if end <= start:
            continue
        if merged and merged[-1][1] == start:
            merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return tuple(merged)


def causal_work(ranges: Ranges) -> int:
    """Causal attention work (query-key pairs) of the given query ranges of one sequence."""
    return sum((end * (end + 1) - start * (start + 1)) // 2 for start, end in ranges)
