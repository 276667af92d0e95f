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

from graphlib import CycleError
from itertools import accumulate, chain

import numpy as np

from ..errors import ConfigError
from . import compiled
from .contract import MicroBatch, Plan, longest_paths, micro_batch
from .contract.slots import ep_groups, slot_nodes
from .cost_model import CostModel
from .estimate import crosses_nodes, micro_batch_time, piece_time, ring_exposed_time, whole_sequences_time
from .placement import RingPlacer

EMPTY = micro_batch(())  # an empty slot: the rank runs one padding token through the model


def align_expert_slots(plan: Plan, expert_parallel: int) -> Plan:
    """The plan with every EP group's members on aligned slots (see the module docstring);
    the plan itself when ``expert_parallel`` is 1. Keeps every micro-batch and each rank's
    ring order; may run a rank's local micro-batches earlier to fill the wait for a ring."""
    if expert_parallel == 1:
        return plan
    groups = ep_groups(plan.num_ranks, expert_parallel)
    queues, keys = zip(*(_longest_first(mbs) for mbs in plan.ranks)) if plan.ranks else ((), ())
    slotted = _slots_from_ring_times(queues, keys)
    if slotted is None:  # rings the fast path cannot time (an invalid plan): scan slot by slot
        slotted = _slots_by_scan([list(q) for q in queues])
    ranks: list[tuple[MicroBatch, ...]] = [()] * plan.num_ranks
    for group in groups:
        used = sorted(set().union(*(slotted[r] for r in group)))  # slots where some member runs
        empty = [EMPTY] * len(used)
        for r in group:
            ranks[r] = tuple(map(slotted[r].get, used, empty))
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


def _slots_by_scan(queues: list[list[MicroBatch]]) -> list[dict[int, MicroBatch]]:
    """Each rank's micro-batches by global slot (rank -> slot -> micro-batch), found slot by
    slot: a ring runs once all its members hold it next; meanwhile a member runs its next
    local micro-batch, if any. The definition ``_slots_from_ring_times`` computes faster;
    raises ConfigError when rings wait on each other in a cycle. ``queues`` are consumed."""
    slotted: list[dict[int, MicroBatch]] = [{} for _ in queues]
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
    return slotted


def _slots_from_ring_times(queues, keys) -> list[dict[int, MicroBatch]] | None:
    """What ``_slots_by_scan`` finds, without scanning every rank at every slot; None where
    a ring is not held exactly once by each of its members, or rings wait in a cycle.

    Under the scan a rank runs a local micro-batch at every slot that is not one of its ring
    slots, while it has any left, so its locals fill the other slots in order. A ring reaches
    the head of member r's queue at ``max(slot of r's previous ring + 1, its queue position)``
    (both: every earlier ring has run, and every earlier local has had a slot) and runs at
    the latest such slot of its members: a longest path over the rings, in Kahn's order
    (``compiled._item_slots``, run as Python where numba is missing). The rings are numbered
    here (each key hashed once), and the check that each is held once by each of its members
    is made on arrays."""
    ids: dict[tuple, int] = {}
    flat = list(chain.from_iterable(keys))
    number = np.fromiter((-1 if k is None else ids.setdefault(k, len(ids)) for k in flat), np.int64, len(flat))
    ring = number >= 0
    counts = np.fromiter(map(len, keys), np.int64, len(keys))
    nums = number[ring]
    held_by = np.repeat(np.arange(len(keys)), counts)[ring]
    holders = held_by[np.lexsort((held_by, nums))]  # each ring's holders ascending, rings in order
    members = [key[0] for key in ids]  # in ring number order
    sizes = np.fromiter(map(len, members), np.int64, len(members))
    if not np.array_equal(np.bincount(nums, minlength=len(ids)), sizes):
        return None
    member = np.fromiter(chain.from_iterable(members), np.int64, int(sizes.sum()))
    of = np.repeat(np.arange(len(ids)), sizes)
    member = member[np.lexsort((member, of))]  # each ring's members ascending, rings in order
    if not np.array_equal(member, holders) or np.any((member[1:] == member[:-1]) & (of[1:] == of[:-1])):
        return None  # some ring not held exactly once by each member (nor by others)
    slots, whole = (compiled.item_slots() or compiled._item_slots)(number, counts, len(ids))
    if not whole:
        return None  # a cycle: the scan reports it
    slots = slots.tolist()
    bounds = list(accumulate(counts.tolist(), initial=0))
    return [dict(zip(slots[a:b], q)) for q, a, b in zip(queues, bounds, bounds[1:])]


def round_rings_to_groups(expert_parallel: int, num_ranks: int):
    """A ring decision ``(ring size, offload ratio, two-level group)`` of a sequence's length
    rounded up to whole EP groups, where the sequence and the cluster allow (a larger ring
    holds fewer tokens per member, so memory still fits): ``sharding.plan_ring_sizes``'
    ``resize``, applied once per distinct length."""
    e = expert_parallel

    def resize(seq_len: int, n: int, ratio: float, split: int) -> tuple[int, float, int]:
        rounded = -(-n // e) * e
        if n > 1 and rounded != n and rounded <= min(num_ranks, seq_len):
            return rounded, ratio, split if rounded % split == 0 else 1
        return n, ratio, split

    return resize


class GroupPlacer(RingPlacer):
    """Places a ring of whole EP groups on the least-loaded groups (a group is as loaded as
    its busiest member; ties to lower groups), so that no group mixes two rings in one slot;
    other rings as ``RingPlacer`` does."""

    def __init__(self, num_ranks: int, ranks_per_node: int, expert_parallel: int):
        super().__init__(num_ranks, ranks_per_node)
        ep_groups(num_ranks, expert_parallel)
        self.expert_parallel = expert_parallel
        # each group's busiest member's load, for the caller's array ``_busiest_of`` (kept from
        # the ranks it says changed: a ring changes one or two groups of thousands)
        self._busiest: np.ndarray | None = None
        self._busiest_of: np.ndarray | None = None

    def place_ranks(
        self, loads: np.ndarray, ring_size: int, group: int = 1, changed: list[int] | None = None
    ) -> list[int]:
        e = self.expert_parallel
        busiest = self._group_loads(loads, changed)
        if ring_size % e or group > 1:
            return super().place_ranks(loads, ring_size, group, changed)
        self._note_changes(loads, changed)  # the base class's kept node order stays current
        wanted = ring_size // e
        if wanted == 1:  # the first least-loaded group, unless a load is NaN (sorted last)
            g = int(busiest.argmin())
            if busiest[g] == busiest[g]:
                return list(range(g * e, g * e + e))
        # the least-loaded groups, ties to lower groups (a stable sort), in group order
        chosen = np.sort(np.argsort(busiest, kind="stable")[:wanted])
        return (chosen[:, None] * e + np.arange(e)[None, :]).ravel().tolist()

    def _group_loads(self, loads: np.ndarray, changed: list[int] | None) -> np.ndarray:
        """Each EP group's busiest member's load (the same maxima however they are found)."""
        e = self.expert_parallel
        known = changed is not None and loads is self._busiest_of and self._busiest is not None
        if known and len(changed) <= 4 * e:
            for g in {r // e for r in changed}:
                self._busiest[g] = loads[g * e : g * e + e].max()
        else:
            self._busiest = loads.reshape(-1, e).max(axis=1)
            self._busiest_of = loads
        return self._busiest


def _longest_first(mbs) -> tuple[list[MicroBatch], list[tuple | None]]:
    """The micro-batches with each run of local ones (between two ring micro-batches) in
    descending token order: slot k of an EP group then pairs the members' k-th largest, and a
    slot waits less for its slowest member. Also each one's ring key (None: local)."""
    out: list[MicroBatch] = []
    keys: list[tuple | None] = []
    run: list[MicroBatch] = []

    def flush():
        if len(run) > 1:
            run.sort(key=lambda m: -m.tokens)  # stable: equal sizes keep their order
        out.extend(run)
        keys.extend([None] * len(run))
        run.clear()

    for mb in mbs:
        key = mb.ring_key
        if key is None:
            run.append(mb)
            continue
        if run:
            flush()
        out.append(mb)
        keys.append(key)
    flush()
    return out, keys


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
