"""The balance scheduler's kernel: every unit to ranks, heaviest first (``schedule``'s rules).

Placement of a ring (the ring starts when its last member is free, so each rule minimises
that start, then the idle time of the members that wait):

* under expert parallelism a ring of whole EP groups (a multiple of ``ep`` ranks, not in
  two-level groups) takes the least busy groups (a group is as loaded as its busiest member;
  ties to lower groups), so no group mixes two rings in one slot;
* a ring that fits in a node goes inside one node: the node whose ``size`` least-loaded
  ranks start earliest (then leave least idle, then the lowest node), those ranks;
* a two-level ring (groups of ``g`` members of one node) takes the least-loaded groups, each
  node's ranks cut into groups least-loaded first (ties to the lower node and group), unless
  enough whole groups sit at the least load (rings placed early): the lowest of those;
* any other ring takes the ``size`` least-loaded ranks, ties to the lowest ranks, which on
  an idle cluster are whole consecutive nodes.

Members are ordered by rank: consecutive members are neighbours, and a ring crosses node
boundaries only where it must.

The state the helpers share is passed as tuples of arrays: ``loads`` (clock, key, idle,
peak, tokens per rank), ``tree`` (a tournament tree over the ranks: leaf ``size + r`` is rank
``r``, an inner node its subtree's least (key, rank)), ``nodes`` (each node's keys in
ascending order for rings inside one node, and per ring size up to a node each node's pick
and a tournament tree over the nodes' picks, made again only for the nodes whose keys changed)
and ``groups`` (per two-level group size a tournament tree over every node's groups, kept the
same way).
"""

from __future__ import annotations

import numpy as np

from ..jit import jitable, kernel
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
    from the tournament tree over the ranks, and so do a ring's k least-loaded ranks where k x
    ``tree_pick`` <= n.

    Returns the (rank, unit) appends of every rank's run, in order; the units in the order
    given; each ring's members one ring after another (in that order); the clocks, keys and
    idle seconds per rank; and whether every unit was given (False: the largest key passed
    ``give_up_above`` first)."""
    n = num_ranks
    loads, tree, nodes, groups, busiest = _initial_state(n, rpn, ep)
    clock, key, idle, peak, _ = loads
    total_members = 0
    for j in range(order.size):
        total_members += ring_size[order[j]]
    log = (np.empty(total_members, dtype=np.int64), np.empty(total_members, dtype=np.int64), np.zeros(1, np.int64))
    given = np.empty(order.size, dtype=np.int64)
    members = np.empty(total_members, dtype=np.int64)
    n_given, n_members = 0, 0
    top = np.zeros(1)  # the largest key
    pick = np.empty(rpn, dtype=np.int64)
    lo = 0
    for b in range(bucket_ends.size):
        hi = bucket_ends[b]
        i = lo
        while i < hi:
            if top[0] > give_up_above:
                e = log[2][0]
                return log[0][:e], log[1][:e], given[:n_given], members[:n_members], clock, key, idle, False
            u = order[i]
            k = ring_size[u]
            if k > 1:  # a ring: placed, then every member runs it from its slowest member's clock
                ranks = _ring_ranks(k, group[u], key, tree, nodes, groups, busiest, pick, ep, tree_pick)
                start = clock[ranks[0]]
                for q in range(1, k):
                    start = max(start, clock[ranks[q]])
                for q in range(k):
                    _run(loads, top, log, seconds, tokens, by_tokens, bubble, ranks[q], start, u)
                    members[n_members + q] = ranks[q]
                for q in range(k):
                    _changed(ranks[q], key, tree, nodes, groups, busiest, ep)
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
                _run(loads, top, log, seconds, tokens, by_tokens, bubble, r, clock[r], u)
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
            _changed(r, key, tree, nodes, groups, busiest, ep)
        lo = hi
    e = log[2][0]
    return log[0][:e], log[1][:e], given[:n_given], members[:n_members], clock, key, idle, True


@jitable
def _initial_state(n: int, rpn: int, ep: int):
    """Every rank idle: the loads, the rank tree, the node and group state, each EP group's
    busiest key."""
    nodes = n // rpn
    loads = (np.zeros(n), np.zeros(n), np.zeros(n), np.zeros(n), np.zeros(n))  # clock, key, idle, peak, tokens
    key = loads[1]
    size = 1
    while size < n:
        size *= 2
    tree = np.empty(2 * size, dtype=np.int64)
    for r in range(size):
        tree[size + r] = r if r < n else -1
    for v in range(size - 1, 0, -1):
        a, b = tree[2 * v], tree[2 * v + 1]
        tree[v] = a if b < 0 or (a >= 0 and key[a] <= key[b]) else b
    width = 1
    while width < nodes:
        width *= 2
    node_state = (
        np.zeros((nodes, rpn)),  # each node's keys, ascending
        np.zeros(nodes, dtype=np.bool_),  # nodes whose keys changed since sorted
        np.empty((rpn + 1, max(nodes, 1))),  # per ring size and node: its pick's start
        np.empty((rpn + 1, max(nodes, 1))),  # ... and waits
        np.full((rpn + 1, 2 * width), -1, dtype=np.int64),  # per ring size: the tree over the nodes
        np.empty((rpn + 1, max(nodes, 1)), dtype=np.int64),  # ... the nodes changed since (a stack)
        np.zeros(rpn + 1, dtype=np.int64),  # ... its height
        np.zeros(rpn + 1, dtype=np.bool_),  # ... whether the tree is made
        np.zeros((rpn + 1, max(nodes, 1)), dtype=np.bool_),  # ... whether a node is on the stack
    )
    g_width = 1
    while g_width < nodes * max(rpn // 2, 1):
        g_width *= 2
    group_state = (
        np.empty((rpn + 1, g_width)),  # per group size and group: its busiest member's key
        np.full((rpn + 1, 2 * g_width), -1, dtype=np.int64),  # per group size: the tree over the groups
        np.empty((rpn + 1, max(nodes, 1)), dtype=np.int64),  # ... the nodes changed since (a stack)
        np.zeros(rpn + 1, dtype=np.int64),  # ... its height
        np.zeros(rpn + 1, dtype=np.bool_),  # ... whether the tree is made
        np.zeros((rpn + 1, max(nodes, 1)), dtype=np.bool_),  # ... whether a node is on the stack
    )
    return loads, tree, node_state, group_state, np.zeros(n // ep)


@jitable
def _run(loads, top, log, seconds, tokens, by_tokens: bool, bubble: int, r: int, start: float, u: int) -> None:
    """Rank ``r`` runs unit ``u`` from ``start`` (its own clock, or a ring's)."""
    clock, key, idle, peak, count = loads
    idle[r] += start - clock[r]
    clock[r] = start + seconds[u]
    count[r] += tokens[u]
    if seconds[u] > peak[r]:
        peak[r] = seconds[u]
    key[r] = count[r] if by_tokens else clock[r] + bubble * peak[r]
    if key[r] > top[0]:
        top[0] = key[r]
    ev_rank, ev_unit, events = log
    ev_rank[events[0]], ev_unit[events[0]] = r, u
    events[0] += 1


@jitable
def _changed(r: int, key, tree, nodes, groups, busiest, ep: int) -> None:
    """Rank ``r``'s key rose: its path up the rank tree, and its node's order, picks and
    groups go stale (made again when next asked for)."""
    by_node, stale, _, _, _, dirty, dirty_top, built, is_dirty = nodes
    _, _, g_dirty, g_dirty_top, g_built, g_is_dirty = groups
    rpn = by_node.shape[1]
    g = r // rpn
    stale[g] = True
    for k in range(2, rpn + 1):  # its picks for the ring sizes seen so far
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
    _climb(tree, key, r)


@jitable
def _climb(tree, key, r: int) -> None:
    """Rank ``r``'s path up the rank tree, made again."""
    v = (tree.size // 2 + r) // 2
    while v >= 1:
        a, b = tree[2 * v], tree[2 * v + 1]
        tree[v] = a if b < 0 or (a >= 0 and key[a] <= key[b]) else b
        v //= 2


@jitable
def _ring_ranks(k: int, g: int, key, tree, nodes, groups, busiest, pick, ep: int, tree_pick: int):
    """A ring of ``k`` members' ranks (two-level group size ``g``), by the placement rules."""
    rpn = nodes[0].shape[1]
    if ep > 1 and k % ep == 0 and g == 1:  # on whole EP groups
        return _whole_groups(k, busiest, ep)
    if k <= rpn:  # inside one node: earliest start, least idle, lowest node
        base = _best_node_of(k, key, nodes) * rpn
        for j in range(rpn):  # the node's ranks by (key, rank): a stable insertion sort
            x = key[base + j]
            q = j
            while q > 0 and key[pick[q - 1]] > x:
                pick[q] = pick[q - 1]
                q -= 1
            pick[q] = base + j
        return np.sort(pick[:k])  # its k least, in rank order
    if g > 1 and k % g == 0 and rpn % g == 0:
        return _in_groups(k, g, key, tree, nodes, groups)
    if k * tree_pick <= key.size:  # the k least-loaded ranks, ties to the lowest, in rank order
        return _least_by_tree(k, key, tree)
    return least_of(key, k)


@jitable
def _whole_groups(k: int, busiest, ep: int):
    """The k // ep least busy EP groups (by their busiest member), ties to the lower group,
    in group order."""
    out = np.empty(k, dtype=np.int64)
    chosen = least_of(busiest, k // ep)
    for i in range(chosen.size):
        for q in range(ep):
            out[i * ep + q] = chosen[i] * ep + q
    return out


@jitable
def _sort_node(g: int, key, by_node, stale) -> None:
    """Node g's keys ascending in ``by_node``, if they changed (an insertion sort)."""
    if not stale[g]:
        return
    stale[g] = False
    rpn = by_node.shape[1]
    for j in range(rpn):
        x = key[g * rpn + j]
        q = j
        while q > 0 and by_node[g, q - 1] > x:
            by_node[g, q] = by_node[g, q - 1]
            q -= 1
        by_node[g, q] = x


@jitable
def _node_pick(g: int, k: int, key, nodes) -> None:
    """Node g's k least-loaded ranks: when the last is free, and the waits."""
    by_node, stale, c_start, c_waits = nodes[0], nodes[1], nodes[2], nodes[3]
    _sort_node(g, key, by_node, stale)
    start = by_node[g, k - 1]
    prefix = by_node[g, 0]
    for q in range(1, k):
        prefix += by_node[g, q]
    c_start[k, g] = start
    c_waits[k, g] = k * start - prefix


@jitable
def _better_node(a: int, b: int, k: int, c_start, c_waits) -> int:
    """Of two nodes, the one with the least (start, waits, node)."""
    return better_leaf(a, b, c_start[k, max(a, 0)], c_start[k, max(b, 0)], c_waits[k, max(a, 0)], c_waits[k, max(b, 0)])


@jitable
def _best_node_of(k: int, key, nodes) -> int:
    """The node a ring of ``k`` goes to inside one node: earliest start, least idle, lowest
    node (the size's tree made on its first ring, its changed nodes' leaves made again)."""
    by_node, _, c_start, c_waits, s_tree, dirty, dirty_top, built, is_dirty = nodes
    width = s_tree.shape[1] // 2
    if not built[k]:
        built[k] = True
        for g in range(by_node.shape[0]):
            _node_pick(g, k, key, nodes)
            s_tree[k, width + g] = g
        for v in range(width - 1, 0, -1):
            s_tree[k, v] = _better_node(s_tree[k, 2 * v], s_tree[k, 2 * v + 1], k, c_start, c_waits)
    for d in range(dirty_top[k]):
        g = dirty[k, d]
        is_dirty[k, g] = False
        _node_pick(g, k, key, nodes)
        v = (width + g) // 2
        while v >= 1:
            s_tree[k, v] = _better_node(s_tree[k, 2 * v], s_tree[k, 2 * v + 1], k, c_start, c_waits)
            v //= 2
    dirty_top[k] = 0
    return s_tree[k, 1]


@jitable
def _group_climb(i: int, g: int, g_val, g_tree) -> None:
    """Group i's path up the tree of group size g: of two groups, the one with the least
    (busiest key, index)."""
    v = (g_tree.shape[1] // 2 + i) // 2
    while v >= 1:
        a, b = g_tree[g, 2 * v], g_tree[g, 2 * v + 1]
        g_tree[g, v] = better_leaf(a, b, g_val[g, max(a, 0)], g_val[g, max(b, 0)], 0.0, 0.0)
        v //= 2


@jitable
def _least_groups(count: int, g: int, key, nodes, groups):
    """The ``count`` least-loaded groups of ``g`` (``least_of`` over every node's groups by
    their busiest member: ties to the lower node and group), in index order, each taken out
    of the tree; the caller's ``_changed`` of their members puts them back (their nodes'
    leaves set again before the size's next ring)."""
    by_node, stale = nodes[0], nodes[1]
    g_val, g_tree, g_dirty, g_dirty_top, g_built, g_is_dirty = groups
    g_width = g_tree.shape[1] // 2
    per = by_node.shape[1] // g
    if not g_built[g]:
        g_built[g] = True
        for node in range(by_node.shape[0]):
            _sort_node(node, key, by_node, stale)
            for q in range(per):
                g_val[g, node * per + q] = by_node[node, q * g + g - 1]
                g_tree[g, g_width + node * per + q] = node * per + q
        for v in range(g_width - 1, 0, -1):
            a, b = g_tree[g, 2 * v], g_tree[g, 2 * v + 1]
            g_tree[g, v] = better_leaf(a, b, g_val[g, max(a, 0)], g_val[g, max(b, 0)], 0.0, 0.0)
    for d in range(g_dirty_top[g]):
        node = g_dirty[g, d]
        g_is_dirty[g, node] = False
        _sort_node(node, key, by_node, stale)
        for q in range(per):
            i = node * per + q
            g_val[g, i] = by_node[node, q * g + g - 1]
            g_tree[g, g_width + i] = i
            _group_climb(i, g, g_val, g_tree)
    g_dirty_top[g] = 0
    out = np.empty(count, dtype=np.int64)
    for m in range(count):
        i = g_tree[g, 1]
        out[m] = i
        g_tree[g, g_width + i] = -1
        _group_climb(i, g, g_val, g_tree)
    out.sort()
    return out


@jitable
def _least_by_tree(k: int, key, tree):
    """``least_of(key, k)`` for k much smaller than n: the tree's least (key, rank) k times,
    each taken out of the tree (its path made again); the caller's ``_changed`` puts every
    member back with its new key."""
    size = tree.size // 2
    out = np.empty(k, dtype=np.int64)
    for m in range(k):
        r = tree[1]
        out[m] = r
        tree[size + r] = -1
        _climb(tree, key, r)
    out.sort()
    for m in range(k):
        tree[size + out[m]] = out[m]
    return out


@jitable
def _in_groups(k: int, g: int, key, tree, nodes, groups):
    """A ring of k members in groups of g: whole groups of ranks at the least load where
    there are enough, else the least-loaded groups (``_least_groups``), each group's ranks in
    rank order."""
    by_node = nodes[0]
    n_nodes, rpn = by_node.shape[0], by_node.shape[1]
    out = np.empty(k, dtype=np.int64)
    least = key[tree[1]]  # key.min()
    at_least = 0  # ranks at the least load, counted until there are k
    for r in range(key.size):
        if key[r] == least:
            at_least += 1
            if at_least == k:
                break
    if at_least >= k:  # enough ranks at the least load: whole groups of them
        whole = np.empty(n_nodes, dtype=np.int64)  # per node: its ranks at the least load, in whole groups
        for node in range(n_nodes):
            whole[node] = np.count_nonzero(key[node * rpn : (node + 1) * rpn] == least) // g * g
        if whole.sum() >= k:
            m = 0
            for node in range(n_nodes):
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
    chosen = _least_groups(k // g, g, key, nodes, groups)  # ties: the lower node and group
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
