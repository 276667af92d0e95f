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
never moves a ring, so the rings' times stay those of step 1. The reordered plan is kept only
where its estimate (``slot_finish_times``'s figures, computed here from one timing of each
slot) is shorter.
"""

from __future__ import annotations

import dataclasses
from graphlib import CycleError

from .contract import Plan
from .contract.slots import ep_groups, slot_nodes
from .cost_model import CostModel
from .estimate import crosses_nodes
from .expert_slots import SlotTimer, longest_finish, slot_ends

Column = tuple  # one slot of an EP group: its members' micro-batches, side by side


def fill_ring_waits(plan: Plan, cost: CostModel, ranks_per_node: int) -> tuple[Plan, list[float]]:
    """``plan`` (aligned: ``align_expert_slots``) or the same with each EP group's local slots
    moved into the waits before its ring slots (module docstring), whichever has the shorter
    estimate, and that estimate per rank: ``slot_finish_times``'s figures, from one timing of
    each slot. ``plan`` itself without rings or where rings wait on each other in a cycle."""
    groups = ep_groups(plan.num_ranks, plan.expert_parallel)
    if any(len(plan.ranks[r]) != len(plan.ranks[g[0]]) for g in groups for r in g):
        slot_nodes(plan)  # raises the contract's error: a group's members hold different slot counts
    timer = SlotTimer(cost, plan.expert_parallel)
    ring_inter: dict[tuple, bool] = {}
    slots: list[list[tuple[Column, float, tuple]]] = []  # per group: (column, seconds, its ring keys)
    for group in groups:
        group_inter = crosses_nodes(group, ranks_per_node)
        mine = []
        for column in zip(*(plan.ranks[r] for r in group)):
            t = 0.0
            keys = ()
            for mb in column:
                key = mb.ring_key
                inter = False
                if key is not None:
                    if not keys or keys[-1] != key:  # a ring's members sit side by side
                        keys += (key,)
                    inter = ring_inter.get(key)
                    if inter is None:
                        inter = ring_inter[key] = crosses_nodes(key[0], ranks_per_node)
                seconds = timer.time(mb, inter, group_inter)
                if seconds > t:
                    t = seconds
            mine.append((column, t, keys))
        slots.append(mine)
    before = _finish(groups, slots)
    if not ring_inter:
        return plan, before
    rings = [[x for x in mine if x[2]] for mine in slots]
    start = _ring_starts(rings)
    if start is None:
        return plan, before
    filled = [
        _fill(r, s, [(x[1], k, x) for k, x in enumerate(mine) if not x[2]]) for r, s, mine in zip(rings, start, slots)
    ]
    after = _finish(groups, filled)
    if max(after) >= max(before):
        return plan, before
    ranks: list[tuple] = [()] * plan.num_ranks
    for group, mine in zip(groups, filled):
        for i, r in enumerate(group):
            ranks[r] = tuple(column[i] for column, _, _ in mine)
    return dataclasses.replace(plan, ranks=tuple(ranks), meta=dict(plan.meta)), after


def _finish(groups, slots) -> list[float]:
    """Per rank, the end of its group's last slot (``slot_finish_times``): group slots joined by
    the rings they hold, each lasting its longest member."""
    first, find = _joined(slots)
    counts = [len(mine) for mine in slots]
    return longest_finish(groups, counts, first, find, [seconds for mine in slots for _, seconds, _ in mine])


def _ring_starts(rings) -> list[list[float]] | None:
    """Per group, the start of each of its ring slots when groups run ring slots only: a slot
    node joins the group slots a ring links, follows each group's previous ring slot and lasts
    its longest member. None on a cycle."""
    first, find = _joined(rings)
    counts = [len(mine) for mine in rings]
    try:
        node, end, longest = slot_ends(counts, first, find, [seconds for mine in rings for _, seconds, _ in mine])
    except CycleError:
        return None
    return [[end[node[x]] - longest[node[x]] for x in range(first[g], first[g] + c)] for g, c in enumerate(counts)]


def _joined(slots):
    """Each group's first slot number (slots numbered group by group) and ``find``: the
    representative of a slot's node, slots joined by the rings they hold."""
    first, ids = [], 0
    for mine in slots:
        first.append(ids)
        ids += len(mine)
    parent = list(range(ids))

    def find(x):
        while parent[x] != x:
            parent[x] = x = parent[parent[x]]
        return x

    at: dict[tuple, int] = {}  # ring key -> a group slot holding it
    for g, mine in enumerate(slots):
        for k, (_, _, keys) in enumerate(mine):
            for key in keys:
                a, b = find(at.setdefault(key, first[g] + k)), find(first[g] + k)
                if a != b:
                    parent[b] = a
    return first, find


def _fill(rings, starts, local) -> list:
    """One group's slots: before each ring slot, the longest local slots that still end by its
    start (first fit, longest first; ties in their old order); the rest after the last ring.
    ``rings``: (column, seconds, ring keys) in order; ``local``: (seconds, position, slot)."""
    left = sorted(local, key=lambda x: (-x[0], x[1]))
    out = []
    clock = 0.0
    for ring, begin in zip(rings, starts):
        kept = []
        for item in left:
            if clock + item[0] <= begin:
                out.append(item[2])
                clock += item[0]
            else:
                kept.append(item)
        left = kept
        out.append(ring)
        clock = begin + ring[1]
    out.extend(item[2] for item in left)
    return out
