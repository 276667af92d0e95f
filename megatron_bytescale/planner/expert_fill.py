"""Expert parallelism: local slots moved into the waits before rings.

Under EP an EP group runs its slots in lockstep (``expert_slots``), and a ring slot starts
only when every group it spans is free. ``align_expert_slots`` keeps the order the balance
scheduler gave each rank, which was made for ranks running on their own: once a group's
members wait for each other in every slot, the local work before a ring no longer ends when
the ring's other groups do, and groups idle before rings (on GitHub-like batches, many
rings of 4-8 ranks, about a tenth of the step).

``fill_ring_waits`` reorders each group's slots, keeping every slot whole (the same
micro-batches side by side, so each rank holds what it held) and every group's ring slots in
their order:

1. the ring slots alone, each at the earliest time all its groups are free (a longest path
   over the ring slots);
2. each group's local slots, longest first, into the gaps before its ring slots where they
   fit without delaying the ring; what fits nowhere runs after the group's last ring.

Step 1 starts every ring no later than any order of the same ring slots would, and step 2
never moves a ring, so the rings' times stay those of step 1; the planner keeps the result
only where the estimate (``slot_finish_times``) is shorter.
"""

from __future__ import annotations

import dataclasses

from .contract import Plan, longest_paths
from .contract.slots import ep_groups
from .cost_model import CostModel
from .estimate import crosses_nodes
from .expert_slots import SlotTimer


def fill_ring_waits(plan: Plan, cost: CostModel, ranks_per_node: int) -> Plan:
    """``plan`` (aligned: ``align_expert_slots``) with each EP group's local slots moved into
    the waits before its ring slots (module docstring); ``plan`` itself without EP, without
    rings or where rings wait on each other in a cycle (the contract's check reports it)."""
    e = plan.expert_parallel
    if e == 1:
        return plan
    groups = ep_groups(plan.num_ranks, e)
    timer = SlotTimer(cost, e)
    ring_inter: dict[tuple, bool] = {}
    rings_of: list[list[tuple]] = []  # per group: its ring slots (columns of micro-batches), in order
    ring_len: list[list[float]] = []
    local_of: list[list[tuple[float, int, tuple]]] = []  # per group: (seconds, position, column)
    for group in groups:
        group_inter = crosses_nodes(group, ranks_per_node)
        rings, lens, local = [], [], []
        for k, column in enumerate(zip(*(plan.ranks[r] for r in group))):
            t = 0.0
            held = False
            for mb in column:
                key = mb.ring_key
                inter = False
                if key is not None:
                    held = True
                    inter = ring_inter.get(key)
                    if inter is None:
                        inter = ring_inter[key] = crosses_nodes(key[0], ranks_per_node)
                t = max(t, timer.time(mb, inter, group_inter))
            if held:
                rings.append(column)
                lens.append(t)
            else:
                local.append((t, k, column))
        rings_of.append(rings)
        ring_len.append(lens)
        local_of.append(local)
    if not ring_inter:
        return plan
    start = _ring_starts(groups, rings_of, ring_len)
    if start is None:
        return plan
    ranks: list[tuple] = [()] * plan.num_ranks
    for g, group in enumerate(groups):
        columns = _fill(rings_of[g], ring_len[g], start[g], local_of[g])
        for i, r in enumerate(group):
            ranks[r] = tuple(column[i] for column in columns)
    return dataclasses.replace(plan, ranks=tuple(ranks), meta=dict(plan.meta))


def _ring_starts(groups, rings_of, ring_len) -> list[list[float]] | None:
    """Per group, the start of each of its ring slots when groups run ring slots only: a slot
    node joins the group slots a ring links, follows each group's previous ring slot and lasts
    its longest member. None on a cycle."""
    first, ids = [], 0
    for rings in rings_of:
        first.append(ids)
        ids += len(rings)
    parent = list(range(ids))

    def find(x):
        while parent[x] != x:
            parent[x] = x = parent[parent[x]]
        return x

    at: dict[tuple, int] = {}  # ring key -> a group slot holding it
    for g, rings in enumerate(rings_of):
        for k, column in enumerate(rings):
            for mb in column:
                key = mb.ring_key
                if key is not None:
                    x = at.setdefault(key, first[g] + k)
                    a, b = find(x), find(first[g] + k)
                    if a != b:
                        parent[b] = a
    node = [find(x) for x in range(ids)]
    index = {root: i for i, root in enumerate(dict.fromkeys(node))}
    longest = [0.0] * len(index)
    for g, lens in enumerate(ring_len):
        for k, t in enumerate(lens):
            i = index[node[first[g] + k]]
            longest[i] = max(longest[i], t)
    succ: list[list[int]] = [[] for _ in index]
    indeg = [0] * len(index)
    for g, rings in enumerate(rings_of):
        for k in range(1, len(rings)):
            a, b = index[node[first[g] + k - 1]], index[node[first[g] + k]]
            if a == b:
                return None
            succ[a].append(b)
            indeg[b] += 1
    end = longest_paths(succ, indeg, longest)
    if end is None:
        return None
    return [
        [end[index[node[first[g] + k]]] - longest[index[node[first[g] + k]]] for k in range(len(rings))]
        for g, rings in enumerate(rings_of)
    ]


def _fill(rings, lens, starts, local) -> list[tuple]:
    """One group's slots: before each ring slot, the longest local slots that still end by its
    start (first fit, longest first; ties in their old order); the rest after the last ring."""
    left = sorted(local, key=lambda x: (-x[0], x[1]))
    out: list[tuple] = []
    clock = 0.0
    for column, length, begin in zip(rings, lens, starts):
        kept = []
        for item in left:
            if clock + item[0] <= begin:
                out.append(item[2])
                clock += item[0]
            else:
                kept.append(item)
        left = kept
        out.append(column)
        clock = begin + length
    out.extend(item[2] for item in left)
    return out
