"""Interleaved orders that cannot deadlock where every ring sits at one slot on all its
members (``slot_interleaved_orders``): each rank runs its part of one long pipeline over all
slots. Why they are safe: docs/design.md, "Virtual pipeline stages"."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import numpy as np

from ..contract.ops import megatron_interleaved_orders
from ..jit import kernel
from .walk import ArrayOrders


def slot_offsets(ring_keys: Sequence[Sequence[object | None]]) -> list[int] | None:
    """Per rank, the offset of its micro-batch indices such that every ring micro-batch sits at
    one slot (index + offset) on all its members (``order_runs``' alignment), the smallest
    offset of each group of ranks joined by rings 0; None if no such offsets exist. The keys
    (None: local work) are the planner's ring indices (integers from 0) as they are, others
    numbered in order of first appearance, for ``offsets_of_rings``."""
    lens = np.fromiter(map(len, ring_keys), dtype=np.int64, count=len(ring_keys))
    try:
        ids = np.array([-1 if k is None else k for k in chain.from_iterable(ring_keys)])
    except ValueError:  # keys of different shapes (tuples)
        ids = np.zeros(0, dtype=object)
    numbered = ids.ndim == 1 and ids.dtype.kind == "i" and ids.size == lens.sum()
    if numbered:
        ids = ids.astype(np.int64, copy=False)
        units = int(ids.max(initial=-1)) + 1
        # small integers only (``offsets_of_rings`` keeps an entry per key up to the largest)
        numbered = units <= ids.size and np.count_nonzero(ids < 0) == sum(row.count(None) for row in ring_keys)
    if not numbered:
        number: dict = {}
        flat = chain.from_iterable(ring_keys)
        ids = np.fromiter((-1 if k is None else number.setdefault(k, len(number)) for k in flat), np.int64, lens.sum())
        units = len(number)
    off, ok = offsets_of_rings(ids, lens, units)
    return off.tolist() if ok else None


@kernel(size=lambda keys, *_: keys.size)
def offsets_of_rings(keys: np.ndarray, lens: np.ndarray, units: int):
    """``slot_offsets`` over integer ring keys (``keys``: every rank's keys one rank after
    another, ``lens`` per rank; -1 for local work, rings in ``[0, units)``): each later member
    of a ring is tied to its first (in rank order) by the difference of their indices, the
    ranks a ring ties are walked from the lowest, and each group's least offset is 0. Returns
    the offsets and whether they are consistent (no two ties disagree); the offsets are the
    same whatever the order of the walk."""
    n = lens.size
    first_rank = np.full(units, -1, dtype=np.int64)
    first_index = np.zeros(units, dtype=np.int64)
    degree = np.zeros(n + 1, dtype=np.int64)
    at = 0
    for r in range(n):  # the ties: each ring's later members to its first, both ways
        for i in range(lens[r]):
            k = keys[at + i]
            if k >= 0:
                if first_rank[k] < 0:
                    first_rank[k] = r
                    first_index[k] = i
                else:
                    degree[first_rank[k] + 1] += 1
                    degree[r + 1] += 1
        at += lens[r]
    for r in range(n):
        degree[r + 1] += degree[r]
    other = np.empty(degree[n], dtype=np.int64)
    shift = np.empty(degree[n], dtype=np.int64)
    fill = degree[:-1].copy()
    at = 0
    for r in range(n):
        for i in range(lens[r]):
            k = keys[at + i]
            if k >= 0 and (first_rank[k] != r or first_index[k] != i):  # not the ring's first member
                r0, i0 = first_rank[k], first_index[k]
                other[fill[r0]] = r
                shift[fill[r0]] = i0 - i
                fill[r0] += 1
                other[fill[r]] = r0
                shift[fill[r]] = i - i0
                fill[r] += 1
        at += lens[r]
    off = np.zeros(n, dtype=np.int64)
    seen = np.zeros(n, dtype=np.bool_)
    todo = np.empty(n, dtype=np.int64)
    group = np.empty(n, dtype=np.int64)
    for s in range(n):
        if seen[s]:
            continue
        seen[s] = True
        todo[0], group[0] = s, s
        top, size = 1, 1
        while top:
            top -= 1
            a = todo[top]
            for e in range(degree[a], degree[a + 1]):
                b = other[e]
                if not seen[b]:
                    seen[b] = True
                    off[b] = off[a] + shift[e]
                    todo[top] = b
                    top += 1
                    group[size] = b
                    size += 1
                elif off[b] != off[a] + shift[e]:
                    return off, False
        low = off[group[0]]
        for j in range(1, size):
            low = min(low, off[group[j]])
        for j in range(size):
            off[group[j]] -= low
    return off, True


def slot_interleaved_orders(
    ring_keys: Sequence[Sequence[object | None]],
    stages: int,
    chunks: int,
    megatron: bool = False,
    shift: int = 0,
    offsets: list[int] | None = None,
) -> ArrayOrders | None:
    """Interleaved orders that cannot deadlock when rings sit at one slot on all members: the
    order of one long pipeline over all slots (``one_pipeline``, in unit times; with
    ``megatron`` Megatron's fixed
    schedule, ``megatron_interleaved_orders``, its groups of ``stages`` slots starting
    ``shift`` phantom slots before the first), each rank running its own slots' part of it.
    Every operation then has one start time in that run, shared by a ring's members, and
    every device runs its operations in that time order, after all they wait for: no cycle.
    None if the rings admit no slot alignment (``slot_offsets``; ``offsets``: what it gave for
    these keys, where the caller has it)."""
    off = slot_offsets(ring_keys) if offsets is None else offsets
    if off is None:
        return None
    slots = max((o + len(k) for o, k in zip(off, ring_keys)), default=0)
    if megatron:
        full = megatron_interleaved_orders(slots + shift, stages, chunks)
        return _cut_per_rank(full, [o + shift for o in off], ring_keys, stages)
    return _cut_per_rank(_one_pipeline_rows([1.0] * slots, [2.0] * slots, stages, chunks), off, ring_keys, stages)


def _one_pipeline_rows(fwd: Sequence[float], bwd: Sequence[float], stages: int, chunks: int) -> list:
    """``one_pipeline``'s orders, each device's as (direction, micro-batch, chunk) rows."""
    ops, ran = one_pipeline(np.asarray(fwd, dtype=np.float64), np.asarray(bwd, dtype=np.float64), stages, chunks)
    if (ran != 2 * len(fwd) * chunks).any():  # cannot happen: the caps admit every warm-up
        raise AssertionError(
            f"interleaved order for {len(fwd)} micro-batches over {stages} x {chunks} stages did not complete"
        )
    return [rows[:n] for rows, n in zip(ops, ran.tolist())]


@kernel(size=lambda fwd, bwd, p, v: fwd.size * p * p * v, small=128)
def one_pipeline(fwd: np.ndarray, bwd: np.ndarray, p: int, v: int):
    """Every device's order from running one pipeline of ``fwd.size`` micro-batches whose
    chunk forwards (backwards) last ``fwd[m] / v`` (``bwd[m] / v``) over ``p`` devices of
    ``v`` chunks: forwards in groups of ``p`` micro-batches, each group chunk by chunk
    (Megatron's sequence), backwards in the same order with the chunks reversed; each step the
    device whose candidate starts first runs it (a backward before a forward at the same
    start, the lower device on a tie; a forward only while the device holds fewer chunk
    forwards than Megatron's warm-up allows, ``2 (p - 1 - device) + (v - 1) p + 1``). Every
    device runs its forwards (backwards) in one fixed sequence, so two devices agree on the
    order of the messages between them; and the orders are those of a run that completed, so
    they cannot deadlock, whatever the count. Returns each device's ops as (direction,
    micro-batch, chunk) rows and how many each ran (all of them, ``2 count v``, unless the
    caps stopped the run)."""
    count = fwd.size
    n = count * v
    fm = np.empty(n, dtype=np.int64)  # Megatron's forward sequence: (micro-batch, chunk)
    fc = np.empty(n, dtype=np.int64)
    bm = np.empty(n, dtype=np.int64)  # the backward one: the chunks reversed
    bc = np.empty(n, dtype=np.int64)
    i = 0
    for g in range(0, count, p):
        hi = min(g + p, count)
        for c in range(v):
            for m in range(g, hi):
                fm[i] = m
                fc[i] = c
                bm[i] = m
                bc[i] = v - 1 - c
                i += 1
    last = p * v - 1
    f_done = np.zeros((count, p * v), dtype=np.bool_)
    b_done = np.zeros((count, p * v), dtype=np.bool_)
    f_end = np.zeros((count, p * v))
    b_end = np.zeros((count, p * v))
    nf = np.zeros(p, dtype=np.int64)
    nb = np.zeros(p, dtype=np.int64)
    free = np.zeros(p)
    ops = np.empty((p, 2 * n, 3), dtype=np.int64)
    ran = np.zeros(p, dtype=np.int64)
    for _ in range(2 * n * p):
        best_d = -1
        best_start = 0.0
        best_kind = 0
        for d in range(p):
            if nb[d] < n:  # the device's next backward, once the stage after it is done
                m = bm[nb[d]]
                vs = bc[nb[d]] * p + d
                ready = f_done[m, last] if vs == last else b_done[m, vs + 1]
                if ready:
                    start = max(free[d], f_end[m, last] if vs == last else b_end[m, vs + 1])
                    if best_d < 0 or start < best_start or (start == best_start and best_kind > 0):
                        best_d, best_start, best_kind = d, start, 0
            if nf[d] < n and nf[d] - nb[d] < 2 * (p - 1 - d) + (v - 1) * p + 1:  # its next forward
                m = fm[nf[d]]
                vs = fc[nf[d]] * p + d
                if vs == 0 or f_done[m, vs - 1]:
                    start = max(free[d], f_end[m, vs - 1] if vs > 0 else 0.0)
                    if best_d < 0 or start < best_start or (start == best_start and best_kind > 1):
                        best_d, best_start, best_kind = d, start, 1
        if best_d < 0:
            break
        d = best_d
        if best_kind == 0:
            m, c = bm[nb[d]], bc[nb[d]]
            vs = c * p + d
            end = best_start + bwd[m] / v
            b_done[m, vs] = True
            b_end[m, vs] = end
            nb[d] += 1
        else:
            m, c = fm[nf[d]], fc[nf[d]]
            vs = c * p + d
            end = best_start + fwd[m] / v
            f_done[m, vs] = True
            f_end[m, vs] = end
            nf[d] += 1
        free[d] = end
        k = ran[d]
        ops[d, k, 0] = 1 - best_kind  # FORWARD 0, BACKWARD 1
        ops[d, k, 1] = m
        ops[d, k, 2] = c
        ran[d] = k + 1
    return ops, ran


def _cut_per_rank(full: list, offsets: Sequence[int], ring_keys, stages: int) -> ArrayOrders:
    """Each rank's part of one long pipeline's orders: the ops of its slots ``[o, o + len)``,
    renumbered from 0 (ranks with the same slots share one array per device)."""
    whole = [np.asarray(order, dtype=np.int64).reshape(-1, 3) for order in full]  # rows per device
    cut: dict[tuple[int, int], list[np.ndarray]] = {}
    per_device = []
    for o, keys in zip(offsets, ring_keys):
        span = (o, len(keys))
        if span not in cut:
            parts = []
            for ops in whole:
                part = ops[(ops[:, 1] >= o) & (ops[:, 1] < o + len(keys))]
                part[:, 1] -= o  # a copy: boolean indexing
                part.flags.writeable = False
                parts.append(part)
            cut[span] = parts
        per_device += cut[span]
    return ArrayOrders(per_device, stages)
