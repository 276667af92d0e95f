"""The level order: every ring placed again so that all its members have run as many rings
before it (its level), local micro-batches after a rank's last ring. Each ring then takes one
slot on all its members, so 1F1B cannot deadlock (docs/design.md, "Pipeline order"), also
where the schedule's own placement admits no slot alignment (rings over most ranks, little
short work between them); the long rings run back to back on all their members."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

import numpy as np

from ..jit import jitable, kernel
from ..selection import least_of
from .runs import Item, Ordered, RunArrays, run_arrays


def order_by_level(
    runs: Sequence[Sequence[Item]],
    ring_order: Sequence[int],
    members: dict[int, tuple[int, ...]],
    ring_time: dict[int, float],
    ranks_per_node: int = 1,
    arrays: RunArrays | None = None,
) -> Ordered | None:
    """The rings placed again at levels (``_place_by_level``: every member of a ring has run
    as many rings before it, local micro-batches after a rank's last ring) and timed like
    ``order_runs``' result, ``Ordered.members`` holding the new members; None if no placement
    fits. Each ring takes one slot on all its members (its level), so 1F1B cannot deadlock
    (docs/design.md, "Pipeline order"; tests/test_planner_pipeline.py checks it), also where
    the schedule's placement admits no slot alignment (rings over most ranks, little short
    work between them); the long rings run back to back on all their members. ``arrays``:
    ``run_arrays(runs)``, where the caller has it."""
    placed = _place_by_level(runs, ring_order, members, ring_time, ranks_per_node, arrays or run_arrays(runs))
    if placed is None:
        return None
    runs_by_level, new_members, order, clock, items = placed
    again = Ordered(runs_by_level, clock)
    again.members = new_members
    again.items = items
    return again


def _place_by_level(runs, ring_order, members, ring_time, ranks_per_node: int, arrays: RunArrays):
    """Place every ring again so that all its members have run the same number of rings
    before it; local micro-batches run after a rank's last ring. Rings go largest first,
    each to the least-loaded ranks at one level (a ring that fits a node, inside one node),
    so the level its members reach holds at least as many ranks as any later ring needs
    (node bounds aside: then None). Returns the runs, the new members, the ring order, each
    rank's clock as ``sequential`` gives it for these runs (the rings' clocks from
    ``ring_clocks``, then the local work), and the runs' ``Ordered.items``. ``arrays``:
    ``run_arrays(runs)``."""
    n = len(runs)
    # each rank's local micro-batches, in run order: its slice of the pool
    bounds_local = arrays.local_bounds()
    pool, times_local = arrays.pool, arrays.local_time.tolist()
    locals_ = [pool[a:b] for a, b in pairwise(bounds_local)]
    load = np.array([sum(times_local[a:b]) for a, b in pairwise(bounds_local)])  # locals run last, but count
    order = sorted(ring_order, key=lambda u: -len(members[u]))  # stable: schedule order among equals
    rpn = max(1, min(ranks_per_node, n))
    sizes = np.fromiter((len(members[u]) for u in order), dtype=np.int64, count=len(order))
    times = np.fromiter((ring_time[u] for u in order), dtype=np.float64, count=len(order))
    flat, placed = level_placement(load, sizes, times, rpn)
    if placed < len(order):
        return None
    # each ring's members: its slice of ``flat``; each rank's rings in the order placed (a
    # stable sort of the placements by rank)
    ends = np.cumsum(sizes).tolist()
    chosen = flat.tolist()
    new_members = {u: tuple(chosen[a:b]) for u, a, b in zip(order, [0, *ends], ends)}
    by_rank = np.argsort(flat, kind="stable")
    ring_of = np.repeat(np.asarray(order, dtype=np.int64), sizes)[by_rank].tolist()
    bounds = [0, *np.cumsum(np.bincount(flat, minlength=n)).tolist()]
    runs_by_level = [ring_of[bounds[r] : bounds[r + 1]] + locals_[r] for r in range(n)]
    # the items' arrays: each rank's rings, then its local work
    rings_per_rank = np.diff(bounds)
    local_counts = np.diff(bounds_local)
    before = np.cumsum(rings_per_rank + local_counts) - local_counts  # each rank's first local item
    local_at = np.repeat(before - np.cumsum(local_counts) + local_counts, local_counts) + np.arange(local_counts.sum())
    item_rings = np.full(len(flat) + int(local_counts.sum()), -1, dtype=np.int64)
    ring_at = np.ones(item_rings.size, dtype=bool)
    ring_at[local_at] = False
    item_rings[ring_at] = ring_of
    seconds = np.full(item_rings.size, np.nan)
    seconds[local_at] = arrays.local_time
    clock = ring_clocks(flat, sizes, times, n).tolist()
    for r, (a, b) in enumerate(pairwise(bounds_local)):  # then the local work, summed in run order
        c = clock[r]
        for t in times_local[a:b]:
            c += t
        clock[r] = c
    return runs_by_level, new_members, order, clock, (item_rings, seconds)


@kernel(size=lambda load, sizes, times, rpn: int(sizes.sum()) + load.size)
def level_placement(load: np.ndarray, sizes: np.ndarray, times: np.ndarray, rpn: int):
    """``_place_by_level``'s picks for rings of ``sizes`` (in placement order, lasting
    ``times``) over ``load.size`` ranks of ``rpn`` per node. At each level, the ranks at that
    level: a ring larger than a node takes whole nodes of the level first, then the fullest
    part-nodes, ties to the least busy, then the lower node; a smaller ring the least-loaded
    ranks of the level inside one node, ties to lower ranks. Of all levels' picks the one that
    starts first wins, then the one that leaves its members least idle (the loads summed in
    rank order), then the lower level and node. Returns each ring's members (rank order) one
    ring after another, and how many rings were placed (fewer than ``sizes.size``: the next
    fits no level).

    A ring over several nodes looks only at levels that hold it and might start it no later
    than the best so far, at their own ranks (``spanning``: the ranks by level, level ``lv``'s
    in rank order at ``by_level[lstart[lv]:lstart[lv + 1]]``, and each level's least load, kept
    while such a ring is still to come). A ring inside one node reads the root of its size's
    tournament tree over the nodes' best picks (``picks``), whose leaves are made again only
    for the nodes a ring changed."""
    if rpn == 1:
        return levels_one_per_node(load, sizes, times)
    n = load.size
    load = load.copy()
    level = np.zeros(n, dtype=np.int64)
    out = np.empty(int(sizes.sum()), dtype=np.int64)
    pick = np.empty(n, dtype=np.int64)
    best = np.empty(n, dtype=np.int64)
    last_big = -1
    for u in range(sizes.size):
        if sizes[u] > rpn:
            last_big = u
    spanning, picks = _level_state(load, sizes.size, rpn)
    lstart = spanning[1]
    top = 0  # the highest level
    at = 0
    for u in range(sizes.size):
        size = sizes[u]
        if size > rpn:  # whole nodes of a level first, then the fullest, least busy, lowest
            found, b_start = _spanning_pick(size, top, load, spanning, pick, best, rpn)
        else:  # inside one node: its least-loaded ranks of one level, ties to the lower rank
            found, b_start = _in_node_pick(size, load, level, picks, pick, best, rpn)
        if not found:
            return out, u
        end = b_start + times[u]  # the pick's start is its busiest member's load
        lv = level[best[0]]  # every member's level
        for i in range(size):
            r = best[i]
            load[r] = end
            level[r] += 1
            out[at + i] = r
        _picks_stale(best, size, picks, rpn)
        at += size
        if lv + 1 > top:
            top = lv + 1
            lstart[top + 1] = n
        if u < last_big:
            _move_up(best, size, lv, end, load, spanning)
    return out, sizes.size


@jitable
def _level_state(load: np.ndarray, rings: int, rpn: int):
    """Every rank at level 0: the spanning rings' state (the ranks by level, where each
    level starts, each level's least load, and scratch arrays) and the in-node picks' state
    (per node and ring size up to a node: whether its pick is known, whether it has one, its
    start, idle, level and ranks; per ring size the tree over the nodes, whether it is made,
    and the nodes changed since, a stack)."""
    n = load.size
    nodes = n // rpn
    lstart = np.zeros(rings + 3, dtype=np.int64)
    lstart[1] = n
    least = np.full(rings + 2, np.inf)
    if n:
        least[0] = load.min()
    spanning = (
        np.arange(n),  # by_level
        lstart,
        least,
        np.empty(n, dtype=np.int64),  # spare (a level's ranks, while merged)
        np.empty(nodes, dtype=np.int64),  # node_at (a level's nodes: their first rank there)
        np.empty(nodes, dtype=np.int64),  # cand
        np.empty(nodes),  # vals
        np.zeros(nodes, dtype=np.int64),  # count (a level's nodes' ranks there)
        np.empty(nodes),  # busiest
    )
    width = 1
    while width < nodes:
        width *= 2
    picks = (
        np.zeros((nodes, rpn + 1), dtype=np.bool_),  # known
        np.zeros((nodes, rpn + 1), dtype=np.bool_),  # has: some level of the node holds that many
        np.empty((nodes, rpn + 1)),  # start
        np.empty((nodes, rpn + 1)),  # idle
        np.empty((nodes, rpn + 1), dtype=np.int64),  # level
        np.empty((nodes, rpn + 1, rpn), dtype=np.int64),  # ranks
        np.full((rpn + 1, 2 * width), -1, dtype=np.int64),  # tree (leaf width + g: node g, -1 without a pick)
        np.zeros(rpn + 1, dtype=np.bool_),  # built
        np.empty((rpn + 1, max(nodes, 1)), dtype=np.int64),  # dirty
        np.zeros(rpn + 1, dtype=np.int64),  # dirty_top
    )
    return spanning, picks


@jitable
def _spanning_pick(size: int, top: int, load, spanning, pick, best, rpn: int):
    """A ring larger than a node: at each level that holds it and might start it no later
    than the best so far, the level's nodes with more ranks there first, each count's nodes
    least busy first (ties: the lower node), until the ring is full; the earliest start, then
    the least idle, then the lower level. Its ranks into ``best``; returns (found, start)."""
    by_level, lstart, least, _, node_at, _, _, count, busiest = spanning
    found, b_start, b_idle = False, 0.0, 0.0
    for lv in range(top + 1):
        lo, hi_end = lstart[lv], lstart[lv + 1]
        if hi_end - lo < size or (found and least[lv] > b_start):
            continue
        m, i = 0, lo  # the level's nodes, ascending: their first rank, count and busiest
        while i < hi_end:
            g, c, hi = by_level[i] // rpn, 0, -np.inf
            node_at[m] = i
            while i < hi_end and by_level[i] // rpn == g:
                hi = max(hi, load[by_level[i]])
                c += 1
                i += 1
            count[m], busiest[m] = c, hi
            m += 1
        _fullest_nodes(size, m, spanning, pick, rpn)
        chosen = np.sort(pick[:size])
        loads = load[chosen]
        start = loads.max()
        idle = start * size - np.cumsum(loads)[-1]
        # levels rise: equal (start, idle) keep the lower level
        if not found or start < b_start or (start == b_start and idle < b_idle):
            found, b_start, b_idle = True, start, idle
            best[:size] = chosen
    return found, b_start


@jitable
def _fullest_nodes(size: int, m: int, spanning, pick, rpn: int) -> None:
    """The ranks of a level's ``m`` nodes (``spanning``'s node_at, count, busiest) a ring of
    ``size`` takes, into ``pick``: nodes with more ranks at the level first, each count's
    nodes least busy first (ties: the lower node). Only which ranks counts (they are sorted
    next), so each count takes its t least busy nodes by one selection, the t-th of them (the
    greatest taken) only in part."""
    by_level, _, _, _, node_at, cand, vals, count, busiest = spanning
    k = 0
    for c in range(rpn, 0, -1):
        if k == size:
            break
        b = 0  # the count's nodes, ascending
        for q in range(m):
            if count[q] == c:
                cand[b] = q
                b += 1
        need = size - k
        t = min(b, -(-need // c))
        if t == 0:
            continue
        for j in range(b):
            vals[j] = busiest[cand[j]]
        if t < b:  # the t least busy, kept in node order
            taken = least_of(vals[:b], t)
            for j in range(t):  # (taken[j] >= j: read before overwritten)
                cand[j], vals[j] = cand[taken[j]], vals[taken[j]]
        last = -1  # where the t nodes hold more ranks than needed: the greatest
        if t * c > need:  # (busiest, node), which the order would take last
            for j in range(t):
                if last < 0 or vals[j] >= vals[last]:
                    last = j
        for j in range(t):
            q = cand[j]
            take = c if t * c <= need or j != last else need - (t - 1) * c
            for i in range(node_at[q], node_at[q] + take):
                pick[k] = by_level[i]
                k += 1


@jitable
def _in_node_pick(size: int, load, level, picks, pick, best, rpn: int):
    """A ring inside one node: each node's best pick for this size, kept until a ring lands
    on the node, the least of them (equal (start, idle, level): the lower node) at the root of
    the size's tree. Its ranks into ``best``; returns (found, start)."""
    _, has, c_start, _, _, c_pick, tree, built, dirty, dirty_top = picks
    width = tree.shape[1] // 2
    if not built[size]:  # no pick of this size made yet (only here and below are they)
        for g in range(c_start.shape[0]):
            _node_pick(g, size, load, level, picks, pick, rpn)
            tree[size, width + g] = g if has[g, size] else -1
        for i in range(width - 1, 0, -1):
            tree[size, i] = _better_pick(tree[size, 2 * i], tree[size, 2 * i + 1], size, picks)
        built[size] = True
    while dirty_top[size] > 0:
        dirty_top[size] -= 1
        g = dirty[size, dirty_top[size]]
        _node_pick(g, size, load, level, picks, pick, rpn)
        i = width + g  # the node's leaf, and the path above it
        tree[size, i] = g if has[g, size] else -1
        i //= 2
        while i >= 1:
            tree[size, i] = _better_pick(tree[size, 2 * i], tree[size, 2 * i + 1], size, picks)
            i //= 2
    g = tree[size, 1]
    if g < 0:
        return False, 0.0
    best[:size] = c_pick[g, size, :size]
    return True, c_start[g, size]


@jitable
def _better_pick(a: int, b: int, size: int, picks) -> int:
    """The better of two nodes' picks: the least (start, idle, level, node)."""
    c_start, c_idle, c_level = picks[2], picks[3], picks[4]
    if a < 0:
        return b
    if b < 0:
        return a
    sa, sb = c_start[a, size], c_start[b, size]
    if sa != sb:
        return a if sa < sb else b
    ia, ib = c_idle[a, size], c_idle[b, size]
    if ia != ib:
        return a if ia < ib else b
    la, lb = c_level[a, size], c_level[b, size]
    if la != lb:
        return a if la < lb else b
    return a if a < b else b


@jitable
def _node_pick(g: int, size: int, load, level, picks, pick, rpn: int) -> None:
    """Node g's least (start, idle, level) pick of ``size`` ranks of one level."""
    known, has, c_start, c_idle, c_level, c_pick = picks[0], picks[1], picks[2], picks[3], picks[4], picks[5]
    known[g, size], has[g, size] = True, False
    for j0 in range(rpn):
        lv = level[g * rpn + j0]
        seen = False
        for j in range(j0):
            if level[g * rpn + j] == lv:
                seen = True
        if seen:  # each level of the node once
            continue
        c = 0
        for j in range(j0, rpn):
            r = g * rpn + j
            if level[r] == lv:
                pick[c] = r
                c += 1
        if c < size:
            continue
        for i in range(size):  # selection of the least (load, rank), order kept
            m = i
            for q in range(i + 1, c):
                if load[pick[q]] < load[pick[m]]:
                    m = q
            x = pick[m]
            for q in range(m, i, -1):
                pick[q] = pick[q - 1]
            pick[i] = x
        chosen = c_pick[g, 0, :size]  # scratch: the picked ranks in rank order (an insertion sort)
        for i in range(size):
            x = pick[i]
            q = i
            while q > 0 and chosen[q - 1] > x:
                chosen[q] = chosen[q - 1]
                q -= 1
            chosen[q] = x
        loads = load[chosen]  # the loads summed in rank order
        start = loads.max()
        idle = start * size - np.cumsum(loads)[-1]
        if (
            not has[g, size]
            or start < c_start[g, size]
            or (
                start == c_start[g, size]
                and (idle < c_idle[g, size] or (idle == c_idle[g, size] and lv < c_level[g, size]))
            )
        ):
            has[g, size] = True
            c_start[g, size], c_idle[g, size], c_level[g, size] = start, idle, lv
            c_pick[g, size, :size] = chosen


@jitable
def _picks_stale(best, size: int, picks, rpn: int) -> None:
    """The placed ring's members' nodes make their picks again when next asked (once: a node
    stays on the stack until made again)."""
    known, built, dirty, dirty_top = picks[0], picks[7], picks[8], picks[9]
    for i in range(size):
        g = best[i] // rpn
        for k in range(1, rpn + 1):
            if built[k] and known[g, k]:
                dirty[k, dirty_top[k]] = g
                dirty_top[k] += 1
        known[g, :] = False


@jitable
def _move_up(best, size: int, lv: int, end: float, load, spanning) -> None:
    """The placed ring's members (``best``, in rank order) from level lv's ranks to lv + 1's,
    merged in rank order; both levels' least loads kept."""
    by_level, lstart, least, spare = spanning[0], spanning[1], spanning[2], spanning[3]
    a, b, c = lstart[lv], lstart[lv + 1], lstart[lv + 2]
    w, j, low = a, 0, np.inf
    for i in range(a, b):
        r = by_level[i]
        if j < size and r == best[j]:
            j += 1
        else:
            by_level[w] = r
            w += 1
            low = min(low, load[r])
    least[lv] = low
    spare[: c - b] = by_level[b:c]
    i, j = 0, 0
    for q in range(w, c):  # merged with lv + 1's, in rank order
        if j == size or (i < c - b and spare[i] < best[j]):
            by_level[q] = spare[i]
            i += 1
        else:
            by_level[q] = best[j]
            j += 1
    lstart[lv + 1] = w
    least[lv + 1] = end if b == c else min(least[lv + 1], end)


@jitable
def levels_one_per_node(load: np.ndarray, sizes: np.ndarray, times: np.ndarray):
    """``level_placement`` where a node holds one rank (TP fills the node: 70B-class models):
    the same picks and floats. There every rank is its own node, so a ring's pick at a level
    is that level's ``size`` least (load, rank), which start when the last of them is free;
    so each level's ranks are kept sorted by (load, rank) (``order``: level after level, level
    ``lv``'s at ``lstart[lv]:lstart[lv + 1]``), a level's candidate start is one read, and only
    a level that could start the ring no later than the best so far sums its members' loads. A
    ring's members leave the front of their level and join the next one together, at one
    load: a shift and a merge instead of a pass over every rank of every level."""
    n = load.size
    load = load.copy()
    order = np.argsort(load, kind="mergesort")  # stable: ties in rank order
    lstart = np.zeros(sizes.size + 3, dtype=np.int64)
    lstart[1] = n
    top = 0  # the highest level holding ranks
    out = np.empty(int(sizes.sum()), dtype=np.int64)
    best = np.empty(n, dtype=np.int64)
    spare = np.empty(n, dtype=np.int64)
    at = 0
    for u in range(sizes.size):
        size = sizes[u]
        found, b_start, b_idle, b_level = False, 0.0, 0.0, 0
        for lv in range(top + 1):
            lo = lstart[lv]
            if lstart[lv + 1] - lo < size:
                continue
            start = load[order[lo + size - 1]]  # the latest of the level's size least loaded
            if found and start > b_start:
                continue
            chosen = np.sort(order[lo : lo + size])
            idle = start * size - np.cumsum(load[chosen])[-1]  # summed in rank order
            # levels rise: equal (start, idle) keep the lower level
            if not found or start < b_start or (start == b_start and idle < b_idle):
                found, b_start, b_idle, b_level = True, start, idle, lv
                best[:size] = chosen
        if not found:
            return out, u
        end = b_start + times[u]
        for i in range(size):
            load[best[i]] = end
            out[at + i] = best[i]
        at += size
        lv = b_level
        if lv + 1 > top:
            top = lv + 1
            lstart[top + 1] = n
        a, b, c = lstart[lv], lstart[lv + 1], lstart[lv + 2]
        for i in range(a + size, b):  # the level's front leaves (its size least are the members)
            order[i - size] = order[i]
        spare[: c - b] = order[b:c]
        i, j = 0, 0  # the next level's ranks and the members (at ``end``, rank order), merged
        for q in range(b - size, c):
            if j == size or (i < c - b and (load[spare[i]] < end or (load[spare[i]] == end and spare[i] < best[j]))):
                order[q] = spare[i]
                i += 1
            else:
                order[q] = best[j]
                j += 1
        lstart[lv + 1] = b - size
    return out, sizes.size


@kernel(size=lambda flat, *_: flat.size)
def ring_clocks(flat: np.ndarray, sizes: np.ndarray, times: np.ndarray, n: int) -> np.ndarray:
    """Each of ``n`` ranks' clock after its rings, run in order (ring ``u``'s members at
    ``flat``'s next ``sizes[u]``, lasting ``times[u]``) from 0, each starting when its last
    member is free: ``sequential``'s sums for runs of rings alone."""
    clock = np.zeros(n)
    at = 0
    for u in range(sizes.size):
        start = 0.0
        for i in range(at, at + sizes[u]):
            if clock[flat[i]] > start:
                start = clock[flat[i]]
        end = start + times[u]
        for i in range(at, at + sizes[u]):
            clock[flat[i]] = end
        at += sizes[u]
    return clock
