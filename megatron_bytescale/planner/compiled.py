"""Compiled kernels for the planner's hottest loops (numba, a dependency), each the same
arithmetic as the numpy version its caller keeps beside it: that version runs where numba
cannot be imported (a platform without its wheels) and is what the tests check a kernel
against, bit for bit.

numba is imported on a kernel's first use (about 0.2 s), not with the planner. A kernel is
compiled on its first use in an environment (about a second more) and cached on disk (numba's
``cache=True``: beside this module, or in a per-user directory where that is not writable),
so later processes load it in a few milliseconds (where no cache directory is writable, each
process compiles it). The slot-aligned pass's kernel, the largest, has its own module
(``compiled_alignment``).
"""

from __future__ import annotations

from functools import cache

import numpy as np

# ``_schedule`` takes a ring's k least-loaded ranks from its tournament tree (k walks of
# log n) where k x TREE_PICK <= n, else by one selection over all ranks (a few passes of n);
# the same ranks either way
TREE_PICK = 16


def _least_of(values: np.ndarray, k: int) -> np.ndarray:
    """The indices of the k least ``values``, ties to the lowest index, in index order
    (``RingPlacer.place_ranks``' rule; O(n), not a sort): a helper the kernels call, compiled
    with them (``_HELPERS``)."""
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


def _levels_one_per_node(load: np.ndarray, sizes: np.ndarray, times: np.ndarray):
    """``_level_placement`` where a node holds one rank (TP fills the node: 70B-class models),
    called by it: the same picks and floats. There every rank is its own node, so a ring's
    pick at a level is that level's ``size`` least (load, rank), which start when the last of
    them is free; so each level's ranks are kept sorted by (load, rank) (``order``: level
    after level, level ``lv``'s at ``lstart[lv]:lstart[lv + 1]``), a level's candidate start is
    one read, and only a level that could start the ring no later than the best so far sums
    its members' loads. A ring's members leave the front of their level and join the next
    one together, at one load: a shift and a merge instead of a pass over every rank of every
    level (a 512M-token step's ~10^4 rings over 512 ranks)."""
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


def _better_leaf(a: int, b: int, first_a: float, first_b: float, then_a: float, then_b: float) -> int:
    """A tournament tree's pick of two leaves (-1: none): the least (first key, second key,
    index), a helper the kernels call (``_HELPERS``)."""
    if b < 0:
        return a
    if a < 0:
        return b
    if first_a != first_b:
        return a if first_a < first_b else b
    if then_a != then_b:
        return a if then_a < then_b else b
    return a if a < b else b


_HELPERS = ("_least_of", "_levels_one_per_node", "_better_leaf")  # module functions the kernels call: compiled first


def _pipeline_ends(
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
    """``pipeline_times.longest_path_ends_by_level`` over ``edge_arrays``' graph, node by node
    by Kahn's algorithm (a 512M-token step's graphs of ~8 x 10^5 operations are ~10^3 levels deep,
    where each level's array operations cost more than its nodes), without building the edge
    arrays. Each resource (``flat``: resources of ``lens`` one after the other) keeps a cursor
    on its next operation (a run of equal ids counts once: no edge between them); an operation
    is ready once every resource holding it has reached it and its chain predecessor has ended,
    and ending it moves on the cursors that wait on it (a list of them per operation; a
    resource waits on one operation at a time), so no successor lists are built (10-20% of the
    walks' time at 512M tokens). The chain of a micro-batch's virtual stages (``vp`` of them, for
    ``units`` micro-batches: ids ``(unit vp + vs) 2 + direction``) is arithmetic: forward
    ``vs`` -> forward ``vs + 1``, the last forward -> the last backward, backward ``vs`` ->
    backward ``vs - 1``. Nodes past ``2 units vp`` (barriers) have no chain. Every node's end
    is its start plus its duration, its start the largest end of its predecessors (0
    without), so the floats are those of the level-by-level walk, whatever the order.

    The per-node arrays are the caller's, at least one row per node, kept between walks
    (``pipeline_times.walk_ends``): fresh ones of ~16 MB a walk at 512M tokens cost a page fault
    every 4 KB, a third of the walks' time. Returns how many nodes ended (fewer than
    ``duration.size``: a cycle); then ``start[:nodes]`` holds every node's end where all
    ended, and ``wait[:nodes, 0]`` the in-degrees left (the predecessors not ended: resources
    not yet at the node, and its chain predecessor). Memory is what the walk waits on (~10 ns
    a step at 8 x 10^5 nodes): the per-node counters are 32-bit (the caller keeps nodes under
    2^31).

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


def _operation_ids(
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
    """``pipeline_times._operation_ids`` op by op: the same integers, written into ``out`` (one
    per op; 32-bit where the ids fit, which halves what the walk reads) and returned."""
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


def _slot_offsets(keys: np.ndarray, lens: np.ndarray, units: int):
    """``slot_alignment.slot_offsets`` over integer ring keys (``keys``: every rank's keys one
    rank after another, ``lens`` per rank; -1 for local work, rings in ``[0, units)``): each
    later member of a ring is tied to its first (in rank order) by the difference of their
    indices, the ranks a ring ties are walked from the lowest, and each group's least offset
    is 0. Returns the offsets and whether they are consistent (no two ties disagree); the
    offsets are the same whatever the order of the walk."""
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


def _level_placement(load: np.ndarray, sizes: np.ndarray, times: np.ndarray, rpn: int):
    """``slot_alignment._place_by_level``'s picks for rings of ``sizes`` (in placement order,
    lasting ``times``) over ``load.size`` ranks of ``rpn`` per node: the same choices and
    floats as its numpy version (``_level_pick``), rank by rank instead of level by level.
    Returns each ring's members (rank order) one ring after another, and how many rings were
    placed (fewer than ``sizes.size``: the next fits no level)."""
    if rpn == 1:
        return _levels_one_per_node(load, sizes, times)
    n = load.size
    nodes = n // rpn
    load = load.copy()
    level = np.zeros(n, dtype=np.int64)
    out = np.empty(int(sizes.sum()), dtype=np.int64)
    pick = np.empty(n, dtype=np.int64)
    best = np.empty(n, dtype=np.int64)
    count = np.zeros(nodes, dtype=np.int64)
    busiest = np.empty(nodes)
    # the ranks by level (level lv's in rank order at by_level[lstart[lv]:lstart[lv + 1]]) and
    # each level's least load, kept as rings move their members up while a ring over several
    # nodes is still to come (they read them)
    last_big = -1
    for u in range(sizes.size):
        if sizes[u] > rpn:
            last_big = u
    by_level = np.arange(n)
    lstart = np.zeros(sizes.size + 3, dtype=np.int64)
    lstart[1] = n
    least = np.full(sizes.size + 2, np.inf)
    if n:
        least[0] = load.min()
    spare = np.empty(n, dtype=np.int64)
    node_at = np.empty(nodes, dtype=np.int64)
    cand = np.empty(nodes, dtype=np.int64)
    vals = np.empty(nodes)
    top = 0  # the highest level
    # per node and ring size up to a node: its best pick, while ``known``
    known = np.zeros((nodes, rpn + 1), dtype=np.bool_)
    has = np.zeros((nodes, rpn + 1), dtype=np.bool_)  # some level of the node holds that many
    c_start = np.empty((nodes, rpn + 1))
    c_idle = np.empty((nodes, rpn + 1))
    c_level = np.empty((nodes, rpn + 1), dtype=np.int64)
    c_pick = np.empty((nodes, rpn + 1, rpn), dtype=np.int64)
    # per ring size up to a node: a tournament tree over the nodes' picks (leaf ``width + g``:
    # node g, -1 without a pick; an inner node: the better of its two), made on the size's first
    # ring, and the nodes a ring changed since (``dirty``), whose picks are made again then
    width = 1
    while width < nodes:
        width *= 2
    tree = np.full((rpn + 1, 2 * width), -1, dtype=np.int64)
    built = np.zeros(rpn + 1, dtype=np.bool_)
    dirty = np.empty((rpn + 1, max(nodes, 1)), dtype=np.int64)
    dirty_top = np.zeros(rpn + 1, dtype=np.int64)

    def better(a, b, size):  # the better of two nodes' picks: (start, idle, level, node) least
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

    def set_leaf(g, size):  # node g's pick into the size's tree, and the path above it
        i = width + g
        tree[size, i] = g if has[g, size] else -1
        i //= 2
        while i >= 1:
            tree[size, i] = better(tree[size, 2 * i], tree[size, 2 * i + 1], size)
            i //= 2

    def node_pick(g, size):  # node g's least (start, idle, level) pick of ``size`` ranks of one level
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
            loads = load[chosen]  # as in ``_level_pick``: the loads summed in rank order
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

    at = 0
    for u in range(sizes.size):
        size = sizes[u]
        found = False
        b_start, b_idle = 0.0, 0.0
        if size > rpn:  # whole nodes of a level first, then the fullest, least busy, lowest
            # only levels that hold the ring and might start it no later than the best so far
            # are looked at, and only at their own ranks (``by_level``)
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
                # nodes with more ranks at the level first, each count's nodes least busy
                # first (ties: the lower node), until the ring is full: only which ranks
                # counts (they are sorted next), so each count takes its t least busy nodes
                # by one selection, the t-th of them (the greatest taken) only in part
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
                        taken = _least_of(vals[:b], t)
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
                chosen = np.sort(pick[:size])
                loads = load[chosen]
                start = loads.max()
                idle = start * size - np.cumsum(loads)[-1]
                # levels rise: equal (start, idle) keep the lower level
                if not found or start < b_start or (start == b_start and idle < b_idle):
                    found, b_start, b_idle = True, start, idle
                    best[:size] = chosen
        else:  # inside one node: its least-loaded ranks of one level, ties to the lower rank
            # each node's best pick for this size, kept until a ring lands on the node (a ring
            # changes one node or a few), the least of them (equal (start, idle, level): the
            # lower node) at the root of the size's tree
            if not built[size]:  # no pick of this size made yet (only here and below are they)
                for g in range(nodes):
                    node_pick(g, size)
                    tree[size, width + g] = g if has[g, size] else -1
                for i in range(width - 1, 0, -1):
                    tree[size, i] = better(tree[size, 2 * i], tree[size, 2 * i + 1], size)
                built[size] = True
            while dirty_top[size] > 0:
                dirty_top[size] -= 1
                g = dirty[size, dirty_top[size]]
                node_pick(g, size)
                set_leaf(g, size)
            g = tree[size, 1]
            if g >= 0:
                found, b_start = True, c_start[g, size]
                best[:size] = c_pick[g, size, :size]
        if not found:
            return out, u
        end = b_start + times[u]  # the pick's start is its busiest member's load
        lv = level[best[0]]  # every member's level
        for i in range(size):
            r = best[i]
            load[r] = end
            level[r] += 1
            out[at + i] = r
        for i in range(size):  # the members' nodes make their picks again when next asked
            g = best[i] // rpn
            for k in range(1, rpn + 1):
                if built[k] and known[g, k]:  # (once: a node stays dirty until made again)
                    dirty[k, dirty_top[k]] = g
                    dirty_top[k] += 1
            known[g, :] = False
        at += size
        if lv + 1 > top:
            top = lv + 1
            lstart[top + 1] = n
        if u < last_big:  # the members, in rank order, from level lv's ranks to lv + 1's
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
    return out, sizes.size


def _ring_clocks(flat: np.ndarray, sizes: np.ndarray, times: np.ndarray, n: int) -> np.ndarray:
    """Each of ``n`` ranks' clock after its rings, run in order (ring ``u``'s members at
    ``flat``'s next ``sizes[u]``, lasting ``times[u]``) from 0, each starting when its last
    member is free: ``slot_alignment._sequential``'s sums for runs of rings alone."""
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


def _item_slots(number: np.ndarray, counts: np.ndarray, rings: int):
    """``expert_slots._slots_from_ring_times``' slots, item by item: ``number`` each item's
    ring (0 to ``rings - 1``; -1: local), rank after rank (``counts`` per rank). A ring runs
    at the latest, over its members, of max(slot of the member's previous ring + 1, its
    position in the member's queue), found in Kahn's order over the rings;
    a rank's local items take, in order, the first slots none of its rings holds. Returns
    each item's slot and whether every ring was reached (False: they wait in a cycle)."""
    n = counts.size
    total = number.size
    start = np.zeros(n + 1, dtype=np.int64)
    for r in range(n):
        start[r + 1] = start[r] + counts[r]
    held = np.zeros(rings + 1, dtype=np.int64)  # each ring's holders, CSR
    for i in range(total):
        if number[i] >= 0:
            held[number[i] + 1] += 1
    for i in range(rings):
        held[i + 1] += held[i]
    holder = np.empty(held[rings], dtype=np.int64)
    fill = held[:-1].copy()
    for r in range(n):
        for i in range(start[r], start[r + 1]):
            if number[i] >= 0:
                holder[fill[number[i]]] = r
                fill[number[i]] += 1
    slot = np.zeros(rings, dtype=np.int64)
    left = held[1:] - held[:-1]  # members yet to reach each ring
    at = start[:-1].copy()  # each rank's next item that may be a ring
    ready = np.empty(rings, dtype=np.int64)
    top = 0
    prev = np.full(n, -1, dtype=np.int64)  # each rank's previous ring's slot
    todo = np.arange(n)  # ranks that move on to their next ring
    count = n
    done = 0
    while True:
        for t in range(count):  # each rank in ``todo`` reaches its next ring, if any
            r = todo[t]
            while at[r] < start[r + 1] and number[at[r]] < 0:
                at[r] += 1
            if at[r] == start[r + 1]:
                continue
            i = number[at[r]]
            pos = at[r] - start[r]
            s = prev[r] + 1 if prev[r] >= pos else pos
            if s > slot[i]:
                slot[i] = s
            left[i] -= 1
            if left[i] == 0:
                ready[top] = i
                top += 1
        if top == 0:
            break
        top -= 1
        i = ready[top]
        done += 1
        count = held[i + 1] - held[i]
        for c in range(count):  # its members move past it
            r = holder[held[i] + c]
            prev[r] = slot[i]
            at[r] += 1
            todo[c] = r
    out = np.empty(total, dtype=np.int64)
    if done < rings:
        return out, False
    for r in range(n):  # rings at their slots, local items in the first free ones, in order
        free = 0
        for i in range(start[r], start[r + 1]):
            if number[i] >= 0:
                out[i] = slot[number[i]]
        j = start[r]  # the next ring item, whose slot a local item skips
        while j < start[r + 1] and number[j] < 0:
            j += 1
        for i in range(start[r], start[r + 1]):
            if number[i] >= 0:
                continue
            while j < start[r + 1] and slot[number[j]] <= free:
                if slot[number[j]] == free:
                    free += 1
                j += 1
                while j < start[r + 1] and number[j] < 0:
                    j += 1
            out[i] = free
            free += 1
    return out, True


def _schedule(
    order: np.ndarray,
    bucket_ends: np.ndarray,
    seconds: np.ndarray,
    ring_size: np.ndarray,
    group: np.ndarray,
    num_ranks: int,
    rpn: int,
    bubble: int,
    water: float,
    give_up_above: float,
    runs: bool = True,
    ep: int = 1,
    tree_pick: int = TREE_PICK,
):
    """``balance.schedule``'s PP balance (``mode="pp"``, rings placed as ``RingPlacer`` places
    them, in two-level groups included), or with ``runs`` False its DP balance (``mode="dp"``:
    each single-rank unit on its own to the least-loaded rank, ``water`` unused). With ``ep``
    > 1 rings are placed as ``expert_slots.GroupPlacer`` places them: a ring whose size is a
    multiple of ``ep`` (and not in two-level groups) on whole EP groups of ``ep`` consecutive
    ranks. The same units to the same ranks in the same order, the same floats (every clock,
    key and idle the same sum in the same order). ``order``: the units heaviest first, cut
    into buckets ending at ``bucket_ends``; ``group``: each unit's two-level group size
    (``Unit.heads_split``). PP balance balances seconds, so no token counts are kept. The
    least-loaded rank (least key, ties to the lowest rank) comes from a tournament tree over
    the ranks instead of the lazy heap, and so do a ring's k least-loaded ranks where k x
    ``tree_pick`` <= n (the same ranks as one selection over all); each node's keys are kept
    sorted for rings inside one node and groups; the node a ring inside one node goes to
    comes from a tournament tree per ring size over the nodes, and a ring in two-level groups
    takes its groups from a tree per group size over every node's groups, the leaves of both
    made again only for the nodes whose keys changed (a 512M-token step's ~10,000 rings of
    2-8 ranks each read every node's before).

    Returns the (rank, unit) appends of every rank's run, in order; the units in the order
    given; each ring's members one ring after another (in that order); the clocks, keys and
    idle seconds per rank; and whether every unit was given (False: the largest key passed
    ``give_up_above`` first)."""
    n = num_ranks
    nodes = n // rpn
    clock = np.zeros(n)
    key = np.zeros(n)
    idle = np.zeros(n)
    peak = np.zeros(n)
    size = 1
    while size < n:
        size *= 2
    tree = np.empty(2 * size, dtype=np.int64)  # tree[size + r] = r; a node: its subtree's least (key, rank)
    for r in range(size):
        tree[size + r] = r if r < n else -1
    for v in range(size - 1, 0, -1):
        a, b = tree[2 * v], tree[2 * v + 1]
        tree[v] = a if b < 0 or (a >= 0 and key[a] <= key[b]) else b
    by_node = np.zeros((nodes, rpn))  # each node's keys, ascending
    stale = np.zeros(nodes, dtype=np.bool_)  # nodes whose keys changed since sorted
    total_members = 0
    for j in range(order.size):
        total_members += ring_size[order[j]]
    ev_rank = np.empty(total_members, dtype=np.int64)
    ev_unit = np.empty(total_members, dtype=np.int64)
    given = np.empty(order.size, dtype=np.int64)
    members = np.empty(total_members, dtype=np.int64)
    n_given, n_members = 0, 0
    events = np.zeros(1, dtype=np.int64)  # (arrays: the inner functions below change them)
    top = np.zeros(1)  # the largest key
    pick = np.empty(rpn, dtype=np.int64)
    busiest = np.zeros(n // ep)  # each EP group's busiest member's key (ep > 1)
    # per ring size up to a node: each node's earliest start for that many of its ranks and
    # their waits, and a tournament tree over the nodes (leaf ``width + g``: node g; an inner
    # node: the better of its two), made on the size's first ring; the nodes whose keys changed
    # since (``dirty``) are set again before each ring of the size, not every node every ring
    width = 1
    while width < nodes:
        width *= 2
    c_start = np.empty((rpn + 1, max(nodes, 1)))
    c_waits = np.empty((rpn + 1, max(nodes, 1)))
    s_tree = np.full((rpn + 1, 2 * width), -1, dtype=np.int64)
    built = np.zeros(rpn + 1, dtype=np.bool_)
    dirty = np.empty((rpn + 1, max(nodes, 1)), dtype=np.int64)
    dirty_top = np.zeros(rpn + 1, dtype=np.int64)
    is_dirty = np.zeros((rpn + 1, max(nodes, 1)), dtype=np.bool_)
    # per two-level group size g: a tournament tree over every node's groups (leaf ``g_width
    # + node x (rpn / g) + q``: the node's q-th group of g of its ranks least-loaded first, as
    # loaded as its busiest), made on the first ring that needs it, kept as ``s_tree`` is
    g_width = 1
    while g_width < nodes * max(rpn // 2, 1):
        g_width *= 2
    g_val = np.empty((rpn + 1, g_width))
    g_tree = np.full((rpn + 1, 2 * g_width), -1, dtype=np.int64)
    g_built = np.zeros(rpn + 1, dtype=np.bool_)
    g_dirty = np.empty((rpn + 1, max(nodes, 1)), dtype=np.int64)
    g_dirty_top = np.zeros(rpn + 1, dtype=np.int64)
    g_is_dirty = np.zeros((rpn + 1, max(nodes, 1)), dtype=np.bool_)

    def run(r, start, u):  # rank r runs unit u from ``start`` (its own clock, or a ring's)
        idle[r] += start - clock[r]
        clock[r] = start + seconds[u]
        if seconds[u] > peak[r]:
            peak[r] = seconds[u]
        key[r] = clock[r] + bubble * peak[r]
        if key[r] > top[0]:
            top[0] = key[r]
        ev_rank[events[0]], ev_unit[events[0]] = r, u
        events[0] += 1

    def changed(r):  # rank r's key rose: up the tree, and its node's order goes stale
        g = r // rpn
        stale[g] = True
        for k in range(2, rpn + 1):  # and its picks for the ring sizes seen so far
            if built[k] and not is_dirty[k, g]:
                is_dirty[k, g] = True
                dirty[k, dirty_top[k]] = g
                dirty_top[k] += 1
            if g_built[k] and not g_is_dirty[k, g]:
                g_is_dirty[k, g] = True
                g_dirty[k, g_dirty_top[k]] = g
                g_dirty_top[k] += 1
        if ep > 1:
            g = r // ep
            busiest[g] = key[g * ep : g * ep + ep].max()
        v = (size + r) // 2
        while v >= 1:
            a, b = tree[2 * v], tree[2 * v + 1]
            tree[v] = a if b < 0 or (a >= 0 and key[a] <= key[b]) else b
            v //= 2

    def sort_node(g):  # node g's keys ascending in by_node, if they changed (an insertion sort)
        if not stale[g]:
            return
        stale[g] = False
        for j in range(rpn):
            x = key[g * rpn + j]
            q = j
            while q > 0 and by_node[g, q - 1] > x:
                by_node[g, q] = by_node[g, q - 1]
                q -= 1
            by_node[g, q] = x

    def node_pick(g, k):  # node g's k least-loaded ranks: when the last is free, and the waits
        sort_node(g)
        start = by_node[g, k - 1]
        prefix = by_node[g, 0]
        for q in range(1, k):
            prefix += by_node[g, q]
        c_start[k, g] = start
        c_waits[k, g] = k * start - prefix

    def better(a, b, k):  # of two nodes, the one with the least (start, waits, node)
        return _better_leaf(
            a, b, c_start[k, max(a, 0)], c_start[k, max(b, 0)], c_waits[k, max(a, 0)], c_waits[k, max(b, 0)]
        )

    def best_node_of(k):  # ``in one node``: earliest start, least idle, lowest node
        if not built[k]:
            built[k] = True
            for g in range(nodes):
                node_pick(g, k)
                s_tree[k, width + g] = g
            for v in range(width - 1, 0, -1):
                s_tree[k, v] = better(s_tree[k, 2 * v], s_tree[k, 2 * v + 1], k)
        for d in range(dirty_top[k]):
            g = dirty[k, d]
            is_dirty[k, g] = False
            node_pick(g, k)
            v = (width + g) // 2
            while v >= 1:
                s_tree[k, v] = better(s_tree[k, 2 * v], s_tree[k, 2 * v + 1], k)
                v //= 2
        dirty_top[k] = 0
        return s_tree[k, 1]

    def g_better(a, b, g):  # of two groups, the one with the least (busiest key, index)
        return _better_leaf(a, b, g_val[g, max(a, 0)], g_val[g, max(b, 0)], 0.0, 0.0)

    def g_climb(i, g):  # group i's path up the tree of size g
        v = (g_width + i) // 2
        while v >= 1:
            g_tree[g, v] = g_better(g_tree[g, 2 * v], g_tree[g, 2 * v + 1], g)
            v //= 2

    def least_groups(count, g):  # the count least-loaded groups of g (``_least_of`` over every
        # node's groups by their busiest member: ties to the lower node and group), in index
        # order, each taken out of the tree; the caller's ``changed`` of their members puts
        # them back (their nodes' leaves set again before the size's next ring)
        per = rpn // g
        if not g_built[g]:
            g_built[g] = True
            for node in range(nodes):
                sort_node(node)
                for q in range(per):
                    g_val[g, node * per + q] = by_node[node, q * g + g - 1]
                    g_tree[g, g_width + node * per + q] = node * per + q
            for v in range(g_width - 1, 0, -1):
                g_tree[g, v] = g_better(g_tree[g, 2 * v], g_tree[g, 2 * v + 1], g)
        for d in range(g_dirty_top[g]):
            node = g_dirty[g, d]
            g_is_dirty[g, node] = False
            sort_node(node)
            for q in range(per):
                i = node * per + q
                g_val[g, i] = by_node[node, q * g + g - 1]
                g_tree[g, g_width + i] = i
                g_climb(i, g)
        g_dirty_top[g] = 0
        out = np.empty(count, dtype=np.int64)
        for m in range(count):
            i = g_tree[g, 1]
            out[m] = i
            g_tree[g, g_width + i] = -1
            g_climb(i, g)
        out.sort()
        return out

    def least_by_tree(k):  # ``_least_of(key, k)`` for k much smaller than n: the tree's
        # least (key, rank) k times, each taken out of the tree (its path recomputed); the
        # caller's ``changed`` puts every member back with its new key
        out = np.empty(k, dtype=np.int64)
        for m in range(k):
            r = tree[1]
            out[m] = r
            tree[size + r] = -1
            v = (size + r) // 2
            while v >= 1:
                a, b = tree[2 * v], tree[2 * v + 1]
                tree[v] = a if b < 0 or (a >= 0 and key[a] <= key[b]) else b
                v //= 2
        out.sort()
        for m in range(k):
            tree[size + out[m]] = out[m]
        return out

    def whole_groups(k):  # ``GroupPlacer.place_ranks``: the k // ep least busy EP groups (by
        # their busiest member), ties to the lower group, in group order
        out = np.empty(k, dtype=np.int64)
        chosen = _least_of(busiest, k // ep)
        for i in range(chosen.size):
            for q in range(ep):
                out[i * ep + q] = chosen[i] * ep + q
        return out

    def in_groups(k, g):  # ``RingPlacer._in_groups``: a ring of k members in groups of g
        out = np.empty(k, dtype=np.int64)
        least = key[tree[1]]  # key.min()
        at_least = 0  # ranks at the least load, counted until there are k
        for r in range(n):
            if key[r] == least:
                at_least += 1
                if at_least == k:
                    break
        if at_least >= k:  # enough ranks at the least load: whole groups of them
            whole = np.empty(nodes, dtype=np.int64)  # per node: its ranks at the least load, in whole groups
            for node in range(nodes):
                whole[node] = np.count_nonzero(key[node * rpn : (node + 1) * rpn] == least) // g * g
            if whole.sum() >= k:
                m = 0
                for node in range(nodes):
                    seen = 0
                    for j in range(rpn):
                        r = node * rpn + j
                        if key[r] == least:
                            seen += 1
                            if seen <= whole[node] and m < k:
                                out[m] = r
                                m += 1
                return out
        per = rpn // g  # each node's groups: its ranks least loaded first, cut every g
        chosen = least_groups(k // g, g)  # ties: the lower node and group
        local = np.empty(rpn, dtype=np.int64)  # a node's ranks by (key, rank), once per node
        block = np.empty(g, dtype=np.int64)
        last = -1
        for i in range(chosen.size):  # (a node's chosen groups one after another)
            node, q = chosen[i] // per, chosen[i] % per
            if node != last:  # a stable insertion sort: ties keep the lower rank first
                last = node
                for j in range(rpn):
                    x = key[node * rpn + j]
                    p = j
                    while p > 0 and key[node * rpn + local[p - 1]] > x:
                        local[p] = local[p - 1]
                        p -= 1
                    local[p] = j
            for j in range(g):  # the group's ranks in rank order
                x = local[q * g + j]
                p = j
                while p > 0 and block[p - 1] > x:
                    block[p] = block[p - 1]
                    p -= 1
                block[p] = x
            for j in range(g):
                out[i * g + j] = node * rpn + block[j]
        return out

    lo = 0
    for b in range(bucket_ends.size):
        hi = bucket_ends[b]
        i = lo
        while i < hi:
            if top[0] > give_up_above:
                e = events[0]
                return ev_rank[:e], ev_unit[:e], given[:n_given], members[:n_members], clock, key, idle, False
            u = order[i]
            k = ring_size[u]
            if k > 1:  # a ring: placed, then every member runs it from its slowest member's clock
                at = n_members
                if ep > 1 and k % ep == 0 and group[u] == 1:  # on whole EP groups
                    ranks = whole_groups(k)
                elif k <= rpn:  # inside one node: earliest start, least idle, lowest node
                    base = best_node_of(k) * rpn
                    for j in range(rpn):  # the node's ranks by (key, rank): a stable insertion sort
                        x = key[base + j]
                        q = j
                        while q > 0 and key[pick[q - 1]] > x:
                            pick[q] = pick[q - 1]
                            q -= 1
                        pick[q] = base + j
                    ranks = np.sort(pick[:k])  # its k least, in rank order
                elif group[u] > 1 and k % group[u] == 0 and rpn % group[u] == 0:
                    ranks = in_groups(k, group[u])
                elif k * tree_pick <= n:  # the k least-loaded ranks, ties to the lowest, in rank order
                    ranks = least_by_tree(k)
                else:
                    ranks = _least_of(key, k)
                start = clock[ranks[0]]
                for q in range(1, k):
                    start = max(start, clock[ranks[q]])
                for q in range(k):
                    run(ranks[q], start, u)
                    members[at + q] = ranks[q]
                for q in range(k):
                    changed(ranks[q])
                n_members += k
                given[n_given] = u
                n_given += 1
                i += 1
                continue
            # a run: the least-loaded rank takes the bucket's next single-rank units while
            # its key after each stays within the level (water, or the largest key after the first)
            r = tree[1]
            level = 0.0
            first = True
            while True:
                u = order[i]
                i += 1
                run(r, clock[r], u)
                given[n_given] = u
                n_given += 1
                if first:
                    level = max(water, top[0])
                    first = False
                if i >= hi or ring_size[order[i]] > 1 or not runs:  # DP balance: one unit a rank
                    break
                w = seconds[order[i]]
                if clock[r] + w + bubble * max(peak[r], w) > level:
                    break
            changed(r)
        lo = hi
    e = events[0]
    return ev_rank[:e], ev_unit[:e], given[:n_given], members[:n_members], clock, key, idle, True


def _stretch_packs(
    flat: np.ndarray, bounds: np.ndarray, kind: np.ndarray, seq: np.ndarray, lens: np.ndarray, capacity: int
):
    """``planner._rank_items``' walk over every rank's run (``flat``, rank ``r``'s units at
    ``bounds[r]:bounds[r + 1]``; ``kind`` per unit: 0 a short sequence ``seq[u]``, 1 a ring, 2 a
    local micro-batch of its own): the short sequences between two of a rank's other units
    (a stretch) make one micro-batch in run order where they fit ``capacity`` together (or are
    one), else are packed best-fit decreasing as ``sharding.pack_best_fit`` packs them (longest
    first, ties by the lower id; each to the open bin it leaves least room in, ties by the
    earlier bin; bins in the order opened). Returns each rank's items (``codes`` at
    ``item_bounds[r]:item_bounds[r + 1]``: a unit's index, or ``-p - 1`` for micro-batch ``p``)
    and the micro-batches' sequences (``pack_seq`` at ``pack_ends[p - 1]:pack_ends[p]``), in
    the order the Python walk makes them."""
    n_ranks = bounds.size - 1
    codes = np.empty(flat.size, dtype=np.int64)
    item_bounds = np.zeros(n_ranks + 1, dtype=np.int64)
    pack_seq = np.empty(flat.size, dtype=np.int64)
    pack_ends = np.empty(flat.size + 1, dtype=np.int64)
    stretch = np.empty(flat.size, dtype=np.int64)
    sizes = np.empty(flat.size, dtype=np.int64)
    bin_of = np.empty(flat.size, dtype=np.int64)  # per placed item (sorted order): its bin
    free_room = np.empty(flat.size, dtype=np.int64)  # open bins with room: (room, bin) ascending
    free_bin = np.empty(flat.size, dtype=np.int64)
    fill = np.empty(flat.size, dtype=np.int64)
    n_codes = 0
    n_packs = 0
    n_seq = 0
    for r in range(n_ranks):
        n = 0
        tokens = 0
        for j in range(bounds[r], bounds[r + 1] + 1):
            u = flat[j] if j < bounds[r + 1] else -1
            if u >= 0 and kind[u] == 0:
                stretch[n] = seq[u]
                tokens += lens[seq[u]]
                n += 1
                continue
            if n > 0:
                if n == 1 or tokens <= capacity:  # one micro-batch, in run order
                    for i in range(n):
                        pack_seq[n_seq] = stretch[i]
                        n_seq += 1
                    codes[n_codes] = -n_packs - 1
                    n_codes += 1
                    pack_ends[n_packs] = n_seq
                    n_packs += 1
                else:
                    for i in range(n):
                        sizes[i] = lens[stretch[i]]
                    # longest first, ties by the lower id: a stable sort by size of the ids sorted
                    by_id = np.argsort(stretch[:n], kind="mergesort")
                    order = by_id[np.argsort(-sizes[:n][by_id], kind="mergesort")]
                    n_bins = 0
                    n_free = 0
                    for i in range(n):
                        size = sizes[order[i]]
                        lo, hi = 0, n_free  # the first open bin with at least ``size`` room
                        while lo < hi:
                            mid = (lo + hi) // 2
                            if free_room[mid] < size:
                                lo = mid + 1
                            else:
                                hi = mid
                        if lo == n_free:
                            b = n_bins
                            n_bins += 1
                            left = capacity - size
                        else:
                            b = free_bin[lo]
                            left = free_room[lo] - size
                            for k in range(lo, n_free - 1):
                                free_room[k] = free_room[k + 1]
                                free_bin[k] = free_bin[k + 1]
                            n_free -= 1
                        bin_of[i] = b
                        if left > 0:  # back in the list at its (room, bin) place
                            at = n_free
                            while at > 0 and (
                                free_room[at - 1] > left or (free_room[at - 1] == left and free_bin[at - 1] > b)
                            ):
                                free_room[at] = free_room[at - 1]
                                free_bin[at] = free_bin[at - 1]
                                at -= 1
                            free_room[at] = left
                            free_bin[at] = b
                            n_free += 1
                    # the bins in the order opened, each with its items in the order placed
                    for b in range(n_bins):
                        fill[b] = 0
                    for i in range(n):
                        fill[bin_of[i]] += 1
                    start = n_seq
                    for b in range(n_bins):
                        count = fill[b]
                        fill[b] = start
                        start += count
                    for i in range(n):
                        pack_seq[fill[bin_of[i]]] = stretch[order[i]]
                        fill[bin_of[i]] += 1
                    for b in range(n_bins):
                        codes[n_codes] = -n_packs - 1
                        n_codes += 1
                        n_seq = fill[b]
                        pack_ends[n_packs] = n_seq
                        n_packs += 1
                n = 0
                tokens = 0
            if u >= 0:
                codes[n_codes] = u
                n_codes += 1
        item_bounds[r + 1] = n_codes
    return codes[:n_codes], item_bounds, pack_seq[:n_seq], pack_ends[:n_packs]


def _one_pipeline(fwd: np.ndarray, bwd: np.ndarray, p: int, v: int):
    """``slot_alignment._run_one_pipeline``: the same run (Megatron's sequence of chunk
    forwards in groups of ``p`` micro-batches, backwards with the chunks reversed; each step
    the device whose candidate starts first, a backward before a forward at the same start,
    the lower device on a tie; a forward only under the device's warm-up cap), the same
    floats. Returns each device's ops as (direction, micro-batch, chunk) rows and how many
    each ran (all of them: ``2 count v``, unless the caps stopped the run)."""
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


def _ring_curves(
    lengths: np.ndarray,
    lo: np.ndarray,
    hi: np.ndarray,
    spanning: np.ndarray,
    rpn: int,
    ring: np.ndarray,
    us: np.ndarray,
    per_u: np.ndarray,
):
    """``RingSizer.prepare``'s curves of many lengths at once: per length its ring sizes
    ``lo .. hi`` end to end, the share time of each (``sharding.ring_times``) and, where the
    length is ``spanning``, the two-level time of each group size in ``us`` (ascending) where
    it applies and is strictly faster (``two_level.valid_share_times``), with the group size
    taken (1: the plain ring). The same operations in the same order, one entry at a time.
    ``ring``: a1, b1, g, KV bytes, KV + dKV bytes, dKV bytes, latency, intra- and inter-node
    bandwidth, forward share, 1 - forward share, layers; ``per_u`` (a row per group size):
    its query share of the heads, u x that share, u, 1 - 1 / u, the all-to-all bytes per token
    (4 q + 2 kv) and four latencies. Returns sizes, times, group sizes and each length's count."""
    a1, b1, g, kv, kvg, grad, lat, bw_in, bw_out, fs, bs, layers = (
        ring[0],
        ring[1],
        ring[2],
        ring[3],
        ring[4],
        ring[5],
        ring[6],
        ring[7],
        ring[8],
        ring[9],
        ring[10],
        ring[11],
    )
    counts = hi - lo + 1
    total = 0
    for i in range(lengths.size):
        total += counts[i]
    sizes = np.empty(total, dtype=np.int64)
    times = np.empty(total)
    splits = np.ones(total, dtype=np.int64)
    at = 0
    for i in range(lengths.size):
        s = float(lengths[i])
        for size in range(lo[i], hi[i] + 1):
            d = float(size)
            share = np.ceil(s / d)
            compute = a1 * (s * s / d)
            per_layer = compute + b1 * share
            per_layer += g
            bw = bw_out if size > rpn else bw_in
            step = compute / d
            hop_f = share * kv / bw + lat
            hop_b = share * kvg / bw + lat
            home = share * grad / bw + lat
            hop_f -= fs * step
            hop_b -= bs * step
            exposed = max(hop_f, 0.0) + max(hop_b, 0.0)
            exposed *= d - 1
            exposed += home
            if size <= 1:
                exposed = 0.0
            per_layer += exposed
            per_layer *= layers
            split = 1
            if spanning[i] and size > rpn:
                for j in range(us.size):
                    u = us[j]
                    if size % u:
                        continue
                    fq, ufq, uf, a2a_share, a2a_bytes, a2a_lat = (
                        per_u[j, 0],
                        per_u[j, 1],
                        per_u[j, 2],
                        per_u[j, 3],
                        per_u[j, 4],
                        per_u[j, 5],
                    )
                    m = d / uf
                    c = s * s
                    c /= d
                    c *= ufq
                    c *= a1  # a1 x pairs
                    t = b1 * share
                    t += c
                    t += g
                    step2 = c / m
                    block = uf * share
                    block *= fq
                    f2 = block * kv / bw_out + lat
                    b2 = block * kvg / bw_out + lat
                    home2 = block * grad / bw_out + lat
                    if m <= 1:
                        home2 = 0.0
                    f2 -= fs * step2
                    b2 -= bs * step2
                    exposed2 = max(0.0, f2) + max(0.0, b2)
                    exposed2 *= m - 1
                    a2a = share * a2a_share
                    a2a *= a2a_bytes
                    a2a /= bw_in
                    a2a += a2a_lat
                    home2 += a2a
                    exposed2 += home2
                    t += exposed2
                    t *= layers
                    if t < per_layer:
                        per_layer, split = t, u
            sizes[at], times[at], splits[at] = size, per_layer, split
            at += 1
    return sizes, times, splits, counts


def _compile(kernel):
    """``kernel`` compiled, or None where numba is missing (the caller takes its numpy version)."""
    try:
        from numba import njit
    except ImportError:  # pragma: no cover - numba is a dependency; its absence is the fallback's case
        return None
    module = globals()
    for name in _HELPERS:  # a kernel's calls resolve to these when it compiles
        if not hasattr(module[name], "py_func"):
            module[name] = _njit(njit, module[name])
    return _njit(njit, kernel)


def _njit(njit, function):
    try:
        return njit(cache=True, nogil=True)(function)
    except RuntimeError:  # no writable cache directory (numba names none): compiled in each process
        return njit(nogil=True)(function)


@cache
def pipeline_ends():
    """``_pipeline_ends`` compiled, or None where numba is missing."""
    return _compile(_pipeline_ends)


@cache
def operation_ids():
    """``_operation_ids`` compiled, or None where numba is missing."""
    return _compile(_operation_ids)


@cache
def slot_offsets():
    """``_slot_offsets`` compiled, or None where numba is missing."""
    return _compile(_slot_offsets)


@cache
def level_placement():
    """``_level_placement`` compiled, or None where numba is missing."""
    return _compile(_level_placement)


@cache
def ring_clocks():
    """``_ring_clocks`` compiled, or None where numba is missing."""
    return _compile(_ring_clocks)


@cache
def item_slots():
    """``_item_slots`` compiled, or None where numba is missing."""
    return _compile(_item_slots)


@cache
def schedule():
    """``_schedule`` compiled, or None where numba is missing."""
    return _compile(_schedule)


@cache
def stretch_packs():
    """``_stretch_packs`` compiled, or None where numba is missing."""
    return _compile(_stretch_packs)


@cache
def one_pipeline():
    """``_one_pipeline`` compiled, or None where numba is missing."""
    return _compile(_one_pipeline)


@cache
def ring_curves():
    """``_ring_curves`` compiled, or None where numba is missing."""
    return _compile(_ring_curves)
