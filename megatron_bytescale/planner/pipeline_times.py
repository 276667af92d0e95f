"""The pipeline graph's longest paths with numpy: what ``contract.PipelineGraph.evaluate``
gives (the same floats: every end is one sum of a start and a duration, every start one
maximum), level by level instead of node by node.

The contract stays the standard library (``Plan.validate`` and the deadlock check use its
node-by-node walk); the planner's estimates, the stage-order search and the simulator evaluate
graphs of 10^4-10^6 operations many times a step, where a Python loop over every edge was
most of the planning time with pipelines. A level (the operations whose predecessors have all
ended) is a handful of array operations, and such graphs are 10^2 levels deep.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import numpy as np

from .contract import PipelineGraph
from .contract.graph import Orders

# Graphs smaller than this many operations are walked by the contract's Python loop: the array
# operations of a level cost more than walking a few hundred nodes (one pipeline's 1F1B time).
SMALL_GRAPH = 2048


def edge_arrays(graph: PipelineGraph, seqs: Sequence[Sequence[int]], extra: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(source, destination) of every edge of ``PipelineGraph.edges``: each resource's
    consecutive operations, then each micro-batch's chain of virtual stages."""
    lens = np.fromiter(map(len, seqs), np.int64, len(seqs))
    flat = np.fromiter(chain.from_iterable(seqs), np.int64, int(lens.sum()))
    inside = np.ones(max(flat.size - 1, 0), dtype=bool)  # pairs that do not cross two resources
    ends = np.cumsum(lens)[:-1]
    inside[ends[(ends > 0) & (ends < flat.size)] - 1] = False
    src, dst = flat[:-1][inside], flat[1:][inside]
    differ = src != dst
    vp = graph.vp
    base = np.arange(graph.units, dtype=np.int64)[:, None] * (2 * vp)
    forward = (base + 2 * np.arange(vp - 1)).ravel()  # forward vs -> forward vs + 1
    last = base.ravel() + 2 * (vp - 1)  # the last forward -> the last backward
    backward = (base + 2 * np.arange(1, vp) + 1).ravel()  # backward vs -> backward vs - 1
    return (
        np.concatenate([src[differ], forward, last, backward]),
        np.concatenate([dst[differ], forward + 2, last + 1, backward - 2]),
    )


def longest_path_ends(
    nodes: int, src: np.ndarray, dst: np.ndarray, duration: np.ndarray
) -> tuple[np.ndarray | None, np.ndarray]:
    """End time of every node of the graph ``src -> dst`` (a node starts at the latest end of
    its predecessors), and the in-degrees left: None and the nodes of a cycle (and all behind
    them) with in-degree > 0 if it has one (``PipelineGraph.stuck`` names them)."""
    indeg = np.bincount(dst, minlength=nodes)
    succ = dst[np.argsort(src, kind="stable")]  # successors, grouped by source (CSR)
    first = np.zeros(nodes + 1, dtype=np.int64)
    np.cumsum(np.bincount(src, minlength=nodes), out=first[1:])
    start = np.zeros(nodes)
    end = np.zeros(nodes)
    level = np.flatnonzero(indeg == 0)
    done = 0
    while level.size:
        done += level.size
        e = end[level] = start[level] + duration[level]
        lo = first[level]
        count = first[level + 1] - lo
        edges = int(count.sum())
        if edges == 0:
            break
        at = np.repeat(np.arange(level.size), count)  # each edge's source, as an index into level
        w = succ[np.arange(edges) + np.repeat(lo - (np.cumsum(count) - count), count)]
        np.maximum.at(start, w, e[at])
        reached, times = np.unique(w, return_counts=True)
        indeg[reached] -= times
        level = reached[indeg[reached] == 0]
    return (end if done == nodes else None), indeg


def graph_ends(
    graph: PipelineGraph, seqs: Sequence[Sequence[int]], barriers: int = 0
) -> tuple[np.ndarray | None, np.ndarray]:
    """``longest_path_ends`` of the graph of ``seqs`` (``barriers`` barrier nodes last, lasting 0)."""
    src, dst = edge_arrays(graph, seqs, barriers)
    duration = np.zeros(graph.total + barriers)
    duration[: graph.total] = graph.dur
    return longest_path_ends(graph.total + barriers, src, dst, duration)


def end_times(graph: PipelineGraph, seqs: Sequence[Sequence[int]], barriers: int = 0) -> list[float] | None:
    """``PipelineGraph.evaluate``: the end of every node, None if the orders deadlock."""
    if graph.total + barriers < SMALL_GRAPH:
        return graph.evaluate(seqs, barriers)
    end = graph_ends(graph, seqs, barriers)[0]
    return None if end is None else end.tolist()


def pipelined_finish_times(
    unit_keys,
    times: Sequence[Sequence[float]],
    stages: int,
    forward_share: float,
    orders: Orders | None = None,
    chunks: int = 1,
) -> list[float] | None:
    """``contract.pipelined_finish_times`` (finish per rank, None if it deadlocks), its longest
    paths taken by ``end_times``."""
    graph = PipelineGraph.of_times(unit_keys, times, stages, forward_share, chunks)
    end = end_times(graph, graph.sequences(orders))
    return None if end is None else graph.finish(end)
