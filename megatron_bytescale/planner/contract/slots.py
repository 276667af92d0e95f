"""Expert-parallel slots (``Plan.expert_parallel`` > 1): which micro-batches run together,
and the rule that keeps them free of deadlock.

Under EP the members of an EP group (blocks of E consecutive HDP ranks, Megatron's expert
groups) run their k-th micro-batches together (the MoE all-to-alls join them), and a ring
micro-batch joins its members' slots. Merge the events that run together; each rank runs its
events in order. If the merged graph is acyclic no step can deadlock; a cycle is a deadlock
(the argument: docs/design.md, "Expert parallelism").
"""

from __future__ import annotations

from collections import defaultdict
from graphlib import CycleError, TopologicalSorter

from ...errors import ConfigError


def ep_groups(num_ranks: int, expert_parallel: int) -> list[tuple[int, ...]]:
    """HDP ranks of each EP group: blocks of ``expert_parallel`` consecutive ranks."""
    check_expert_parallel(num_ranks, expert_parallel)
    e = expert_parallel
    return [tuple(range(g * e, (g + 1) * e)) for g in range(num_ranks // e)]


def check_expert_parallel(num_ranks: int, expert_parallel: int) -> None:
    """An error unless EP groups of ``expert_parallel`` ranks tile the HDP ranks."""
    if expert_parallel < 1 or num_ranks % expert_parallel:
        raise ConfigError(
            f"expert-parallel size {expert_parallel} does not divide the {num_ranks} HDP ranks; choose "
            "--expert-model-parallel-size dividing world size / (TP x PP)"
        )


def _slot_nodes(plan) -> tuple[dict, list[str]]:
    """Union of the events that run together: (rank, index) -> representative, and problems."""
    parent: dict[tuple[int, int], tuple[int, int]] = {}

    def find(x):
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def union(a, b):
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[rb] = ra

    errors = []
    for group in ep_groups(plan.num_ranks, plan.expert_parallel):
        counts = {r: len(plan.ranks[r]) for r in group}
        if len(set(counts.values())) > 1:
            errors.append(
                f"EP group {list(group)} holds different numbers of micro-batch slots {counts}; each needs the same"
            )
            continue
        for k in range(counts[group[0]]):
            for r in group[1:]:
                union((group[0], k), (r, k))
    seen: dict[tuple, tuple[int, int]] = {}
    for rank, mbs in enumerate(plan.ranks):
        for k, mb in enumerate(mbs):
            find((rank, k))
            key = mb.ring_key
            if key is not None:
                if key in seen:
                    union(seen[key], (rank, k))
                else:
                    seen[key] = (rank, k)
    return {x: find(x) for x in list(parent)}, errors


def slot_nodes(plan) -> dict[tuple[int, int], tuple[int, int]]:
    """(rank, slot index) -> a representative of the events that run together with it."""
    node, errors = _slot_nodes(plan)
    if errors:
        raise ConfigError(errors[0])
    return node


def slot_unit_keys(plan) -> list[list[tuple]]:
    """Per rank and slot: the key of the events that run together with it (an EP group's
    slot, joined by rings), the same on every participant: the units of the pipeline graph
    (``graph.PipelineGraph``) when EP groups run lock-step across pipelines."""
    node = slot_nodes(plan)
    return [[("slot", *node[(rank, k)]) for k in range(len(mbs))] for rank, mbs in enumerate(plan.ranks)]


def slot_errors(plan) -> list[str]:
    """Why this plan could deadlock under expert parallelism (empty: it cannot; see the module
    docstring): EP group members with different slot counts, or a cycle among merged events."""
    if plan.expert_parallel == 1:
        return []
    try:
        node, errors = _slot_nodes(plan)
    except ConfigError as exc:
        return [str(exc)]
    if errors:
        return errors
    before: dict[tuple, set] = defaultdict(set)
    for rank, mbs in enumerate(plan.ranks):
        for k in range(len(mbs)):
            before[node[(rank, k)]]
            if k:
                a, b = node[(rank, k - 1)], node[(rank, k)]
                if a == b:
                    return [
                        f"rank {rank}: slots {k - 1} and {k} must run together (a ring joins them across EP groups): "
                        "deadlock"
                    ]
                before[b].add(a)
    try:
        tuple(TopologicalSorter(before).static_order())
    except CycleError:
        return ["rings and EP groups order their micro-batch slots inconsistently: the all-to-alls would deadlock"]
    return []
