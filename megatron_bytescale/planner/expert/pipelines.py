"""Expert parallelism with pipelines: one slot numbering over all pipelines.

With pipelines an EP group's members are one stage of E pipelines (HDP ranks ``r // E``), and
each member runs its pipeline's micro-batches in the default order: 1F1B, or Megatron's
interleaved order with virtual stages. The MoE all-to-alls pair the k-th forward (backward)
of one member's stage with the k-th of the others'; they pair only if every member holds the
same number of micro-batches and runs the same order, so the members' stage orders are equal
op for op. A ring adds one more rule: its micro-batch must sit where 1F1B on every member
reaches it without waiting in a cycle.

``align_pipelined_slots`` numbers the slots over all HDP ranks together (``align_expert_slots``
with a single group of every rank): every ring then takes one slot on all its members and
every rank holds one micro-batch (or an empty one) per slot. Each rank's order is the order of
one long pipeline over all slots, so the pipelines cannot deadlock (docs/design.md, 2.6
"Pipeline order": rings at one index, and EP members merged at one index, map every edge of
the joint graph onto one pipeline's). With one model chunk per device each EP group then drops
the slots none of its members uses at its start and end: a group's ranks share the offset of
the slot/offset rule, so each order stays the long pipeline's restricted to a consecutive
range. With virtual stages the numbering stays whole (the interleaved order's groups of ``p``
micro-batches are counted from each rank's first micro-batch). The plan keeps no stage orders:
EP members must run the same order, and the default one is safe here.
"""

from __future__ import annotations

import dataclasses

from ..contract import Plan, pipelined_finish_times
from ..contract.slots import ep_groups, slot_unit_keys
from ..cost_model import CostModel
from ..estimate import crosses_nodes
from .slots import align_expert_slots, slot_counts
from .timing import SlotTimer


def align_pipelined_slots(plan: Plan, expert_parallel: int) -> Plan:
    """``plan``'s micro-batches on one slot numbering over all pipelines (module docstring),
    for EP groups of ``expert_parallel`` ranks, with no stage orders."""
    chunks = plan.virtual_stages
    aligned = align_expert_slots(plan, plan.num_ranks)
    ranks = list(aligned.ranks)
    groups = ep_groups(plan.num_ranks, expert_parallel)
    if chunks == 1:
        for group in groups:
            used = [k for k, column in enumerate(zip(*(ranks[r] for r in group))) if any(mb.pieces for mb in column)]
            lo, hi = (used[0], used[-1] + 1) if used else (0, 0)
            for r in group:
                ranks[r] = ranks[r][lo:hi]
    out = dataclasses.replace(
        aligned,
        ranks=tuple(ranks),
        expert_parallel=expert_parallel,
        virtual_stages=chunks,
        stage_orders=None,
        meta=dict(plan.meta),
    )
    out.meta["expert_slots"] = slot_counts(ranks, groups)
    return out


def pipelined_slot_finish_times(plan: Plan, stages: int, cost: CostModel, ranks_per_node: int) -> list[float]:
    """Estimated finish per rank of an aligned plan (``align_pipelined_slots``): every
    pipeline running its default order, a merged slot lasting as long as its slowest member's
    micro-batch with its MoE all-to-alls."""
    e = plan.expert_parallel
    timer = SlotTimer(cost, e)
    inter = [crosses_nodes(g, ranks_per_node) for g in ep_groups(plan.num_ranks, e)]
    times = [
        [timer.time(mb, mb.ring is not None and crosses_nodes(mb.ring, ranks_per_node), inter[r // e]) for mb in mbs]
        for r, mbs in enumerate(plan.ranks)
    ]
    finish = pipelined_finish_times(slot_unit_keys(plan), times, stages, cost.forward_share, chunks=plan.virtual_stages)
    if finish is None:  # the rule of the module docstring makes this unreachable
        raise AssertionError("EP slots over all pipelines deadlock under the default order")
    return finish
