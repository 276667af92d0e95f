"""The pipeline graph's longest paths as arrays: what ``contract.PipelineGraph.evaluate``
gives (the same floats: every end is one sum of a start and a duration, every start one
maximum), in compiled code (``compiled.pipeline_ends``) or, without numba, with numpy level by
level.

The contract stays the standard library (``Plan.validate`` and the deadlock check use its
node-by-node walk); the planner's estimates, the stage-order search and the simulator evaluate
graphs of 10^4-10^6 operations many times a step, where a Python loop over every edge was
most of the planning time with pipelines. The graphs are built here with numpy (operation ids,
edges as two arrays); a level (the operations whose predecessors have all ended) is a handful
of array operations, and such graphs are 10^2-10^3 levels deep.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from itertools import chain

import numpy as np

from . import compiled
from .contract import FORWARD, Op, PipelineGraph
from .contract import pipelined_finish_times as walked_finish_times
from .contract.graph import _default_pattern

# Graphs smaller than this many operations are walked by the contract's Python loop: the array
# operations of a level cost more than walking a few hundred nodes (one pipeline's 1F1B time).
SMALL_GRAPH = 2048


@dataclass(frozen=True)
class Longer:
    """What a walk given a limit gives where it stopped: an operation ended after ``limit``,
    so the step (the latest rank's finish) is longer; the rest of the graph was not walked
    (whether it deadlocks further on is not known). Where the caller only wants steps up to
    a bound it already has, a losing order costs part of a walk instead of all of it."""

    limit: float


class ArrayOrders(Sequence):
    """Orders per rank and device, as ``PipelineGraph.sequences`` takes them, held as one
    array of (direction, micro-batch, chunk) rows per rank and device (``per_device[r * p +
    k]``; ranks cut from the same slots of one long pipeline share theirs, read-only). Reading
    a rank makes its ``Op`` lists; ``PipelineArrays.sequences`` and ``codes`` read the arrays (the lists
    of 10^6 ops, made and read one by one, were a second per step at 512M tokens)."""

    def __init__(self, per_device: list[np.ndarray], stages: int):
        self.per_device = per_device
        self.stages = stages

    def __len__(self) -> int:
        return len(self.per_device) // self.stages

    def __getitem__(self, r):
        if isinstance(r, slice):
            return [self[i] for i in range(*r.indices(len(self)))]
        r = range(len(self))[r]  # IndexError past the end, as a list
        p = self.stages
        return [[Op(*row) for row in a.tolist()] for a in self.per_device[r * p : (r + 1) * p]]

    def codes(self, chunks: int) -> tuple[tuple[tuple[int, ...], ...], ...]:
        """``contract.encode_stage_orders`` of these orders (``Plan.stage_orders``)."""
        made: dict[int, tuple[int, ...]] = {}  # per shared array
        for a in self.per_device:
            if id(a) not in made:
                x = a[:, 1] * chunks + a[:, 2]
                made[id(a)] = tuple(np.where(a[:, 0] == FORWARD, x, -1 - x).tolist())
        p = self.stages
        return tuple(tuple(made[id(a)] for a in self.per_device[r * p : (r + 1) * p]) for r in range(len(self)))


class PipelineArrays:
    """``PipelineGraph.of_times`` as the longest paths need it, built with array operations
    (the contract's graph asks for every micro-batch's durations one by one): the same units,
    numbered in order of first appearance, the same durations (the same products and
    maxima), the same operation ids. ``unit_keys``, ``times``: as ``pipelined_finish_times``."""

    def __init__(self, unit_keys, times, stages: int, forward_share: float, chunks: int = 1):
        keys = list(chain.from_iterable(unit_keys))
        t = np.fromiter(chain.from_iterable(times), np.float64, len(keys))
        self._build([len(k) for k in unit_keys], _first_of_unit(keys), t, stages, forward_share, chunks)

    @classmethod
    def of_rings(
        cls, rings: np.ndarray, t: np.ndarray, counts: list[int], stages: int, forward_share: float, chunks: int = 1
    ) -> PipelineArrays:
        """The same from arrays: every micro-batch's ring (-1: local work) and seconds, the
        ranks' ``counts`` of them one after the other (``slot_alignment.item_arrays``)."""
        self = cls.__new__(cls)
        self._build(counts, _first_of_ring(rings), t, stages, forward_share, chunks)
        return self

    def _build(
        self, counts: list[int], same: np.ndarray, t: np.ndarray, stages: int, forward_share: float, chunks: int
    ):
        """``same``: each micro-batch's first of its unit (``_first_of_unit``)."""
        self.p, self.v, self.vp, self.n = stages, chunks, stages * chunks, len(counts)
        self.counts = counts
        # units in order of first appearance: a unit's first micro-batch is its own first
        first = same == np.arange(same.size)
        self.unit = (np.cumsum(first) - 1)[same]
        self.units = int(np.count_nonzero(first))
        self.total = self.units * self.vp * 2
        fwd, bwd = np.zeros(self.units), np.zeros(self.units)
        np.maximum.at(fwd, self.unit, forward_share * t / chunks)  # a unit lasts its slowest member's
        np.maximum.at(bwd, self.unit, (1.0 - forward_share) * t / chunks)
        self.dur = np.broadcast_to(np.stack([fwd, bwd], axis=1)[:, None, :], (self.units, self.vp, 2)).ravel()
        self.rank = np.repeat(np.arange(self.n, dtype=np.int64), self.counts)  # each micro-batch's rank
        self.row_start = np.zeros(self.n, dtype=np.int64)
        np.cumsum(self.counts[:-1], out=self.row_start[1:])

    def sequences(self, orders: ArrayOrders | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``PipelineGraph.sequences(orders)`` (no barriers) as arrays: every resource's
        operation ids one after the other, and each resource's count, over all ranks at once."""
        p = self.p
        if orders is None:  # each device's default order: a fixed pattern per micro-batch count
            ops, at, lens = self._default_rows()
        else:
            ops, at, lens = _shared_rows(orders.per_device)
        chunked = orders is not None  # the ops name chunks (else virtual stages)
        kernel = compiled.operation_ids()  # one pass instead of ~10 array operations over all ops
        if kernel is not None:
            # 32-bit ids where they fit (below the nodes' count): half the memory the walk reads
            out = np.empty(int(lens.sum()), dtype=np.int32 if self.total < 2**31 else np.int64)
            return kernel(ops, at, lens, self.unit, self.row_start, p, self.vp, chunked, out), lens
        return _operation_ids(ops, at, lens, self.unit, self.row_start, p, self.vp, chunked), lens

    def _default_rows(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every rank's default orders as ``_shared_rows`` gives them: one block per distinct
        micro-batch count (``_rank_pattern``), each device's rows read from its rank's block."""
        p = self.p
        if not self.n:
            return np.zeros((0, 3), dtype=np.int64), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        distinct, which = np.unique(self.counts, return_inverse=True)
        blocks = [_rank_pattern(int(c), p, self.v) for c in distinct.tolist()]
        block_lens = np.stack([b[1] for b in blocks])  # per distinct count, its devices' op counts
        starts = np.cumsum(block_lens.ravel()) - block_lens.ravel()  # each device's first row in the blocks
        return (
            np.concatenate([b[0] for b in blocks]),
            starts.reshape(-1, p)[which].ravel(),
            block_lens[which].ravel(),
        )

    def finish(self, end: np.ndarray) -> list[float]:
        """Per rank: when its last operation ends (``PipelineGraph.finish``)."""
        finish = np.zeros(self.n)
        np.maximum.at(finish, self.rank, end[self.unit * (2 * self.vp) + 1])
        return finish.tolist()


def _shared_rows(per_device: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every device's rows as (the distinct arrays one after the other, each device's first
    row there, each device's count): devices cut from the same slots share one array (~100
    distinct of 2,048 at 512M tokens), so the rows are not copied once per device (~40 MB)."""
    first: dict[int, int] = {}  # by the array's id: the arrays are alive in ``per_device``
    parts, at, total = [], [], 0
    for a in per_device:
        start = first.get(id(a))
        if start is None:
            start = first[id(a)] = total
            parts.append(a)
            total += len(a)
        at.append(start)
    lens = np.fromiter(map(len, per_device), np.int64, len(per_device))
    ops = np.concatenate(parts) if parts else np.zeros((0, 3), dtype=np.int64)
    return ops, np.array(at, dtype=np.int64), lens


def _operation_ids(
    ops: np.ndarray,
    at: np.ndarray,
    lens: np.ndarray,
    unit: np.ndarray,
    row_start: np.ndarray,
    p: int,
    vp: int,
    chunked: bool,
) -> np.ndarray:
    """Each op's id (``PipelineArrays.sequences``): the rows (direction, micro-batch of its
    rank, chunk or virtual stage) of every device, rank by rank (``p`` devices each), device
    ``d``'s ``lens[d]`` rows of ``ops`` from ``at[d]`` on; ``unit``: each micro-batch's unit,
    a rank's from ``row_start``; a chunk ``c`` on stage ``k`` is virtual stage ``c p + k``.
    ``compiled._operation_ids`` is the same arithmetic op by op."""
    n = lens.size // p
    first = np.cumsum(lens) - lens  # each device's first op in the output
    ops = ops[np.repeat(at - first, lens) + np.arange(int(lens.sum()), dtype=np.int64)]
    virtual = ops[:, 2]
    if chunked:
        virtual = virtual * p + np.repeat(np.tile(np.arange(p, dtype=np.int64), n), lens)
    rank = np.repeat(np.arange(n, dtype=np.int64), lens.reshape(n, p).sum(axis=1))
    return (unit[row_start[rank] + ops[:, 1]] * vp + virtual) * 2 + ops[:, 0]


def _first_of_unit(keys: list) -> np.ndarray:
    """Per micro-batch (``keys``: its ring's key, None for local work), the index of the first
    micro-batch of its ring (its own index for local work). With numpy where the keys are
    integers other than -1 (the planner's ring units), else with a dict."""
    same = np.arange(len(keys), dtype=np.int64)
    try:
        ids = np.array([-1 if key is None else key for key in keys])
    except ValueError:  # keys of different shapes (tuples)
        ids = None
    if ids is not None and ids.ndim == 1 and ids.dtype.kind == "i" and np.count_nonzero(ids == -1) == keys.count(None):
        return _first_of_ring(ids)
    seen: dict = {}  # a ring's first micro-batch, over all ranks in order
    for i, key in enumerate(keys):
        if key is not None:
            same[i] = seen.setdefault(key, i)
    return same


def _first_of_ring(rings: np.ndarray) -> np.ndarray:
    """``_first_of_unit`` where every micro-batch's key is an integer: its ring, -1 for local work."""
    same = np.arange(rings.size, dtype=np.int64)
    at = np.flatnonzero(rings != -1)
    if not at.size:
        return same
    ids = rings[at]
    low, high = int(ids.min()), int(ids.max())
    if high - low <= 4 * ids.size:  # ids in a narrow range (the planner's units): no sort
        first = np.full(high - low + 1, rings.size, dtype=np.int64)
        np.minimum.at(first, ids - low, at)  # the first occurrence of each
        same[at] = first[ids - low]
    else:
        distinct, first = np.unique(ids, return_index=True)  # the first occurrence of each
        same[at] = at[first[np.searchsorted(distinct, ids)]]
    return same


@lru_cache(maxsize=1024)
def _rank_pattern(count: int, stages: int, chunks: int) -> tuple[np.ndarray, np.ndarray]:
    """A rank's default orders for ``count`` micro-batches: (direction, micro-batch, virtual
    stage) per op, its devices one after the other, and each device's op count."""
    rows = [_default_pattern(count, stages, k, chunks) for k in range(stages)]
    ops = np.array([op for row in rows for op in row], dtype=np.int64).reshape(-1, 3)
    return ops, np.array([len(r) for r in rows], dtype=np.int64)


def edge_arrays(
    graph: PipelineGraph | PipelineArrays, flat: np.ndarray, lens: np.ndarray, extra: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """(source, destination) of every edge of ``PipelineGraph.edges``: each resource's
    consecutive operations (``flat``: the resources' sequences one after the other, ``lens``
    their lengths), then each micro-batch's chain of virtual stages."""
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


def longest_path_ends_by_level(
    nodes: int, src: np.ndarray, dst: np.ndarray, duration: np.ndarray
) -> tuple[np.ndarray | None, np.ndarray]:
    """End time of every node of the graph ``src -> dst`` (a node starts at the latest end of
    its predecessors), and the in-degrees left: None and the nodes of a cycle (and all behind
    them) with in-degree > 0 if it has one (``PipelineGraph.stuck`` names them). With numpy,
    one level (the nodes whose predecessors have all ended) at a time: where numba is
    missing (``compiled._pipeline_ends`` walks node by node otherwise, the same floats)."""
    indeg = np.bincount(dst, minlength=nodes)
    succ = dst[np.argsort(src)]  # successors, grouped by source (CSR; their order is moot)
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
    """The ends and in-degrees left (``longest_path_ends_by_level``) of the graph of ``seqs``
    (``barriers`` barrier nodes last, lasting 0)."""
    lens = np.fromiter(map(len, seqs), np.int64, len(seqs))
    flat = np.fromiter(chain.from_iterable(seqs), np.int64, int(lens.sum()))
    end, indeg = _ends(graph, flat, lens, barriers)
    return (None if end is None else end.copy()), indeg.copy()  # not the walk's kept arrays


def _ends(
    graph: PipelineGraph | PipelineArrays,
    flat: np.ndarray,
    lens: np.ndarray,
    barriers: int = 0,
    limit: float = math.inf,
):
    """The ends (None: a deadlock) and in-degrees left; ``Longer(limit)`` for the ends where
    the compiled walk stopped at ``limit`` (the numpy levels walk to the end). The compiled
    walk's arrays are ``walk_ends``' kept ones: read them before the next walk."""
    duration = graph.dur
    if barriers or not (isinstance(duration, np.ndarray) and duration.dtype == np.float64):
        duration = np.zeros(graph.total + barriers)  # the barriers last 0
        duration[: graph.total] = graph.dur
    # (``PipelineArrays.dur`` as it is otherwise: the walks only read it, ~1 ms a copy at 512M)
    if compiled.pipeline_ends() is not None and max(flat.size, duration.size) < 2**31:  # 32-bit indices
        end, indeg, done = walk_ends(flat, lens, graph.units, graph.vp, duration, limit)
        if done < 0:
            return Longer(limit), indeg
        return (end if done == duration.size else None), indeg
    src, dst = edge_arrays(graph, flat, lens, barriers)
    return longest_path_ends_by_level(graph.total + barriers, src, dst, duration)


class _WalkArrays(threading.local):
    """The compiled walk's per-node arrays, kept between walks (per thread) and grown to the
    largest graph walked: ~20 bytes a node, ~16 MB at 512M tokens."""

    def __init__(self):
        self.wait = np.zeros((0, 2), dtype=np.int32)
        self.start = np.zeros(0)
        self.ready = np.zeros(0, dtype=np.int32)

    def of(self, nodes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if nodes > self.start.size:
            self.wait = np.empty((nodes, 2), dtype=np.int32)
            self.start = np.empty(nodes)
            self.ready = np.empty(nodes, dtype=np.int32)
        return self.wait, self.start, self.ready


_WALK_ARRAYS = _WalkArrays()


def walk_ends(
    flat: np.ndarray, lens: np.ndarray, units: int, vp: int, duration: np.ndarray, limit: float = math.inf
) -> tuple[np.ndarray, np.ndarray, int]:
    """``compiled._pipeline_ends`` on this thread's kept arrays: (every node's end, meaningful
    where ``done`` is the node count; the in-degrees left; ``done``: nodes ended, -1 where it
    stopped at ``limit``). The two arrays are views of the kept ones, valid until the next
    walk on this thread: a caller that keeps them copies them."""
    nodes = duration.size
    wait, start, ready = _WALK_ARRAYS.of(nodes)
    done = compiled.pipeline_ends()(flat, lens, units, vp, duration, limit, wait, start, ready)
    return start[:nodes], wait[:nodes, 0], done


def end_times(graph: PipelineGraph, seqs: Sequence[Sequence[int]], barriers: int = 0) -> list[float] | None:
    """``PipelineGraph.evaluate``: the end of every node, None if the orders deadlock."""
    if graph.total + barriers < SMALL_GRAPH:
        return graph.evaluate(seqs, barriers)
    end = graph_ends(graph, seqs, barriers)[0]
    return None if end is None else end.tolist()


def pipelined_finish_times(unit_keys, times, stages: int, forward_share: float, orders=None, chunks: int = 1):
    """``contract.pipelined_finish_times`` (finish per rank, None if it deadlocks): for the
    default orders and ``ArrayOrders`` through ``PipelineArrays`` and the numpy walk, other
    orders and graphs under ``SMALL_GRAPH`` operations by the contract's walk."""
    return finish_times_of(unit_keys, times, stages, forward_share, chunks)(orders)


def finish_times_of(unit_keys, times, stages: int, forward_share: float, chunks: int = 1):
    """``pipelined_finish_times`` of these runs as a function of the orders, for several
    orders of the same runs: the graph's arrays are made once, on first use (~20 ms at 512M
    tokens). A ``limit`` reaches ``finish_times`` (the contract's walk ignores it)."""
    made: list[PipelineArrays] = []
    small = is_small(sum(map(len, unit_keys)), stages, chunks)

    def finish(orders=None, limit: float = math.inf) -> list[float] | Longer | None:
        if (orders is not None and not isinstance(orders, ArrayOrders)) or small:
            return walked_finish_times(unit_keys, times, stages, forward_share, orders, chunks)
        if not made:
            made.append(PipelineArrays(unit_keys, times, stages, forward_share, chunks))
        return finish_times(made[0], orders, limit)

    return finish


def is_small(micro_batches: int, stages: int, chunks: int = 1) -> bool:
    """Whether ``pipelined_finish_times`` walks this graph with the contract's loop."""
    return 2 * stages * chunks * micro_batches < SMALL_GRAPH


def finish_times(
    pipes: PipelineArrays, orders: ArrayOrders | None = None, limit: float = math.inf
) -> list[float] | Longer | None:
    """Finish per rank of ``pipes`` under ``orders`` (None: the default ones), None if that
    deadlocks: ``pipelined_finish_times`` once the graph's arrays are made. With a ``limit``
    the compiled walk may stop once some rank is bound to finish after it: ``Longer``."""
    end = _ends(pipes, *pipes.sequences(orders), limit=limit)[0]
    return end if end is None or isinstance(end, Longer) else pipes.finish(end)
