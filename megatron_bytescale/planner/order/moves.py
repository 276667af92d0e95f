"""The aligned pass's moves of local work (``order.aligned``): a rank short of local
micro-batches to reach a ring's slot splits its own packs in two (``runs.pack_halves``, the
halves timed by the cost model), then borrows from the most loaded ranks that have some to
spare. The pass's state is ``aligned_pass``' tuples of arrays."""

from __future__ import annotations

import numpy as np

from ..cost_model import layer_seconds
from ..jit import jitable
from .runs import pack_halves


@jitable
def derive(r: int, split: bool, rows, pool, ranks, rings) -> None:
    """Rank r's counts and load from its row (the same sums in the same order)."""
    q, qlen = rows
    ptime, plen = pool[0], pool[2]
    clock, nloc, own, load, dirty = ranks[0], ranks[4], ranks[5], ranks[6], ranks[7]
    ring_time = rings[0]
    count, seqs_in, total = 0, 0, 0.0
    for i in range(qlen[r]):
        x = q[r, i]
        if x < 0:
            count += 1
            seqs_in += plen[-x - 1]
            total += ptime[-x - 1]
        else:
            total += ring_time[x]
    nloc[r] = count
    own[r] = seqs_in - count if split else 0
    load[r] = clock[r] + total
    dirty[r] = False


@jitable
def _insert(r: int, i: int, x: int, rows, dirty, state) -> bool:
    """x at position i of r's row; False (and the overflow set) if the row is full."""
    q, qlen = rows
    if qlen[r] == q.shape[1]:
        state[3] = 1
        return False
    for j in range(qlen[r], i, -1):
        q[r, j] = q[r, j - 1]
    q[r, i] = x
    qlen[r] += 1
    dirty[r] = True
    return True


@jitable
def _remove(r: int, i: int, rows, dirty) -> None:
    q, qlen = rows
    for j in range(i, qlen[r] - 1):
        q[r, j] = q[r, j + 1]
    qlen[r] -= 1
    dirty[r] = True


@jitable
def _halve(k: int, pool, state, cost):
    """``PackSplitter``: pack k's halves (``pack_halves``), written into its slice of the
    sequences and timed by the cost model; their pool indices."""
    ptime, pstart, plen, proot, seqs, lens = pool
    coef, layers, recomputed, recomputed_attention = cost
    a1, b1, g, share = coef[0], coef[1], coef[2], coef[3]
    s, m = pstart[k], plen[k]
    part = seqs[s : s + m].copy()
    side = pack_halves(part, lens)  # sorts part: longest first
    first = state[1]
    state[1] = first + 2
    w = s
    for half in range(2):
        tokens, pairs, start = 0, 0, w
        for i in range(m):
            if side[i] == (half == 1):
                seqs[w] = part[i]
                w += 1
                tokens += lens[part[i]]
                pairs += lens[part[i]] * lens[part[i]]
        t = layer_seconds(a1, b1, g, tokens, pairs, share, recomputed, recomputed_attention, layers)
        h = first + half
        ptime[h] = layers * t
        pstart[h] = start
        plen[h] = w - start
        proot[h] = proot[k]
    return first, first + 1


@jitable
def split_own(r: int, short: int, split: bool, rows, pool, ranks, log, cost) -> int:
    """Split r's own packs in two (the largest first) until it has ``short`` more local
    micro-batches; returns how many it still lacks."""
    q, qlen = rows
    ptime, plen = pool[0], pool[2]
    counters, state = log[2], log[4]
    while short > 0 and split:
        big, big_i = -1, -1
        for i in range(qlen[r]):
            x = q[r, i]
            if x < 0 and plen[-x - 1] > 1:
                k = -x - 1
                if big < 0 or plen[k] > plen[big] or (plen[k] == plen[big] and ptime[k] > ptime[big]):
                    big, big_i = k, i
        if big < 0:
            break
        h0, h1 = _halve(big, pool, state, cost)
        q[r, big_i] = -h0 - 1
        if not _insert(r, big_i + 1, -h1 - 1, rows, ranks[7], state):  # (insert marks the row changed)
            return short
        counters[2] += 1
        short -= 1
    return short


@jitable
def borrow(r: int, short: int, u: int, split: bool, rows, pool, ranks, rings, log, cost) -> int:
    """Local micro-batches for r, taken from the most loaded ranks that have some to spare
    (a ring member keeps its ``reserve``); returns how many it still lacks."""
    q, qlen = rows
    plen = pool[2]
    nloc, load, dirty, reserve = ranks[4], ranks[6], ranks[7], ranks[9]
    counters, state = log[2], log[4]
    while short > 0:
        donor, most = -1, -np.inf
        for k in range(qlen.size):
            if dirty[k]:
                derive(k, split, rows, pool, ranks, rings)
            if k != r and nloc[k] - reserve[k] > 0 and load[k] > most:
                donor, most = k, load[k]
        if donor < 0:
            return short
        spare = nloc[donor] - reserve[donor]
        last_i = qlen[donor] - 1
        while q[donor, last_i] >= 0:
            last_i -= 1
        last = -q[donor, last_i] - 1
        if spare == 1 and split and plen[last] > 1:  # the donor keeps half of its only pack
            keep, gift = _halve(last, pool, state, cost)
            q[donor, last_i] = -keep - 1
            counters[2] += 1
        else:
            gift = last
            _remove(donor, last_i, rows, dirty)
        dirty[donor] = True
        at = 0
        while q[r, at] != u:
            at += 1
        if not _insert(r, at, -gift - 1, rows, dirty, state):
            return short
        counters[3] += 1
        short -= 1
    return short
