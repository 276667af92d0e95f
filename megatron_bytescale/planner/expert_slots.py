"""Expert parallelism under HDP: aligned micro-batch slots per expert-parallel group.

megatron-core's MoE layer with the all-to-all token dispatcher (``--expert-model-parallel-size
E > 1``) exchanges tokens among the E members of an expert-parallel (EP) group in every MoE
layer, forward and backward: the members must run the same number of micro-batches, the k-th
of one with the k-th of the others. HDP gives each rank its own list and rings between ranks
of any EP groups. So under EP a plan's lists are *slot lists*: every member of an EP group
holds the same number of micro-batches, those with nothing to run hold an empty one (no
pieces) that the runtime runs as one padding token (never attended by a real token, out of
the loss and the token count: ``runtime.padding``), so that it still joins every all-to-all.

EP groups are blocks of E consecutive HDP ranks, as Megatron lays out its expert groups
(order "tp-cp-ep-dp-pp", CP 1 under HDP): HDP rank r is in group ``r // E``.

Deadlock freedom (what ``slot_errors`` checks and ``align_expert_slots`` builds). Call each
rank's k-th micro-batch the event (r, k). Events that must run together are merged: (r, k) of
every member r of one EP group (an all-to-all joins them), and the events of one ring
micro-batch on its members (ring attention joins them). Each rank runs its events in order, so
the merged events form a graph with an edge from the node of (r, k) to that of (r, k + 1). If
that graph is acyclic, no step can deadlock: every participant of a node runs the same model,
so inside a node the ring hops (attention) and the all-to-alls (MoE) of layer 1 forward, layer
2 forward, ..., layer 1 backward come in the same order on all of them (a recomputed forward
too), and each waits only on participants of the same node at the same layer and operation.
Take the first unfinished node in a topological order: its participants have finished every
earlier node, so they all reach it, and its lowest pending (layer, operation) has all its
parties present and completes; by induction every node completes. A cycle, on the other hand,
is a set of nodes each waiting for another to finish: a deadlock.

``align_expert_slots`` first orders each run of a rank's local micro-batches (between two
rings) longest first, so that a group's slot k pairs its members' k-th largest, then places
the micro-batches on *global slots* t = 0, 1, 2, ...: at
slot t a rank runs its next local micro-batch, or its next ring micro-batch if that ring is
next on all its members, or (a ring not yet ready) the first local micro-batch it has left,
or nothing. Every ring then sits at the same global slot on all its members, and a group's
members are padded to the same slots: slot labels increase along every rank, so they order
the merged graph and it is acyclic. Slots empty on every member of a group are dropped for
that group (only relative order matters). The ring order of the plan is kept, so a plan that
validates without EP aligns.

Rings across EP groups couple them: a group whose members run slots of different rings (or
a ring and local work) holds every ring to its slowest member, and through those rings other
groups, so one long ring can stretch a slot over the whole cluster. So under EP the planner
rounds ring sizes up to whole EP groups (``round_rings_to_groups``) and places rings on whole
groups (``GroupPlacer``): the members of a group then run the same ring in the same slot.

The cost: an EP group's slot lasts as long as its slowest member's micro-batch plus the
all-to-alls (``slot_finish_times``); empty slots are time a rank waits. Ring alignment adds
waiting too: a ring member whose EP partners have work holds them at the ring's slot.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from graphlib import CycleError, TopologicalSorter

import numpy as np

from ..errors import ConfigError
from .cost_model import CostModel
from .estimate import crosses_nodes, micro_batch_time
from .placement import RingPlacer
from .plan import MicroBatch, Plan, micro_batch

EMPTY = micro_batch(())  # an empty slot: the rank runs one padding token through the model


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


def align_expert_slots(plan: Plan, expert_parallel: int) -> Plan:
    """The plan with every EP group's members on aligned slots (see the module docstring);
    the plan itself when ``expert_parallel`` is 1. Keeps every micro-batch and each rank's
    ring order; may run a rank's local micro-batches earlier to fill the wait for a ring."""
    if expert_parallel == 1:
        return plan
    groups = ep_groups(plan.num_ranks, expert_parallel)
    queues = [_longest_first(mbs) for mbs in plan.ranks]
    slotted: list[dict[int, MicroBatch]] = [{} for _ in plan.ranks]  # rank -> global slot -> mb
    t = 0
    while any(queues):
        heads: dict[tuple, set[int]] = {}  # ring key -> members holding it as their next micro-batch
        for rank, q in enumerate(queues):
            if q and q[0].ring is not None:
                heads.setdefault((q[0].ring, q[0].distributed_seq_ids), set()).add(rank)
        ready = {key for key, members in heads.items() if members == set(key[0])}
        if not ready and all(q[0].ring is not None for q in queues if q):
            raise ConfigError("the plan's ring micro-batches are ordered inconsistently across ranks: validate it first")
        for rank, q in enumerate(queues):
            if not q:
                continue
            head = q[0]
            if head.ring is not None and (head.ring, head.distributed_seq_ids) not in ready:
                local = next((i for i, mb in enumerate(q) if mb.ring is None), None)
                if local is None:
                    continue  # nothing to run at this slot
                slotted[rank][t] = q.pop(local)
            else:
                slotted[rank][t] = q.pop(0)
        t += 1
    ranks: list[tuple[MicroBatch, ...]] = [()] * plan.num_ranks
    for group in groups:
        used = sorted({s for r in group for s in slotted[r]})  # slots where some member runs
        for r in group:
            ranks[r] = tuple(slotted[r].get(s, EMPTY) for s in used)
    aligned = Plan(
        num_ranks=plan.num_ranks, capacity=plan.capacity, num_layers=plan.num_layers, seq_lens=plan.seq_lens,
        ranks=tuple(ranks), meta=dict(plan.meta), host_capacity=plan.host_capacity,
        recomputed_layers=plan.recomputed_layers, expert_parallel=expert_parallel,
    )
    aligned.meta["expert_slots"] = {
        "slots_per_group": [len(ranks[g[0]]) for g in groups],
        "empty_slots": sum(1 for mbs in ranks for mb in mbs if not mb.pieces),
    }
    return aligned


def round_rings_to_groups(shards: dict, expert_parallel: int, num_ranks: int) -> dict:
    """Ring sizes (``sharding.Shard``) rounded up to whole EP groups, where the sequence and
    the cluster allow; a larger ring holds fewer tokens per member, so memory still fits."""
    e = expert_parallel
    out = {}
    for sid, sh in shards.items():
        n = sh.ring_size
        rounded = -(-n // e) * e
        if n > 1 and rounded != n and rounded <= min(num_ranks, sh.seq_len):
            split = sh.heads_split if rounded % sh.heads_split == 0 else 1
            sh = dataclasses.replace(sh, ring_size=rounded, heads_split=split)
        out[sid] = sh
    return out


class GroupPlacer(RingPlacer):
    """Places a ring of whole EP groups on the least-loaded groups (a group is as loaded as
    its busiest member; ties to lower groups), so that no group mixes two rings in one slot;
    other rings as ``RingPlacer`` does."""

    def __init__(self, num_ranks: int, ranks_per_node: int, expert_parallel: int):
        super().__init__(num_ranks, ranks_per_node)
        ep_groups(num_ranks, expert_parallel)
        self.expert_parallel = expert_parallel

    def place_ranks(self, loads: np.ndarray, ring_size: int, group: int = 1, changed: list[int] | None = None) -> list[int]:
        e = self.expert_parallel
        if ring_size % e or group > 1:
            return super().place_ranks(loads, ring_size, group, changed)
        self._note_changes(loads, changed)  # the base class's kept node order stays current
        busiest = loads.reshape(-1, e).max(axis=1)
        chosen = np.sort(np.lexsort((np.arange(busiest.size), busiest))[: ring_size // e])
        return (chosen[:, None] * e + np.arange(e)[None, :]).ravel().tolist()


def _longest_first(mbs) -> list[MicroBatch]:
    """The micro-batches with each run of local ones (between two ring micro-batches) in
    descending token order: slot k of an EP group then pairs the members' k-th largest, and a
    slot waits less for its slowest member."""
    out: list[MicroBatch] = []
    run: list[MicroBatch] = []
    for mb in mbs:
        if mb.ring is None:
            run.append(mb)
            continue
        out.extend(sorted(run, key=lambda m: -m.tokens))
        run = []
        out.append(mb)
    out.extend(sorted(run, key=lambda m: -m.tokens))
    return out


def _slot_nodes(plan: Plan) -> tuple[dict, list[str]]:
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
            errors.append(f"EP group {list(group)} holds different numbers of micro-batch slots {counts}; each needs the same")
            continue
        for k in range(counts[group[0]]):
            for r in group[1:]:
                union((group[0], k), (r, k))
    seen: dict[tuple, tuple[int, int]] = {}
    for rank, mbs in enumerate(plan.ranks):
        for k, mb in enumerate(mbs):
            find((rank, k))
            if mb.ring is not None:
                key = (mb.ring, mb.distributed_seq_ids)
                if key in seen:
                    union(seen[key], (rank, k))
                else:
                    seen[key] = (rank, k)
    return {x: find(x) for x in list(parent)}, errors


def slot_nodes(plan: Plan) -> dict[tuple[int, int], tuple[int, int]]:
    """(rank, slot index) -> a representative of the events that run together with it."""
    node, errors = _slot_nodes(plan)
    if errors:
        raise ConfigError(errors[0])
    return node


def slot_errors(plan: Plan) -> list[str]:
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
                    return [f"rank {rank}: slots {k - 1} and {k} must run together (a ring joins them across EP groups): deadlock"]
                before[b].add(a)
    try:
        tuple(TopologicalSorter(before).static_order())
    except CycleError:
        return ["rings and EP groups order their micro-batch slots inconsistently: the all-to-alls would deadlock"]
    return []


def all_to_all_time(cost: CostModel, tokens: int, expert_parallel: int, inter_node: bool) -> float:
    """Seconds of one micro-batch's MoE all-to-alls on one rank, all layers of the stage:
    per layer dispatch and combine, forward and backward (four), each sending the share
    ``(E - 1) / E`` of the ``tokens x top-k`` routed hidden states to the other members."""
    if expert_parallel == 1 or not cost.moe_a2a_bytes_per_token:
        return 0.0
    bw = cost.bw_inter_node if inter_node else cost.bw_intra_node
    sent = tokens * cost.moe_a2a_bytes_per_token * (expert_parallel - 1) / expert_parallel
    return cost.num_layers * 4 * (cost.p2p_latency_s + sent / bw)


def slot_finish_times(plan: Plan, cost: CostModel, ranks_per_node: int) -> list[float]:
    """Estimated finish seconds per rank of an aligned plan: a node of merged events (an EP
    group's slot, joined by rings) starts when all its participants are free and lasts as long
    as its slowest participant's micro-batch plus its all-to-alls (empty slots: the wait)."""
    e = plan.expert_parallel
    node = slot_nodes(plan)
    inter = {g[0]: crosses_nodes(g, ranks_per_node) for g in ep_groups(plan.num_ranks, e)}
    members: dict[tuple, list[tuple[int, int]]] = defaultdict(list)
    for x, n in node.items():
        members[n].append(x)
    duration = {}
    for n, events in members.items():
        longest = 0.0
        for rank, k in events:
            mb = plan.ranks[rank][k]
            ring_inter = mb.ring is not None and crosses_nodes(mb.ring, ranks_per_node)
            a2a = all_to_all_time(cost, max(mb.tokens, 1), e, inter[rank - rank % e])
            longest = max(longest, micro_batch_time(cost, mb, ring_inter) + a2a)
        duration[n] = longest
    before: dict[tuple, set] = defaultdict(set)
    for rank, mbs in enumerate(plan.ranks):
        for k in range(len(mbs)):
            before[node[(rank, k)]]
            if k:
                before[node[(rank, k)]].add(node[(rank, k - 1)])
    end: dict[tuple, float] = {}
    for n in TopologicalSorter(before).static_order():
        end[n] = max((end[p] for p in before[n]), default=0.0) + duration[n]
    return [end[node[(rank, len(mbs) - 1)]] if mbs else 0.0 for rank, mbs in enumerate(plan.ranks)]
