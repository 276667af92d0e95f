"""Expert parallelism under HDP: aligned micro-batch slots per expert-parallel group.

megatron-core's MoE layer with the all-to-all token dispatcher (``--expert-model-parallel-size
E > 1``) exchanges tokens among the E members of an expert-parallel (EP) group in every MoE
layer, forward and backward: the members must run the same number of micro-batches, the k-th
of one with the k-th of the others. So under EP a plan's lists are *slot lists*: every member
of an EP group (HDP ranks ``r // E``, Megatron's expert groups) holds the same number of
micro-batches; those with nothing to run hold an empty one, run as one padding token
(``runtime.padding``) so that it still joins every all-to-all.

``align_expert_slots`` puts a plan's micro-batches on aligned slots (keeping each rank's ring
order), ``round_rings_to_groups`` and ``GroupPlacer`` size and place rings on whole EP groups,
``slot_finish_times`` estimates an aligned plan. The deadlock rule the slots keep is the
contract's (``contract.slots``); its proof, the alignment and the costs: docs/design.md,
"Expert parallelism".
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from graphlib import TopologicalSorter

import numpy as np

from ..errors import ConfigError
from .contract import MicroBatch, Plan, micro_batch
from .contract.slots import ep_groups, slot_nodes
from .cost_model import CostModel
from .estimate import crosses_nodes, micro_batch_time
from .placement import RingPlacer

EMPTY = micro_batch(())  # an empty slot: the rank runs one padding token through the model


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
            if q and q[0].ring_key is not None:
                heads.setdefault(q[0].ring_key, set()).add(rank)
        ready = {key for key, members in heads.items() if members == set(key[0])}
        if not ready and all(q[0].ring is not None for q in queues if q):
            raise ConfigError(
                "the plan's ring micro-batches are ordered inconsistently across ranks: validate it first"
            )
        for rank, q in enumerate(queues):
            if not q:
                continue
            head = q[0]
            if head.ring_key is not None and head.ring_key not in ready:
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
        num_ranks=plan.num_ranks,
        capacity=plan.capacity,
        num_layers=plan.num_layers,
        seq_lens=plan.seq_lens,
        ranks=tuple(ranks),
        meta=dict(plan.meta),
        host_capacity=plan.host_capacity,
        recomputed_layers=plan.recomputed_layers,
        expert_parallel=expert_parallel,
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

    def place_ranks(
        self, loads: np.ndarray, ring_size: int, group: int = 1, changed: list[int] | None = None
    ) -> list[int]:
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
