"""The planner's kernels written plainly: the rules as they read, one step at a time, for the
tests to check the kernels (run compiled and as Python) against. None of this runs in the
planner."""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import defaultdict

import numpy as np

from megatron_bytescale.planner.balance import make_buckets
from megatron_bytescale.planner.contract import BACKWARD, FORWARD, Op
from megatron_bytescale.planner.estimate import ring_share_time
from megatron_bytescale.planner.order.runs import LocalBatch
from megatron_bytescale.planner.sizing import two_level
from megatron_bytescale.planner.sizing.packing import pack_best_fit


# ------------------------------------------------------------------ the balance scheduler
def plain_placement(loads, size: int, group: int, per_node: int, ep: int = 1) -> list[int]:
    """Where a ring of ``size`` goes (the placement rules of ``balance.kernel``), by rank."""
    loads = [float(x) for x in loads]
    n = len(loads)
    by_load = lambda ranks: sorted(ranks, key=lambda r: (loads[r], r))[:size]  # noqa: E731
    if ep > 1 and size % ep == 0 and group == 1:  # whole EP groups, least busy first
        busiest = [(max(loads[g * ep : (g + 1) * ep]), g) for g in range(n // ep)]
        chosen = sorted(g for _, g in sorted(busiest)[: size // ep])
        return [g * ep + q for g in chosen for q in range(ep)]
    if size <= per_node:  # inside one node: the earliest start, then the least idle, then the lowest node
        best = None
        for node in range(n // per_node):
            members = by_load(range(node * per_node, (node + 1) * per_node))
            start = loads[members[-1]]
            idle = size * start - sum(sorted(loads[r] for r in members))
            if best is None or (start, idle) < best[0]:
                best = ((start, idle), sorted(members))
        return best[1]
    if group > 1 and size % group == 0 and per_node % group == 0:
        return plain_group_placement(loads, size, group, per_node)
    return sorted(by_load(range(n)))


def plain_group_placement(loads, size: int, group: int, per_node: int) -> list[int]:
    """Two-level placement: each node's ranks least-loaded first (ties to the lower rank) cut
    into groups of ``group``; the size / group groups whose busiest member is least loaded
    (ties to the lower node, then group), by node; each group's ranks by rank."""
    loads = [float(x) for x in loads]
    groups = []
    for node in range(len(loads) // per_node):
        ranks = sorted(range(node * per_node, (node + 1) * per_node), key=lambda r: (loads[r], r))
        for g in range(per_node // group):
            members = ranks[g * group : (g + 1) * group]
            groups.append((loads[members[-1]], node, g, sorted(members)))
    chosen = sorted(sorted(groups, key=lambda x: x[:3])[: size // group], key=lambda x: x[1:3])
    return [r for *_, members in chosen for r in members]


def plain_buckets(order, weights, num_buckets):
    """``make_buckets`` as it reads: a new bucket once the weight given reaches the next share."""
    total = float(sum(weights[u] for u in order))
    buckets = [[]]
    acc = 0.0
    for u in order:
        if acc >= total * len(buckets) / num_buckets and buckets[-1] and len(buckets) < num_buckets:
            buckets.append([])
        buckets[-1].append(u)
        acc += weights[u]
    return buckets


def plain_schedule(units, num_ranks: int, per_node: int, mode: str, slack: float, stages: int, ep: int = 1):
    """``balance.schedule`` as it reads: units heaviest first in buckets; a ring to the ranks
    ``plain_placement`` picks, started when its last member is free; a single-rank unit to the
    least-loaded rank (key, then rank), which under PP balance goes on taking the bucket's next
    single-rank units while its key after each stays within the level. Returns (runs, members,
    clock, key, idle, order given)."""
    by_tokens = mode == "tokens"
    weights = [float(u.tokens) if by_tokens else u.time for u in units]
    order = sorted(range(len(units)), key=lambda u: (-weights[u], units[u].seq_ids[0]))
    n, bubble = num_ranks, stages - 1
    clock, count, peak, idle = [0.0] * n, [0.0] * n, [0.0] * n, [0.0] * n
    runs, members, given = [[] for _ in range(n)], {}, []

    def key(r):
        return count[r] if by_tokens else clock[r] + bubble * peak[r]

    def run(r, start, u):
        idle[r] += start - clock[r]
        clock[r] = start + units[u].time
        count[r] += units[u].tokens
        peak[r] = max(peak[r], units[u].time)
        runs[r].append(u)

    water = (1 + slack) * sum(weights) / n
    for bucket in make_buckets(order, weights, 8):
        i = 0
        while i < len(bucket):
            u = bucket[i]
            i += 1
            given.append(u)
            if units[u].ring_size > 1:
                ring = plain_placement(
                    [key(r) for r in range(n)], units[u].ring_size, units[u].heads_split, per_node, ep
                )
                start = max(clock[r] for r in ring)
                for r in ring:
                    run(r, start, u)
                members[u] = tuple(ring)
                continue
            r = min(range(n), key=lambda x: (key(x), x))
            run(r, clock[r], u)
            if mode != "pp":
                continue
            level = max(water, max(key(x) for x in range(n)))
            while i < len(bucket) and units[bucket[i]].ring_size == 1:
                w = weights[bucket[i]]
                if clock[r] + w + bubble * max(peak[r], w) > level:
                    break
                given.append(bucket[i])
                run(r, clock[r], bucket[i])
                i += 1
    return runs, members, clock, [key(r) for r in range(n)], idle, given


# ------------------------------------------------------------------ packing
class BestFit:
    """Best-fit bin packing, one item at a time: each item goes to the open bin it fills most
    tightly (ties: the earlier bin)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.bins: list[list[int]] = []
        self._free: list[tuple[int, int]] = []  # (free tokens, bin index), ascending

    def open_bin(self, free: int, items=()) -> int:
        b = len(self.bins)
        self.bins.append(list(items))
        if free > 0:
            insort(self._free, (free, b))
        return b

    def add(self, item: int, size: int) -> int:
        i = bisect_left(self._free, (size, -1))
        if i == len(self._free):
            return self.open_bin(self.capacity - size, (item,))
        free, b = self._free.pop(i)
        self.bins[b].append(item)
        if free - size > 0:
            insort(self._free, (free - size, b))
        return b

    def try_add(self, item: int, size: int) -> int | None:
        i = bisect_left(self._free, (size, -1))
        return None if i == len(self._free) else self.add(item, size)


def plain_rank_items(lens, units, assignment, capacity: int, cost):
    """Each rank's items: ring units as they are, a long unit or pack as its micro-batch, and
    each stretch of short sequences between them one micro-batch in run order where they fit
    together (or are one), else packed best-fit decreasing; a pack timed as
    ``num_layers x layer_time(tokens, pairs)``."""
    out = []
    for run in assignment.runs:
        items, stretch = [], []

        def flush():
            bins = [stretch[:]]
            if len(stretch) > 1 and sum(lens[i] for i in stretch) > capacity:
                bins = pack_best_fit([(i, lens[i]) for i in stretch], capacity)
            for b in bins:
                tokens, pairs = sum(lens[i] for i in b), sum(lens[i] * lens[i] for i in b)
                items.append(LocalBatch(tuple(b), 0.0, cost.num_layers * cost.layer_time(tokens, pairs)))
            stretch.clear()

        for u in run:
            unit = units[u]
            if unit.kind == "short":
                stretch.append(unit.seq_ids[0])
                continue
            if stretch:
                flush()
            items.append(u if unit.kind == "ring" else LocalBatch(unit.seq_ids, unit.ratio, unit.time))
        if stretch:
            flush()
        out.append(items)
    return out


# ------------------------------------------------------------------ ring curves
def plain_curve(cost, seq_len: int, sizes, per_node: int, group_sizes) -> tuple[list[float], list[int]]:
    """Per ring size: the plain ring's share time (``ring_share_time``), or a two-level group
    size's (``two_level.share_time``) where the ring spans nodes, the size is a multiple of it
    and it is strictly faster (ties: the plain ring, then the smaller group size)."""
    times, splits = [], []
    for d in (int(x) for x in sizes):
        best, split = ring_share_time(cost, seq_len, d, d > per_node), 1
        for u in group_sizes:
            if d > per_node and d % u == 0:
                t = two_level.share_time(cost, seq_len, d, u, per_node)
                if t < best:
                    best, split = t, u
        times.append(best)
        splits.append(split)
    return times, splits


# ------------------------------------------------------------------ orders
def plain_slot_offsets(ring_keys) -> list[int] | None:
    """Each later member of a ring tied to its first (in rank order) by their index difference,
    the ties walked from the lowest rank, each group's least offset 0; None where two ties
    disagree."""
    where: dict[object, list[tuple[int, int]]] = defaultdict(list)
    for r, keys in enumerate(ring_keys):
        for i, k in enumerate(keys):
            if k is not None:
                where[k].append((r, i))
    adj: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for ms in where.values():
        r0, i0 = ms[0]
        for r, i in ms[1:]:
            adj[r0].append((r, i0 - i))
            adj[r].append((r0, i - i0))
    off: list[int | None] = [None] * len(ring_keys)
    for s in range(len(ring_keys)):
        if off[s] is not None:
            continue
        off[s] = 0
        todo, comp = [s], [s]
        while todo:
            a = todo.pop()
            for b, d in adj[a]:
                if off[b] is None:
                    off[b] = off[a] + d
                    todo.append(b)
                    comp.append(b)
                elif off[b] != off[a] + d:
                    return None
        low = min(off[c] for c in comp)
        for c in comp:
            off[c] -= low
    return off


def plain_one_pipeline(fwd, bwd, stages: int, chunks: int) -> list[list[Op]]:
    """One pipeline run op by op: Megatron's forward sequence (groups of ``stages`` micro-batches,
    chunk by chunk) and backward sequence (chunks reversed); each step the device whose next
    op starts first runs it (a backward before a forward, then the lower device), a forward only
    under Megatron's warm-up cap ``2 (p - 1 - device) + (V - 1) p + 1``."""
    count, p, v = len(fwd), stages, chunks
    forwards, backwards = [], []
    for g in range(0, count, p):
        group = range(g, min(g + p, count))
        forwards.extend((m, c) for c in range(v) for m in group)
        backwards.extend((m, c) for c in reversed(range(v)) for m in group)
    last = p * v - 1
    done: dict[tuple[int, int, int], float] = {}
    nf, nb, free = [0] * p, [0] * p, [0.0] * p
    orders: list[list[Op]] = [[] for _ in range(p)]
    cap = [2 * (p - 1 - d) + (v - 1) * p + 1 for d in range(p)]
    for _ in range(2 * len(forwards) * p):
        best = None
        for d in range(p):
            cands = []
            if nb[d] < len(backwards):
                m, c = backwards[nb[d]]
                vs = c * p + d
                need = (FORWARD, m, vs) if vs == last else (BACKWARD, m, vs + 1)
                if need in done:
                    cands.append((max(free[d], done[need]), 0, BACKWARD, m, c, vs))
            if nf[d] < len(forwards) and nf[d] - nb[d] < cap[d]:
                m, c = forwards[nf[d]]
                vs = c * p + d
                if vs == 0 or (FORWARD, m, vs - 1) in done:
                    cands.append((max(free[d], done.get((FORWARD, m, vs - 1), 0.0)), 1, FORWARD, m, c, vs))
            for cand in cands:
                if best is None or cand[:2] < best[0][:2]:
                    best = (cand, d)
        if best is None:
            break
        (start, _, direction, m, c, vs), d = best
        done[direction, m, vs] = free[d] = start + (fwd[m] if direction == FORWARD else bwd[m]) / v
        orders[d].append(Op(direction, m, c))
        if direction == FORWARD:
            nf[d] += 1
        else:
            nb[d] += 1
    return orders


def plain_level_pick(load, level, size: int, rpn: int):
    """A ring's ranks at one level, one node and one level at a time: larger than a node, whole
    nodes of the level first, then the fullest part-nodes, ties to the least busy, then the
    lower node; else inside one node its least-loaded ranks of the level (ties to lower
    ranks). Of all picks the earliest start, then the least idle (loads summed in rank
    order), then the lower level and node; None if no level holds the ring."""
    n = load.size
    nodes = [np.arange(k, min(k + rpn, n)) for k in range(0, n, rpn)]
    best = None
    for lv in np.unique(level).tolist():
        if size > rpn:
            parts = [node[level[node] == lv] for node in nodes]
            parts = sorted((p for p in parts if p.size), key=lambda p: (-p.size, float(load[p].max()), int(p[0])))
            picks = [np.concatenate(parts)[:size]] if sum(p.size for p in parts) >= size else []
        else:
            picks = []
            for node in nodes:
                cand = node[level[node] == lv]
                if cand.size >= size:
                    picks.append(cand[np.lexsort((cand, load[cand]))[:size]])
        for chosen in picks:
            chosen = np.sort(chosen)
            key = (float(load[chosen].max()), float(load[chosen].max() * size - sum(load[chosen].tolist())), lv)
            if best is None or key < best[0]:
                best = (key, chosen)
    return None if best is None else best[1]


def plain_level_placement(load, sizes, times, rpn: int):
    """Rings placed one after another at levels (``plain_level_pick``): each ring's members,
    one ring after another, and how many were placed."""
    load, level, out = load.copy(), np.zeros(load.size, dtype=np.int64), []
    for u, size in enumerate(sizes.tolist()):
        chosen = plain_level_pick(load, level, size, rpn)
        if chosen is None:
            return out, u
        out += chosen.tolist()
        load[chosen] = load[chosen].max() + times[u]
        level[chosen] += 1
    return out, sizes.size
