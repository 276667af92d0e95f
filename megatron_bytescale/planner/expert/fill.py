"""Expert parallelism: local slots moved into the waits before rings.

Under EP an EP group runs its slots in lockstep (``expert.slots``), and a ring slot starts
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

from ..contract import Plan
from ..cost_model import CostModel
from .timing import group_finish_times, slot_ends, timed_slots


def fill_ring_waits(plan: Plan, cost: CostModel, ranks_per_node: int) -> tuple[Plan, list[float]]:
    """``plan`` (aligned: ``align_expert_slots``) or the same with each EP group's local slots
    moved into the waits before its ring slots (module docstring), whichever has the shorter
    estimate, and that estimate per rank: ``slot_finish_times``'s figures, from one timing of
    each slot. ``plan`` itself without rings or where rings wait on each other in a cycle."""
    groups, slots = timed_slots(plan, cost, ranks_per_node)
    before = group_finish_times(groups, slots)
    rings = [[x for x in mine if x[2]] for mine in slots]
    if not any(rings):
        return plan, before
    start = _ring_starts(rings)
    if start is None:
        return plan, before
    filled = [
        _fill(r, s, [(x[1], k, x) for k, x in enumerate(mine) if not x[2]]) for r, s, mine in zip(rings, start, slots)
    ]
    after = group_finish_times(groups, filled)
    if max(after) >= max(before):
        return plan, before
    ranks: list[tuple] = [()] * plan.num_ranks
    for group, mine in zip(groups, filled):
        for i, r in enumerate(group):
            ranks[r] = tuple(column[i] for column, _, _ in mine)
    return dataclasses.replace(plan, ranks=tuple(ranks), meta=dict(plan.meta)), after


def _ring_starts(rings) -> list[list[float]] | None:
    """Per group, the start of each of its ring slots when groups run ring slots only (each
    node follows its groups' previous ring slots); None on a cycle."""
    try:
        first, node, end, longest = slot_ends(rings)
    except CycleError:
        return None
    return [[end[node[x]] - longest[node[x]] for x in range(f, f + len(mine))] for f, mine in zip(first, rings)]


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
