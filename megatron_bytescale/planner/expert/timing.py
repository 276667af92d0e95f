"""Expert parallelism's costs: the MoE all-to-alls, and the estimate of a plan whose EP
groups run aligned slots (``slot_finish_times``)."""

from __future__ import annotations

from graphlib import CycleError

from ..contract import MicroBatch, Plan, longest_paths
from ..contract.slots import ep_groups, slot_nodes
from ..cost_model import CostModel
from ..estimate import crosses_nodes, micro_batch_time, piece_time, ring_exposed_time, whole_sequences_time


def all_to_all_time(cost: CostModel, tokens, expert_parallel: int, inter_node: bool, latencies=1.0):
    """Seconds of one micro-batch's MoE all-to-alls on one rank, all layers of the stage:
    per layer dispatch and combine, forward and backward (four), each sending the share
    ``(E - 1) / E`` of the ``tokens x top-k`` routed hidden states to the other members.
    ``latencies``: how many times each exchange's latency counts (a sequence's share of its
    micro-batch's: its tokens over the capacity); ``tokens`` and it may be arrays."""
    if expert_parallel == 1 or not cost.moe_a2a_bytes_per_token:
        return 0.0
    bw = cost.bw_inter_node if inter_node else cost.bw_intra_node
    sent = tokens * cost.moe_a2a_bytes_per_token * (expert_parallel - 1) / expert_parallel
    return cost.num_layers * 4 * (latencies * cost.p2p_latency_s + sent / bw)


def ep_all_to_all_time(cost: CostModel, tokens, expert_parallel: int, ranks_per_node: int, latencies=1.0):
    """``all_to_all_time`` in this cluster's EP groups: blocks of consecutive HDP ranks, so
    they all cross nodes or none does (0 without EP)."""
    inter = crosses_nodes(range(expert_parallel), ranks_per_node)
    return all_to_all_time(cost, tokens, expert_parallel, inter, latencies)


def slot_finish_times(plan: Plan, cost: CostModel, ranks_per_node: int) -> list[float]:
    """Estimated finish seconds per rank of an aligned plan: a node of merged events (an EP
    group's slot, joined by rings) starts when all its participants are free and lasts as long
    as its slowest participant's micro-batch plus its all-to-alls (empty slots: the wait).

    The nodes are those of ``contract.slots.slot_nodes``, built from EP groups' slots rather
    than ranks' (a group's members share every slot's node); the longest path is walked in
    Kahn's order (``contract.longest_paths``): the same sums and maxima, whatever the order."""
    return group_finish_times(*timed_slots(plan, cost, ranks_per_node))


def timed_slots(plan: Plan, cost: CostModel, ranks_per_node: int):
    """The plan's EP groups, and per group its slots in order: (column, seconds, ring keys),
    the column its members' micro-batches side by side, the seconds its slowest member's (with
    the all-to-alls), the keys the rings it holds (a ring's members sit side by side)."""
    groups = ep_groups(plan.num_ranks, plan.expert_parallel)
    if any(len(plan.ranks[r]) != len(plan.ranks[g[0]]) for g in groups for r in g):
        slot_nodes(plan)  # raises the contract's error: a group's members hold different slot counts
    timer = SlotTimer(cost, plan.expert_parallel)
    ring_inter: dict[tuple, bool] = {}
    slots: list[list[tuple[tuple, float, tuple]]] = []
    time = timer.time
    for group in groups:
        group_inter = crosses_nodes(group, ranks_per_node)
        mine = []
        for column in zip(*[plan.ranks[r] for r in group]):
            t = 0.0
            keys = ()
            last = inter = None  # the previous member's ring key (one tuple for all members) and crossing
            for mb in column:
                key = mb.ring_key
                if key is None:
                    inter = False
                elif key is not last:
                    if not keys or keys[-1] != key:
                        keys += (key,)
                    inter = ring_inter.get(key)
                    if inter is None:
                        inter = ring_inter[key] = crosses_nodes(key[0], ranks_per_node)
                last = key
                seconds = time(mb, inter, group_inter)
                if seconds > t:
                    t = seconds
            mine.append((column, t, keys))
        slots.append(mine)
    return groups, slots


def group_finish_times(groups, slots) -> list[float]:
    """Per rank: the end of its group's last slot's node (0 without slots); ``slots`` as
    ``timed_slots`` gives them, in any order that keeps the plan valid."""
    first, node, end, _ = slot_ends(slots)
    last = [end[node[first[g] + len(mine) - 1]] if mine else 0.0 for g, mine in enumerate(slots)]
    return [last[g] for g, group in enumerate(groups) for _ in group]


def slot_ends(slots) -> tuple[list[int], list[int], list[float], list[float]]:
    """The slot graph of per-group slots (``timed_slots``' triples): each group's first slot
    number (slots numbered group by group), each slot's node (the slots its rings join), and
    per node its end and its length. A node lasts its longest slot and follows each of its
    groups' previous slot; raises CycleError where they wait on each other."""
    first, ids = [], 0
    for mine in slots:
        first.append(ids)
        ids += len(mine)
    parent = list(range(ids))  # union-find over group slots, joined by rings

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
    root = [find(x) for x in range(ids)]
    index = {r: i for i, r in enumerate(dict.fromkeys(root))}
    node = [index[r] for r in root]
    longest = [0.0] * len(index)
    x = 0
    for mine in slots:
        for _, seconds, _ in mine:
            if seconds > longest[node[x]]:
                longest[node[x]] = seconds
            x += 1
    succ: list[list[int]] = [[] for _ in index]
    indeg = [0] * len(index)
    for g, mine in enumerate(slots):
        for x in range(first[g] + 1, first[g] + len(mine)):
            a, b = node[x - 1], node[x]
            if a == b:
                raise CycleError("a ring joins two slots of one EP group: they wait on each other")
            succ[a].append(b)
            indeg[b] += 1
    end = longest_paths(succ, indeg, longest)
    if end is None:
        raise CycleError("rings and EP groups order their slots inconsistently: they wait in a cycle")
    return first, node, end, longest


class SlotTimer:
    """Seconds of one rank's micro-batch in an EP slot: ``micro_batch_time`` plus the slot's
    all-to-alls, computed faster than one call each (a 16K-GPU step has ~10^5 of them):

    * a micro-batch of one piece (most: a ring member's share, or a long sequence) costs what
      the piece's length, ring size and tokens say, so each such value is computed once;
    * one of several whole sequences costs what its tokens and the sum of their squared
      lengths say; that sum is exact in integers (below 2^53), so it equals the float one."""

    def __init__(self, cost: CostModel, expert_parallel: int):
        self.cost = cost
        self.e = expert_parallel
        self.known: dict[tuple, float] = {}
        # a ring's exposed communication (the same on every member: the members of a ring
        # differ by at most one token, so most rings time two distinct pieces)
        self.exposed: dict[tuple, float] = {}

    def time(self, mb: MicroBatch, ring_inter: bool, group_inter: bool) -> float:
        pieces = mb.pieces
        if len(pieces) == 1:
            p = pieces[0]
            n = len(p.ring)
            tokens = p.tokens
            key = (p.seq_len, n, tokens, mb.offload_ratio, ring_inter, group_inter)
            t = self.known.get(key)
            if t is None:
                exposed = None
                if n > 1:
                    ring = (p.seq_len, n, ring_inter)
                    exposed = self.exposed.get(ring)
                    if exposed is None:
                        exposed = self.exposed[ring] = ring_exposed_time(self.cost, *ring)
                t = piece_time(self.cost, p.seq_len, n, tokens, mb.offload_ratio, ring_inter, exposed)
                t = self.known[key] = t + all_to_all_time(self.cost, max(tokens, 1), self.e, group_inter)
            return t
        if pieces:
            return self._several(mb, ring_inter, group_inter)
        key = (None, None, None, mb.offload_ratio, ring_inter, group_inter)  # an empty slot
        t = self.known.get(key)
        if t is None:
            t = self.known[key] = self._compute(mb, ring_inter, group_inter)
        return t

    def _several(self, mb: MicroBatch, ring_inter: bool, group_inter: bool) -> float:
        tokens = pairs = 0
        for p in mb.pieces:
            if len(p.ring) > 1:
                return self._compute(mb, ring_inter, group_inter)
            for start, end in p.ranges:
                tokens += end - start
            pairs += p.seq_len * p.seq_len
        if pairs > 1 << 53:
            return self._compute(mb, ring_inter, group_inter)
        a2a = all_to_all_time(self.cost, max(tokens, 1), self.e, group_inter)
        return whole_sequences_time(self.cost, tokens, float(pairs), mb.offload_ratio) + a2a

    def _compute(self, mb: MicroBatch, ring_inter: bool, group_inter: bool) -> float:
        a2a = all_to_all_time(self.cost, max(mb.tokens, 1), self.e, group_inter)
        return micro_batch_time(self.cost, mb, ring_inter) + a2a
