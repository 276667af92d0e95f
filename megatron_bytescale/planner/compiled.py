"""Compiled kernels for the planner's hottest loops (numba, a dependency), each the same
arithmetic as the numpy version its caller keeps beside it: that version runs where numba
cannot be imported (a platform without its wheels) and is what the tests check a kernel
against, bit for bit.

numba is imported on a kernel's first use (about 0.2 s), not with the planner. A kernel is
compiled on its first use in an environment (about a second more) and cached on disk (numba's
``cache=True``: beside this module, or in a per-user directory where that is not writable),
so later processes load it in a few milliseconds (where no cache directory is writable, each
process compiles it).
"""

from __future__ import annotations

from functools import cache

import numpy as np


def _longest_path(nodes: int, src: np.ndarray, dst: np.ndarray, duration: np.ndarray):
    """``pipeline_times.longest_path_ends`` node by node (Kahn's order): every node's end is
    its start plus its duration, its start the largest end of its predecessors (0 without),
    so the floats are those of the level-by-level walk, whatever the order. Returns the ends,
    the in-degrees left and how many nodes ended (fewer than ``nodes``: a cycle)."""
    edges = src.size
    indeg = np.zeros(nodes, dtype=np.int64)
    first = np.zeros(nodes + 1, dtype=np.int64)
    for k in range(edges):
        indeg[dst[k]] += 1
        first[src[k] + 1] += 1
    for v in range(nodes):
        first[v + 1] += first[v]
    succ = np.empty(edges, dtype=np.int64)  # successors grouped by source (a counting sort)
    fill = first[:-1].copy()
    for k in range(edges):
        s = src[k]
        succ[fill[s]] = dst[k]
        fill[s] += 1
    start = np.zeros(nodes)
    end = np.zeros(nodes)
    ready = np.empty(nodes, dtype=np.int64)
    tail = 0
    for v in range(nodes):
        if indeg[v] == 0:
            ready[tail] = v
            tail += 1
    head = 0
    while head < tail:
        v = ready[head]
        head += 1
        e = start[v] + duration[v]
        end[v] = e
        for k in range(first[v], first[v + 1]):
            w = succ[k]
            if e > start[w]:
                start[w] = e
            indeg[w] -= 1
            if indeg[w] == 0:
                ready[tail] = w
                tail += 1
    return end, indeg, tail


@cache
def longest_path():
    """``_longest_path`` compiled, or None where numba is missing (the caller takes its numpy
    version)."""
    try:
        from numba import njit
    except ImportError:  # pragma: no cover - numba is a dependency; its absence is the fallback's case
        return None
    try:
        return njit(cache=True, nogil=True)(_longest_path)
    except RuntimeError:  # no writable cache directory (numba names none): compiled in each process
        return njit(nogil=True)(_longest_path)
