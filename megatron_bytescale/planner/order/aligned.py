"""The aligned pass: each rank's items reordered so that every ring takes one *slot* (index
plus the rank's offset) on all its members, which keeps 1F1B free of deadlock (docs/design.md,
"Pipeline order"). Rings go in schedule order; the first that can take one slot from what its
members have goes next (looking ``lookahead`` rings ahead); members run some of their local
micro-batches before or after it, split a pack in two (``runs.pack_halves``) or, when no ring
ahead can be aligned, borrow local work from the most loaded rank that has some to spare. A
ring that cannot be aligned at all (no local work left anywhere) is recorded as unaligned.

A rank's queue is a row of item codes (a ring ``u >= 0``, local micro-batch ``k`` of the pool
as ``-k - 1``); what the pass reads of it (its local micro-batches, their clock prefix, its
load) is computed from the row when asked. Splitting a pack writes the halves into the pack's
own slice of the sequence array, so nothing grows but the pool (at most two entries per split,
one split per sequence beyond the first of a pack). A rank whose row fills up makes the pass
return ``FULL``; ``aligned`` runs it again with longer rows (the pass is deterministic and its
inputs are copied).
"""

from __future__ import annotations

from itertools import chain

import numpy as np

from ..jit import jitable, kernel
from ..lengths import lengths_array
from .moves import borrow, derive, split_own
from .runs import Item, LocalBatch, Ordered, PackSplitter, RunArrays, run_arrays

LOOKAHEAD = 16  # rings of the schedule tried for the next slot before local work moves between ranks
# Rings with at least this many members may stop a pass that stops at its first unaligned ring
# early, once they cannot be aligned whatever follows (``hopeless``)
WIDE_RING = 64
# A pass's rows hold a rank's items and this many more (splits and borrowed work lengthen them;
# a row that fills up runs the pass again with rows twice as long)
ROW_ROOM = 8
DONE, STOPPED, FULL = 0, 1, 2  # the pass ended; it stopped at its first unaligned ring; a row overflowed


def aligned(
    runs,
    ring_order,
    members,
    ring_time,
    split: PackSplitter | None,
    lookahead: int,
    stop_unaligned: bool = False,
    arrays: RunArrays | None = None,
) -> Ordered:
    """The aligned pass (see the module docstring) over each rank's items ``runs``: the rings
    in ``ring_order`` (``members``, ``ring_time``), packs split as ``split`` splits them
    (None: packs stay whole), ``lookahead`` rings tried before local work moves between
    ranks; ``stop_unaligned``: stop at the first ring that cannot take one slot. ``arrays``:
    ``run_arrays(runs)``, where the caller has it."""
    n = len(runs)
    arrays = arrays or run_arrays(runs)
    flat, lengths, pool, sizes, seqs = arrays.codes, arrays.counts, arrays.pool, arrays.local_size, arrays.seqs
    supply = int(sizes.sum())
    room = len(pool) + 2 * supply  # two halves per split, at most one split per sequence
    plen = np.zeros(room, dtype=np.int64)
    plen[: len(pool)] = sizes
    pstart = np.zeros(room, dtype=np.int64)
    pstart[1 : len(pool)] = np.cumsum(sizes)[:-1]
    ptime = np.zeros(room)
    ptime[: len(pool)] = arrays.local_time
    proot = np.arange(room, dtype=np.int64)
    order = np.asarray(ring_order, dtype=np.int64)
    units = int(order.max(initial=-1)) + 1
    times = np.zeros(units)
    times[order] = [ring_time[u] for u in ring_order]
    counts = np.zeros(units + 1, dtype=np.int64)
    counts[order + 1] = [len(members[u]) for u in ring_order]
    mptr = np.cumsum(counts)
    # each ring's members at mptr[u]:mptr[u + 1], the rings in index order
    mem = np.fromiter(chain.from_iterable(map(members.__getitem__, sorted(ring_order))), np.int64, int(mptr[-1]))
    if split is None:
        lens, coef, layers, recomputed, recomputed_attention = np.zeros(1, dtype=np.int64), np.zeros(4), 1, 0, 0
    else:
        c = split.cost
        lens = lengths_array(split.lens)
        coef = np.array([c.a1, c.b1, c.g, c.forward_share])
        layers, recomputed, recomputed_attention = c.num_layers, c.recomputed_layers, c.recomputed_attention_layers
    rows = np.repeat(np.arange(n), lengths)
    cols = np.arange(flat.size) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    cap = int(lengths.max(initial=0)) + ROW_ROOM
    while True:  # a row that fills up: again with longer rows (rows grow by splits and gifts)
        q = np.zeros((n, cap), dtype=np.int64)
        q[rows, cols] = flat
        pool_arrays = ptime.copy(), pstart.copy(), plen.copy(), proot.copy()
        halves = seqs.copy()
        status, log_rank, log_item, state, clock, counters, unaligned = aligned_pass(
            q, lengths.copy(), *pool_arrays, len(pool), halves, lens, times, mptr, mem, order, coef, layers,
            recomputed, recomputed_attention, split is not None, lookahead, stop_unaligned, WIDE_RING,
        )  # fmt: skip
        if status != FULL:
            break
        cap = max(2 * cap, 1)
    # the split packs' halves as LocalBatches (those placed), then each rank's items in order
    new_time, new_start, new_len, new_root = pool_arrays
    placed = int(state[0])
    ranks, codes = log_rank[:placed], log_item[:placed]
    table: list[Item | None] = [*pool, *[None] * (int(state[1]) - len(pool))]
    for k in np.unique(-1 - codes[codes < -len(pool)]).tolist():
        at = int(new_start[k])
        seq_ids = tuple(halves[at : at + int(new_len[k])].tolist())
        table[k] = LocalBatch(seq_ids, pool[int(new_root[k])].ratio, float(new_time[k]))
    # code x looked up at x + len(table): table[~x] for a local micro-batch, x for a ring
    lookup = [*reversed(table), *range(units)]
    in_order = codes[np.argsort(ranks, kind="stable")]
    placed_items = list(map(lookup.__getitem__, (in_order + len(table)).tolist()))
    bounds = np.cumsum(np.bincount(ranks, minlength=n)).tolist()
    out = [placed_items[a:b] for a, b in zip([0, *bounds[:-1]], bounds)]
    pulled, deferred, splits, moved, reordered = counters.tolist()
    # the items' arrays: a local item's seconds are its LocalBatch's (the pool's own, or a
    # split half's from the pass)
    local = in_order < 0
    local_time = np.concatenate((ptime[: len(pool)], new_time[len(pool) : len(table)]))
    seconds = np.full(in_order.size, np.nan)
    seconds[local] = local_time[-1 - in_order[local]]
    items = (np.where(local, -1, in_order), seconds)
    unaligned_rings = unaligned[: int(state[2])].tolist()
    return Ordered(out, clock.tolist(), pulled, deferred, splits, moved, reordered, unaligned_rings, items=items)


@kernel(size=lambda q, *_: q.size)
def aligned_pass(
    q: np.ndarray,
    qlen: np.ndarray,
    ptime: np.ndarray,
    pstart: np.ndarray,
    plen: np.ndarray,
    proot: np.ndarray,
    npool: int,
    seqs: np.ndarray,
    lens: np.ndarray,
    ring_time: np.ndarray,
    mptr: np.ndarray,
    mem: np.ndarray,
    order: np.ndarray,
    coef: np.ndarray,
    layers: int,
    recomputed: int,
    recomputed_attention: int,
    split: bool,
    lookahead: int,
    stop_unaligned: bool,
    wide: int,
):
    """The aligned pass over ``q`` (rows of item codes, ``qlen`` long; changed in place, as
    are the pool ``ptime``/``pstart``/``plen``/``proot`` of ``npool`` entries and ``seqs``).
    ``coef``: the cost model's a1, b1, g and forward share. Returns the status, the placed
    items as (rank, item) in placing order, every rank's clock, the counters (pulled,
    deferred, splits, moved, reordered), the unaligned rings and the state (log length, pool
    size, unaligned count, overflow).

    The state the helpers share, as tuples of arrays: ``rows`` (q, qlen), ``pool`` (ptime,
    pstart, plen, proot, seqs, lens), ``ranks`` (per rank: clock, slot offset, whether it has
    one, items placed, local micro-batches queued, sequences its packs could still give by
    splitting, load, whether the last four are out of date, rings left, what it keeps for a
    ring), ``rings`` (ring_time, mptr, mem), ``scratch`` (per member of the ring being placed:
    its take, cursor and shortfall; the fixed members' clock prefixes) and ``log`` (the placed
    items, the counters, the unaligned rings, the state)."""
    rows, pool, rings = (q, qlen), (ptime, pstart, plen, proot, seqs, lens), (ring_time, mptr, mem)
    cost = (coef, layers, recomputed, recomputed_attention)
    ranks, scratch, log, supply = _pass_state(rows, pool, rings, order, npool)
    clock, counters, unaligned, state = ranks[0], log[2], log[3], log[4]
    # the pending rings in schedule order, a doubly linked list (the lookahead deletes inside it)
    count = order.size
    nxt = np.arange(1, count + 1, dtype=np.int64)
    prv = np.arange(-1, count - 1, dtype=np.int64)
    if count:
        nxt[count - 1] = -1
    head = 0 if count else -1
    while head >= 0:
        # the first ring (in schedule order) that can take one slot from what its members
        # have; if none of the next ``lookahead`` can, the first borrows local work
        p, k, borrowing = head, 0, False
        while True:
            u = order[p]
            if _aligned_take(u, borrowing, split, rows, pool, ranks, rings, scratch, log, cost):
                break
            if state[3]:
                return FULL, log[0], log[1], state, clock, counters, unaligned
            if borrowing:  # no local work left anywhere: this ring cannot be aligned
                unaligned[state[2]] = u
                state[2] += 1
                if stop_unaligned:
                    return STOPPED, log[0], log[1], state, clock, counters, unaligned
                _unaligned_take(u, split, rows, pool, ranks, rings, scratch)
                break
            if stop_unaligned and mptr[u + 1] - mptr[u] >= wide and _hopeless(u, supply, ranks, rings):
                unaligned[state[2]] = u
                state[2] += 1
                return STOPPED, log[0], log[1], state, clock, counters, unaligned
            p = nxt[p]
            k += 1
            if p < 0 or k >= lookahead:
                p, k, borrowing = head, 0, True
        if k > 0:
            counters[4] += 1
        if prv[p] >= 0:
            nxt[prv[p]] = nxt[p]
        else:
            head = nxt[p]
        if nxt[p] >= 0:
            prv[nxt[p]] = prv[p]
        supply = _place(u, supply, rows, pool, ranks, rings, scratch, log)
    for r in range(qlen.size):  # what is left of every row runs after its last ring
        for i in range(qlen[r]):
            x = q[r, i]
            _log(r, x, log)
            clock[r] += ring_time[x] if x >= 0 else ptime[-x - 1]
        qlen[r] = 0
    return DONE, log[0], log[1], state, clock, counters, unaligned


@jitable
def _pass_state(rows, pool, rings, order, npool: int):
    """The pass's start: every rank without a slot offset (its counts out of date), the
    scratch sized for the widest ring, the log sized for every item placed once plus one more
    per split (at most one per sequence); and the sequences in local micro-batches."""
    q, qlen = rows
    plen = pool[2]
    mptr = rings[1]
    n = qlen.size
    rings_left = np.zeros(n, dtype=np.int64)
    supply = 0
    items = 0
    for r in range(n):
        items += qlen[r]
        for i in range(qlen[r]):
            x = q[r, i]
            if x >= 0:
                rings_left[r] += 1
            else:
                supply += plen[-x - 1]
    ranks = (
        np.zeros(n),  # clock
        np.zeros(n, dtype=np.int64),  # offset
        np.zeros(n, dtype=np.bool_),  # fixed
        np.zeros(n, dtype=np.int64),  # olen
        np.zeros(n, dtype=np.int64),  # nloc
        np.zeros(n, dtype=np.int64),  # own
        np.zeros(n),  # load
        np.ones(n, dtype=np.bool_),  # dirty
        rings_left,
        np.zeros(n, dtype=np.int64),  # reserve
    )
    width = 1
    for u in order:
        width = max(width, mptr[u + 1] - mptr[u])
    scratch = (
        np.zeros(width, dtype=np.int64),  # take
        np.zeros(width, dtype=np.int64),  # cursor
        np.zeros(width, dtype=np.int64),  # shorts
        np.empty(items + supply + n + 1),  # pre: the fixed members' clock prefixes, one after another
        np.zeros(width + 1, dtype=np.int64),  # pre_at
    )
    state = np.zeros(4, dtype=np.int64)  # log length, pool size, unaligned count, overflow
    state[1] = npool
    log = (
        np.empty(items + supply + 1, dtype=np.int64),  # log_rank
        np.empty(items + supply + 1, dtype=np.int64),  # log_item
        np.zeros(5, dtype=np.int64),  # counters: pulled, deferred, splits, moved, reordered
        np.empty(order.size, dtype=np.int64),  # unaligned
        state,
    )
    return ranks, scratch, log, supply


@jitable
def _natural(r: int, u: int, rows) -> int:
    """Local micro-batches before ring u on rank r."""
    q, qlen = rows
    count = 0
    for i in range(qlen[r]):
        x = q[r, i]
        if x == u:
            return count
        if x < 0:
            count += 1
    return count


@jitable
def _prefix(r: int, k: int, rows, ptime, clock) -> float:
    """The clock after r's first k local micro-batches."""
    q = rows[0]
    c = clock[r]
    i = 0
    while k > 0:
        x = q[r, i]
        if x < 0:
            c += ptime[-x - 1]
            k -= 1
        i += 1
    return c


@jitable
def _last_within(r: int, slack: float, rows, ptime, clock) -> int:
    """The most local micro-batches r runs with its clock <= slack."""
    q, qlen = rows
    c = clock[r]
    k = 0
    for i in range(qlen[r]):
        x = q[r, i]
        if x < 0:
            c += ptime[-x - 1]
            if c > slack:
                return k
            k += 1
    return k


@jitable
def _log(r: int, x: int, log) -> None:
    log_rank, log_item, state = log[0], log[1], log[4]
    e = state[0]
    log_rank[e] = r
    log_item[e] = x
    state[0] = e + 1


@jitable
def _start_at(slot: int, a: int, b: int, fixed, mem, scratch) -> float:
    """The latest clock of ring mem[a:b]'s fixed members run up to ``slot``."""
    cursor, pre, pre_at = scratch[1], scratch[3], scratch[4]
    best = -np.inf
    for j in range(b - a):
        if fixed[mem[a + j]]:
            v = pre[pre_at[j] + slot - cursor[j]]
            if v > best:
                best = v
    return best


@jitable
def _shortfall(u: int, borrowing: bool, split: bool, rows, pool, ranks, rings, scratch, log, cost):
    """What ring u's fixed members lack of local work to reach the latest member's next slot,
    made up by splitting their packs and (``borrowing``) taking others' work. Returns whether
    it was, whether any member holds a slot, and that latest slot."""
    offset, fixed, olen, nloc, own, dirty, reserve = (
        ranks[1],
        ranks[2],
        ranks[3],
        ranks[4],
        ranks[5],
        ranks[7],
        ranks[9],
    )
    mptr, mem = rings[1], rings[2]
    cursor, shorts = scratch[1], scratch[2]
    a, b = mptr[u], mptr[u + 1]
    lo, anyfixed = 0, False
    for j in range(b - a):
        r = mem[a + j]
        if dirty[r]:
            derive(r, split, rows, pool, ranks, rings)
        if fixed[r]:
            cursor[j] = offset[r] + olen[r]
            if not anyfixed or cursor[j] > lo:
                lo = cursor[j]
            anyfixed = True
    missing = 0
    for j in range(b - a):
        r = mem[a + j]
        if fixed[r]:
            shorts[j] = lo - cursor[j] - nloc[r]
            if shorts[j] - own[r] > 0:
                missing += shorts[j] - own[r]
    if missing and not borrowing:
        return False, anyfixed, lo
    if missing:
        for j in range(b - a):
            r = mem[a + j]
            if fixed[r]:
                reserve[r] = max(0, lo - cursor[j])
        spare = 0
        for k in range(nloc.size):
            if dirty[k]:
                derive(k, split, rows, pool, ranks, rings)
            have = nloc[k] - reserve[k]
            if have > 0:
                spare += have + own[k]
        if missing > spare:
            for j in range(b - a):
                reserve[mem[a + j]] = 0
            return False, anyfixed, lo
    for j in range(b - a):
        r = mem[a + j]
        if fixed[r] and shorts[j] > 0:
            short = split_own(r, shorts[j], split, rows, pool, ranks, log, cost)
            if short > 0 and borrowing:
                short = borrow(r, short, u, split, rows, pool, ranks, rings, log, cost)
            if short > 0 or log[4][3]:
                for i in range(b - a):
                    reserve[mem[a + i]] = 0
                return False, anyfixed, lo
    for j in range(b - a):
        reserve[mem[a + j]] = 0
        if dirty[mem[a + j]]:
            derive(mem[a + j], split, rows, pool, ranks, rings)
    return True, anyfixed, lo


@jitable
def _aligned_take(u: int, may_borrow: bool, split, rows, pool, ranks, rings, scratch, log, cost):
    """Ring u's takes (local micro-batches each member runs before it, in ``scratch``) so
    that it takes one slot on all its members: the latest slot whose start is no later than
    the schedule's own start, else the earliest start possible;
    a member without a slot yet fills the wait. False where its members lack the work (even
    with ``may_borrow``: taking others' work)."""
    q, qlen = rows
    ptime = pool[0]
    clock, fixed, nloc = ranks[0], ranks[2], ranks[4]
    mptr, mem = rings[1], rings[2]
    take, cursor, pre, pre_at = scratch[0], scratch[1], scratch[3], scratch[4]
    ok, anyfixed, lo = _shortfall(u, may_borrow, split, rows, pool, ranks, rings, scratch, log, cost)
    if not ok:
        return False
    a, b = mptr[u], mptr[u + 1]
    planned = -np.inf
    for j in range(b - a):
        r = mem[a + j]
        p = _prefix(r, _natural(r, u, rows), rows, ptime, clock)
        if p > planned:
            planned = p
    slack = planned * (1 + 1e-12)
    if anyfixed:
        hi = -1
        w = 0
        for j in range(b - a):  # the fixed members' prefixes, to time any slot
            r = mem[a + j]
            pre_at[j] = w
            if fixed[r]:
                if hi < 0 or cursor[j] + nloc[r] < hi:
                    hi = cursor[j] + nloc[r]
                c = clock[r]
                pre[w] = c
                w += 1
                for i in range(qlen[r]):
                    x = q[r, i]
                    if x < 0:
                        c += ptime[-x - 1]
                        pre[w] = c
                        w += 1
        lo_slot, hi_slot = lo, hi
        if _start_at(lo, a, b, fixed, mem, scratch) <= slack:
            while lo_slot < hi_slot:
                mid = (lo_slot + hi_slot + 1) // 2
                if _start_at(mid, a, b, fixed, mem, scratch) <= slack:
                    lo_slot = mid
                else:
                    hi_slot = mid - 1
        for j in range(b - a):
            if fixed[mem[a + j]]:
                take[j] = lo_slot - cursor[j]
        s = _start_at(lo_slot, a, b, fixed, mem, scratch)
        if s > slack:
            slack = s
    for j in range(b - a):
        r = mem[a + j]
        if not fixed[r]:
            take[j] = _last_within(r, slack, rows, ptime, clock)
    return True


@jitable
def _latest_slot(a: int, b: int, ranks, mem) -> int:
    """The latest next slot of ring mem[a:b]'s fixed members (0 without)."""
    offset, fixed, olen = ranks[1], ranks[2], ranks[3]
    lo, anyfixed = 0, False
    for j in range(b - a):
        r = mem[a + j]
        if fixed[r]:
            c = offset[r] + olen[r]
            if not anyfixed or c > lo:
                lo = c
            anyfixed = True
    return lo


@jitable
def _unaligned_take(u: int, split: bool, rows, pool, ranks, rings, scratch) -> None:
    """Ring u misses its slot: each fixed member runs its local work up to the latest slot."""
    offset, fixed, olen, nloc, dirty = ranks[1], ranks[2], ranks[3], ranks[4], ranks[7]
    mptr, mem = rings[1], rings[2]
    take = scratch[0]
    a, b = mptr[u], mptr[u + 1]
    lo = _latest_slot(a, b, ranks, mem)
    for j in range(b - a):
        r = mem[a + j]
        if dirty[r]:
            derive(r, split, rows, pool, ranks, rings)
        take[j] = min(nloc[r], max(0, lo - offset[r] - olen[r])) if fixed[r] else 0


@jitable
def _hopeless(u: int, supply: int, ranks, rings) -> bool:
    """Whether ring u can no longer take one slot on all its members, however the rings still
    queued are placed and local work moves (docs/design.md, "Pipeline order")."""
    offset, fixed, olen, rings_left = ranks[1], ranks[2], ranks[3], ranks[8]
    mptr, mem = rings[1], rings[2]
    a, b = mptr[u], mptr[u + 1]
    count, most, total, left = 0, 0, 0, 0
    for j in range(b - a):
        r = mem[a + j]
        left += rings_left[r]
        if fixed[r]:
            c = offset[r] + olen[r]
            if count == 0 or c > most:
                most = c
            total += c
            count += 1
    if count == 0:
        return False
    phi = count * most - total - supply
    return phi > 0 and phi > left - (b - a)


@jitable
def _place(u: int, supply: int, rows, pool, ranks, rings, scratch, log) -> int:
    """Ring u placed after each member's takes, starting when its last member is there;
    returns the sequences left in local micro-batches."""
    q, qlen = rows
    ptime, plen = pool[0], pool[2]
    clock, offset, fixed, olen, dirty, rings_left = ranks[0], ranks[1], ranks[2], ranks[3], ranks[7], ranks[8]
    ring_time, mptr, mem = rings
    take, counters = scratch[0], log[2]
    a, b = mptr[u], mptr[u + 1]
    start = 0.0
    ran = 0
    for j in range(b - a):
        r = mem[a + j]
        t, nat = take[j], _natural(r, u, rows)
        if t > nat:
            counters[0] += t - nat
        else:
            counters[1] += nat - t
        end = _prefix(r, t, rows, ptime, clock)
        if end > start:
            start = end
        k = 0
        i = 0
        while k < t:  # the first t local micro-batches run before the ring
            x = q[r, i]
            if x < 0:
                _log(r, x, log)
                ran += plen[-x - 1]
                k += 1
            i += 1
        olen[r] += t
    slot = _latest_slot(a, b, ranks, mem)
    end = start + ring_time[u]
    for j in range(b - a):
        r = mem[a + j]
        rings_left[r] -= 1
        if not fixed[r]:
            offset[r] = slot - olen[r]
            fixed[r] = True
        _log(r, u, log)
        olen[r] += 1
        clock[r] = end
        # the row without its first take[j] local micro-batches and u, in order
        k, w = take[j], 0
        for i in range(qlen[r]):
            x = q[r, i]
            if (x < 0 and k > 0) or x == u:
                if x < 0:
                    k -= 1
                continue
            q[r, w] = x
            w += 1
        qlen[r] = w
        dirty[r] = True
    return supply - ran
