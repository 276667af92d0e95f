"""Expert parallelism under HDP: aligned micro-batch slots per expert-parallel group.

megatron-core's MoE layer with the all-to-all token dispatcher (``--expert-model-parallel-size
E > 1``) exchanges tokens among the E members of an expert-parallel (EP) group in every MoE
layer, forward and backward: the members must run the same number of micro-batches, the k-th
of one with the k-th of the others. So under EP a plan's lists are *slot lists*: every member
of an EP group (HDP ranks ``r // E``, Megatron's expert groups) holds the same number of
micro-batches; those with nothing to run hold an empty one, run as one padding token
(``runtime.padding``) so that it still joins every all-to-all.

``align_expert_slots`` puts a plan's micro-batches on aligned slots (keeping each rank's ring
order) and ``round_rings_to_groups`` sizes rings to whole EP groups (the balance scheduler
places them on whole groups); ``expert.timing.slot_finish_times`` estimates an aligned plan.
The deadlock rule the slots keep is the contract's (``contract.slots``); its proof, the
alignment and the costs: docs/design.md, "Expert parallelism".
"""

from __future__ import annotations

from itertools import accumulate, chain

import numpy as np

from ...errors import ConfigError
from ..contract import MicroBatch, Plan, micro_batch
from ..contract.slots import ep_groups
from ..jit import kernel

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
    aligned.meta["expert_slots"] = slot_counts(ranks, groups)
    return aligned


def slot_counts(ranks, groups) -> dict:
    """``Plan.meta["expert_slots"]`` of aligned rank lists: each EP group's slot count, and
    the empty slots in all."""
    return {
        "slots_per_group": [len(ranks[g[0]]) for g in groups],
        "empty_slots": sum(1 for mbs in ranks for mb in mbs if not mb.pieces),
    }


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
    (``item_slots``). The rings are numbered here (each key hashed once), and the check that
    each is held once by each of its members is made on arrays."""
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
    slots, whole = item_slots(number, counts, len(ids))
    if not whole:
        return None  # a cycle: the scan reports it
    slots = slots.tolist()
    bounds = list(accumulate(counts.tolist(), initial=0))
    return [dict(zip(slots[a:b], q)) for q, a, b in zip(queues, bounds, bounds[1:])]


def round_rings_to_groups(expert_parallel: int, num_ranks: int):
    """A ring decision ``(ring size, offload ratio, two-level group)`` of a sequence's length
    rounded up to whole EP groups, where the sequence and the cluster allow (a larger ring
    holds fewer tokens per member, so memory still fits): ``sizing.ring_decisions``'
    ``resize``, applied once per distinct length."""
    e = expert_parallel

    def resize(seq_len: int, n: int, ratio: float, split: int) -> tuple[int, float, int]:
        rounded = -(-n // e) * e
        if n > 1 and rounded != n and rounded <= min(num_ranks, seq_len):
            return rounded, ratio, split if rounded % split == 0 else 1
        return n, ratio, split

    return resize


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


@kernel(size=lambda number, *_: number.size)
def item_slots(number: np.ndarray, counts: np.ndarray, rings: int):
    """``_slots_from_ring_times``' slots, item by item: ``number`` each item's ring (0 to
    ``rings - 1``; -1: local), rank after rank (``counts`` per rank). A ring runs at the
    latest, over its members, of max(slot of the member's previous ring + 1, its position in
    the member's queue), found in Kahn's order over the rings; a rank's local items take, in
    order, the first slots none of its rings holds. Returns each item's slot and whether every
    ring was reached (False: they wait in a cycle)."""
    n = counts.size
    total = number.size
    start = np.zeros(n + 1, dtype=np.int64)
    for r in range(n):
        start[r + 1] = start[r] + counts[r]
    held = np.zeros(rings + 1, dtype=np.int64)  # each ring's holders, CSR
    for i in range(total):
        if number[i] >= 0:
            held[number[i] + 1] += 1
    for i in range(rings):
        held[i + 1] += held[i]
    holder = np.empty(held[rings], dtype=np.int64)
    fill = held[:-1].copy()
    for r in range(n):
        for i in range(start[r], start[r + 1]):
            if number[i] >= 0:
                holder[fill[number[i]]] = r
                fill[number[i]] += 1
    slot = np.zeros(rings, dtype=np.int64)
    left = held[1:] - held[:-1]  # members yet to reach each ring
    at = start[:-1].copy()  # each rank's next item that may be a ring
    ready = np.empty(rings, dtype=np.int64)
    top = 0
    prev = np.full(n, -1, dtype=np.int64)  # each rank's previous ring's slot
    todo = np.arange(n)  # ranks that move on to their next ring
    count = n
    done = 0
    while True:
        for t in range(count):  # each rank in ``todo`` reaches its next ring, if any
            r = todo[t]
            while at[r] < start[r + 1] and number[at[r]] < 0:
                at[r] += 1
            if at[r] == start[r + 1]:
                continue
            i = number[at[r]]
            pos = at[r] - start[r]
            s = prev[r] + 1 if prev[r] >= pos else pos
            if s > slot[i]:
                slot[i] = s
            left[i] -= 1
            if left[i] == 0:
                ready[top] = i
                top += 1
        if top == 0:
            break
        top -= 1
        i = ready[top]
        done += 1
        count = held[i + 1] - held[i]
        for c in range(count):  # its members move past it
            r = holder[held[i] + c]
            prev[r] = slot[i]
            at[r] += 1
            todo[c] = r
    out = np.empty(total, dtype=np.int64)
    if done < rings:
        return out, False
    for r in range(n):  # rings at their slots, local items in the first free ones, in order
        free = 0
        for i in range(start[r], start[r + 1]):
            if number[i] >= 0:
                out[i] = slot[number[i]]
        j = start[r]  # the next ring item, whose slot a local item skips
        while j < start[r + 1] and number[j] < 0:
            j += 1
        for i in range(start[r], start[r + 1]):
            if number[i] >= 0:
                continue
            while j < start[r + 1] and slot[number[j]] <= free:
                if slot[number[j]] == free:
                    free += 1
                j += 1
                while j < start[r + 1] and number[j] < 0:
                    j += 1
            out[i] = free
            free += 1
    return out, True
