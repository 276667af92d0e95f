"""Selection rules the balance scheduler and the level placement share (helpers of their
kernels: plain Python here, compiled into the kernels that call them)."""

from __future__ import annotations

import numpy as np

from .jit import jitable


@jitable
def least_of(values: np.ndarray, k: int) -> np.ndarray:
    """The indices of the k least ``values``, ties to the lowest index, in index order (a
    ring's k least-loaded ranks; O(n), not a sort)."""
    out = np.empty(k, dtype=np.int64)
    threshold = values.min()
    if np.count_nonzero(values == threshold) < k:  # not all at the least: the k-th least
        threshold = np.partition(values, k - 1)[k - 1]
    tied = k - np.count_nonzero(values < threshold)  # those at the threshold taken, lowest first
    m = 0
    for i in range(values.size):
        if m == k:
            break
        if values[i] < threshold or (values[i] == threshold and tied > 0):
            if values[i] == threshold:
                tied -= 1
            out[m] = i
            m += 1
    return out


@jitable
def better_leaf(a: int, b: int, first_a: float, first_b: float, then_a: float, then_b: float) -> int:
    """A tournament tree's pick of two leaves (-1: none): the least (first key, second key,
    index)."""
    if b < 0:
        return a
    if a < 0:
        return b
    if first_a != first_b:
        return a if first_a < first_b else b
    if then_a != then_b:
        return a if then_a < then_b else b
    return a if a < b else b
