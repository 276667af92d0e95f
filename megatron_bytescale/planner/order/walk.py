"""The pipeline graph's longest paths over arrays: what ``contract.PipelineGraph.evaluate``
gives (the same floats: every end is one sum of a start and a duration, every start one
maximum), for the planner's estimates, the stage-order search and the simulator, which walk
graphs of up to 10^6 operations many times a step. The graph is built from arrays
(``PipelineArrays``: operation ids per resource) and walked node by node in a kernel
(``pipeline_ends``), without edge lists.

The contract keeps its own walk (the standard library only), which ``Plan.validate`` and the
deadlock messages use.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from itertools import chain

import numpy as np

from ..contract import FORWARD, Op, PipelineGraph, as_ops
from ..contract.graph import _default_pattern
from ..jit import kernel


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

    @classmethod
    def of_lists(cls, orders, stages: int) -> ArrayOrders:
        """Orders given as lists per rank and device of (direction, micro-batch[, chunk])."""
        rows = [np.array(as_ops(order), dtype=np.int64).reshape(-1, 3) for rank in orders for order in rank]
        return cls(rows, stages)

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
        number: dict = {}  # each ring's key numbered in order of first appearance (-1: local work)
        rings = np.fromiter((-1 if k is None else number.setdefault(k, len(number)) for k in keys), np.int64, len(keys))
        self._build([len(k) for k in unit_keys], _first_of_ring(rings), t, stages, forward_share, chunks)

    @classmethod
    def of_rings(
        cls, rings: np.ndarray, t: np.ndarray, counts: list[int], stages: int, forward_share: float, chunks: int = 1
    ) -> PipelineArrays:
        """The same from arrays: every micro-batch's ring (-1: local work) and seconds, the
        ranks' ``counts`` of them one after the other (``order/runs.py: item_arrays``)."""
        self = cls.__new__(cls)
        self._build(counts, _first_of_ring(rings), t, stages, forward_share, chunks)
        return self

    def _build(
        self, counts: list[int], same: np.ndarray, t: np.ndarray, stages: int, forward_share: float, chunks: int
    ):
        """``same``: each micro-batch's first of its unit (``_first_of_ring``)."""
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
        # 32-bit ids where they fit (below the nodes' count): half the memory the walk reads
        out = np.empty(int(lens.sum()), dtype=np.int32 if self.total < 2**31 else np.int64)
        return operation_ids(ops, at, lens, self.unit, self.row_start, p, self.vp, chunked, out), lens

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
    row there, each device's count): devices cut from the same slots share one array, so
    the rows are copied once per distinct array, not once per device."""
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


@kernel(size=lambda flat, lens, units, vp, duration, *_: duration.size)
def pipeline_ends(
    flat: np.ndarray,
    lens: np.ndarray,
    units: int,
    vp: int,
    duration: np.ndarray,
    limit: float,
    wait: np.ndarray,
    start: np.ndarray,
    ready: np.ndarray,
) -> int:
    """The longest paths of the pipeline graph, node by node in Kahn's order, without edge
    lists. Each resource (``flat``: resources of ``lens`` one after the other) keeps a cursor
    on its next operation (a run of equal ids counts once: no edge between them); an operation
    is ready once every resource holding it has reached it and its chain predecessor has ended,
    and ending it moves on the cursors that wait on it (a list of them per operation; a
    resource waits on one operation at a time). The chain of a micro-batch's virtual stages
    (``vp`` of them, for ``units`` micro-batches: ids ``(unit vp + vs) 2 + direction``) is
    arithmetic: forward ``vs`` -> forward ``vs + 1``, the last forward -> the last backward,
    backward ``vs`` -> backward ``vs - 1``. Nodes past ``2 units vp`` (barriers) have no
    chain. Every node's end is its start plus its duration, its start the largest end of its
    predecessors (0 without), whatever the order the nodes are walked in.

    The per-node arrays are the caller's, at least one row per node, kept between walks
    (``walk_ends``: large graphs are walked many times a step). Returns how many nodes ended
    (fewer than ``duration.size``: a cycle); then ``start[:nodes]`` holds every node's end
    where all ended, and ``wait[:nodes, 0]`` the in-degrees left (the predecessors not ended:
    resources not yet at the node, and its chain predecessor). The per-node counters are
    32-bit (the caller keeps nodes under 2^31): the walk is bound by memory reads.

    The walk stops (-1 nodes) once some rank is bound to finish after ``limit`` (``math.inf``:
    walk to the end): an operation of a chain ends after it (its micro-batch's last backward,
    which follows it, ends later still: ends only grow along edges), or a resource's next
    operation cannot start before the last one ended plus the seconds of every operation
    left on it (the last of them, and so its micro-batch's last backward, ends after
    ``limit``; a margin of 10^-9 of it covers the subtraction's rounding)."""
    nodes = duration.size
    total = 2 * units * vp
    resources = lens.size
    # per node: the predecessors not ended (one per run of it on a resource, one for a chain
    # predecessor) and the first resource waiting on it (-1: none; the rest linked by ``after``)
    for v in range(nodes):
        wait[v, 0] = 1 if v < total and (v % 2 == 1 or (v // 2) % vp > 0) else 0  # all but a first forward
        wait[v, 1] = -1
        start[v] = 0.0
    first = np.empty(resources + 1, dtype=np.int64)  # each resource's first operation in ``flat``
    # per resource, the seconds of its operations not yet ended (a run once, barriers not
    # counted; kept only with a ``limit``)
    bounded = limit < np.inf
    left = np.zeros(resources)
    at = 0
    for k in range(resources):
        first[k] = at
        for i in range(at, at + lens[k]):
            if i == at or flat[i] != flat[i - 1]:
                wait[flat[i], 0] += 1
                if bounded and flat[i] < total:
                    left[k] += duration[flat[i]]
        at += lens[k]
    first[resources] = at
    cursor = first[:-1].copy()
    after = np.empty(resources, dtype=np.int32)
    tail = 0
    for v in range(nodes):  # nothing to wait for: neither on a resource nor a chain's successor
        if wait[v, 0] == 0:
            ready[tail] = v
            tail += 1
    for k in range(resources):  # every resource at its first operation
        if lens[k] > 0:
            w = flat[first[k]]
            after[k], wait[w, 1] = wait[w, 1], k
            wait[w, 0] -= 1
            if wait[w, 0] == 0:
                ready[tail] = w
                tail += 1
    done = 0  # nodes taken; the ready ones are a stack: the node just made ready (most often
    # the next virtual stage of the same micro-batch, next in memory) is walked next, ~10% faster
    # than first in, first out at 512M tokens, and the ends are the same whatever the order
    while tail > 0:
        tail -= 1
        v = ready[tail]
        done += 1
        e = start[v] + duration[v]
        if v < total:
            if e > limit:
                return -1
            vs = (v // 2) % vp
            nxt = -1  # the chain's successor
            if v % 2 == 0:
                nxt = v + 2 if vs < vp - 1 else v + 1
            elif vs > 0:
                nxt = v - 2
            if nxt >= 0:
                if e > start[nxt]:
                    start[nxt] = e
                wait[nxt, 0] -= 1
                if wait[nxt, 0] == 0:
                    ready[tail] = nxt
                    tail += 1
        k = wait[v, 1]
        while k >= 0:  # the resources that waited on v move on to their next operation
            later = after[k]
            i = cursor[k] + 1
            while i < first[k + 1] and flat[i] == v:
                i += 1
            cursor[k] = i
            if i < first[k + 1]:
                w = flat[i]
                if e > start[w]:
                    start[w] = e
                if bounded and v < total:
                    left[k] -= duration[v]
                    if w < total and (e + left[k]) * (1.0 - 1e-9) > limit:
                        return -1
                after[k], wait[w, 1] = wait[w, 1], k
                wait[w, 0] -= 1
                if wait[w, 0] == 0:
                    ready[tail] = w
                    tail += 1
            k = later
    if done == nodes:
        for v in range(nodes):  # the same sums as in the walk, written in order
            start[v] = start[v] + duration[v]
    return done


@kernel(size=lambda ops, at, lens, *_: int(lens.sum()))
def operation_ids(
    ops: np.ndarray,
    at: np.ndarray,
    lens: np.ndarray,
    unit: np.ndarray,
    row_start: np.ndarray,
    p: int,
    vp: int,
    chunked: bool,
    out: np.ndarray,
) -> np.ndarray:
    """Each op's id (``PipelineArrays.sequences``), written into ``out`` (32-bit where the
    ids fit, which halves what the walk reads) and returned: the rows (direction, micro-batch
    of its rank, chunk or virtual stage) of every device, rank by rank (``p`` devices each),
    device ``d``'s ``lens[d]`` rows of ``ops`` from ``at[d]`` on; ``unit``: each
    micro-batch's unit, a rank's from ``row_start``; a chunk ``c`` on stage ``k`` is virtual
    stage ``c p + k`` (with ``chunked``; else the rows name virtual stages)."""
    i = 0
    for d in range(lens.size):
        base = row_start[d // p]
        k = d % p
        j = at[d]
        for _ in range(lens[d]):
            virtual = ops[j, 2] * p + k if chunked else ops[j, 2]
            out[i] = (unit[base + ops[j, 1]] * vp + virtual) * 2 + ops[j, 0]
            i += 1
            j += 1
    return out


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


def graph_ends(
    graph: PipelineGraph, seqs: Sequence[Sequence[int]], barriers: int = 0
) -> tuple[np.ndarray | None, np.ndarray]:
    """The end of every node (None: the orders deadlock) and the in-degrees left of the
    contract's graph run in ``seqs`` (``barriers`` barrier nodes last, lasting 0)."""
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
    """The ends (None: a deadlock; ``Longer(limit)`` where the walk stopped at ``limit``) and
    the in-degrees left: ``walk_ends``' kept arrays, to read before the next walk."""
    duration = graph.dur
    if barriers or not (isinstance(duration, np.ndarray) and duration.dtype == np.float64):
        duration = np.zeros(graph.total + barriers)  # the barriers last 0
        duration[: graph.total] = graph.dur
    if max(flat.size, duration.size) >= 2**31:  # the walk's counters are 32-bit
        raise ValueError(f"a pipeline graph of {duration.size:,} operations is too large to walk")
    end, indeg, done = walk_ends(flat, lens, graph.units, graph.vp, duration, limit)
    if done < 0:
        return Longer(limit), indeg
    return (end if done == duration.size else None), indeg


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
    """``pipeline_ends`` on this thread's kept arrays: (every node's end, meaningful
    where ``done`` is the node count; the in-degrees left; ``done``: nodes ended, -1 where it
    stopped at ``limit``). The two arrays are views of the kept ones, valid until the next
    walk on this thread: a caller that keeps them copies them."""
    nodes = duration.size
    wait, start, ready = _WALK_ARRAYS.of(nodes)
    done = pipeline_ends(flat, lens, units, vp, duration, limit, wait, start, ready)
    return start[:nodes], wait[:nodes, 0], done


def end_times(graph: PipelineGraph, seqs: Sequence[Sequence[int]], barriers: int = 0) -> list[float] | None:
    """``PipelineGraph.evaluate``: the end of every node, None if the orders deadlock."""
    end = graph_ends(graph, seqs, barriers)[0]
    return None if end is None else end.tolist()


def pipelined_finish_times(unit_keys, times, stages: int, forward_share: float, orders=None, chunks: int = 1):
    """``contract.pipelined_finish_times`` (finish per rank, None if it deadlocks) over
    ``PipelineArrays``; ``orders``: None (the default ones), ``ArrayOrders`` or lists."""
    return finish_times_of(unit_keys, times, stages, forward_share, chunks)(orders)


def finish_times_of(unit_keys, times, stages: int, forward_share: float, chunks: int = 1):
    """``pipelined_finish_times`` of these runs as a function of the orders (and a ``limit``,
    ``finish_times``'), for several orders of the same runs: the graph's arrays are made
    once, on first use."""
    made: list[PipelineArrays] = []

    def finish(orders=None, limit: float = math.inf) -> list[float] | Longer | None:
        if not made:
            made.append(PipelineArrays(unit_keys, times, stages, forward_share, chunks))
        if orders is not None and not isinstance(orders, ArrayOrders):
            orders = ArrayOrders.of_lists(orders, stages)
        return finish_times(made[0], orders, limit)

    return finish


def finish_times(
    pipes: PipelineArrays, orders: ArrayOrders | None = None, limit: float = math.inf
) -> list[float] | Longer | None:
    """Finish per rank of ``pipes`` under ``orders`` (None: the default ones), None if that
    deadlocks: ``pipelined_finish_times`` once the graph's arrays are made. With a ``limit``
    the walk may stop once some rank is bound to finish after it: ``Longer``."""
    end = _ends(pipes, *pipes.sequences(orders), limit=limit)[0]
    return end if end is None or isinstance(end, Longer) else pipes.finish(end)
