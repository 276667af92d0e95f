"""The balance scheduler's kernel: every unit to ranks, heaviest first (``schedule``'s rules).

Placement of a ring (the ring starts when its last member is free, so each rule minimises
that start, then the idle time of the members that wait):

* a ring that fits in a node goes inside one node: the node whose ``size`` least-loaded
  ranks start earliest (then leave least idle, then the lowest node), those ranks;
* under expert parallelism a ring of whole EP groups (a multiple of ``ep`` ranks, not in
  two-level groups) takes the least busy groups (a group is as loaded as its busiest member;
  ties to lower groups), so no group mixes two rings in one slot;
* a two-level ring (groups of ``g`` members of one node) takes the least-loaded groups, each
  node's ranks cut into groups least-loaded first (ties to the lower node and group), unless
  enough whole groups sit at the least load (rings placed early): the lowest of those;
* any other ring takes the ``size`` least-loaded ranks, ties to the lowest ranks, which on
  an idle cluster are whole consecutive nodes.

Members are ordered by rank: consecutive members are neighbours, and a ring crosses node
boundaries only where it must.
"""

from __future__ import annotations

import numpy as np

from ..jit import kernel
from ..selection import better_leaf, least_of

# A ring's k least-loaded ranks come from the tournament tree (k walks of log n) where k x
# TREE_PICK <= n, else from one selection over all ranks (a few passes of n): the same ranks
TREE_PICK = 16


@kernel(size=lambda order, *_: order.size)
def assign(
    order: np.ndarray,
    bucket_ends: np.ndarray,
    seconds: np.ndarray,
    tokens: np.ndarray,
    ring_size: np.ndarray,
    group: np.ndarray,
    num_ranks: int,
    rpn: int,
    bubble: int,
    water: float,
    give_up_above: float,
    runs: bool,
    by_tokens: bool,
    ep: int,
    tree_pick: int,
):
    """``schedule``'s assignment: PP balance with ``runs`` (the least-loaded rank takes the
    bucket's next single-rank units while its key stays within the level, ``water`` or the
    largest key so far), else DP balance (each single-rank unit on its own to the
    least-loaded rank); keys are clock plus ``bubble`` x the rank's longest unit, or with
    ``by_tokens`` its token count. Rings are placed by the rules of the module docstring
    (``ep`` > 1: whole EP groups for rings that are multiples of ``ep``; ``group``: each
    unit's two-level group size). ``order``: the units heaviest first, cut into buckets
    ending at ``bucket_ends``. The least-loaded rank (least key, ties to the lowest rank) comes
    from a tournament tree over the ranks, and so do a ring's k least-loaded ranks where k x
    ``tree_pick`` <= n; each node's keys are kept sorted for rings inside one node and groups;
    the node a ring inside one node goes to comes from a tournament tree per ring size over the
    nodes, and a two-level ring takes its groups from a tree per group size over every node's
    groups, the leaves of both made again only for the nodes whose keys changed.

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
    count = np.zeros(n)  # tokens per rank
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
        count[r] += tokens[u]
        if seconds[u] > peak[r]:
            peak[r] = seconds[u]
        key[r] = count[r] if by_tokens else clock[r] + bubble * peak[r]
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
        return better_leaf(
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
        return better_leaf(a, b, g_val[g, max(a, 0)], g_val[g, max(b, 0)], 0.0, 0.0)

    def g_climb(i, g):  # group i's path up the tree of size g
        v = (g_width + i) // 2
        while v >= 1:
            g_tree[g, v] = g_better(g_tree[g, 2 * v], g_tree[g, 2 * v + 1], g)
            v //= 2

    def least_groups(count, g):  # the count least-loaded groups of g (``least_of`` over every
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

    def least_by_tree(k):  # ``least_of(key, k)`` for k much smaller than n: the tree's
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

    def whole_groups(k):  # the k // ep least busy EP groups (by
        # their busiest member), ties to the lower group, in group order
        out = np.empty(k, dtype=np.int64)
        chosen = least_of(busiest, k // ep)
        for i in range(chosen.size):
            for q in range(ep):
                out[i * ep + q] = chosen[i] * ep + q
        return out

    def in_groups(k, g):  # a ring of k members in groups of g
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
                    ranks = least_of(key, k)
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
