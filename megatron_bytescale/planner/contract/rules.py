"""The rules a valid Plan keeps, one small function each (``Plan.validate`` runs them all).
Each takes the plan and returns its violations as one line each (empty: none)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from graphlib import CycleError, TopologicalSorter

from .graph import find_pipeline_deadlock
from .ops import FORWARD, as_ops
from .slots import slot_errors, slot_unit_keys
from .transports import RING_TRANSPORTS
from .zigzag import zigzag_ranges

__all__ = [
    "barrier_errors",
    "crossing_order_mismatch",
    "micro_batch_errors",
    "plan_pipeline_deadlock",
    "resident_fraction",
    "ring_order_errors",
    "sequence_errors",
    "shape_errors",
    "slot_errors",
    "stage_order_errors",
]


def resident_fraction(offload_ratio: float, num_layers: int) -> float:
    """Share of a micro-batch's activations that stays on the device (design 2.4).

    The last two layers always stay; of the other ``l - 2`` layers a fraction ``r`` moves
    to host memory. A rank may then hold ``C / resident_fraction`` tokens.
    """
    if num_layers <= 2:
        return 1.0
    return (2 + (1.0 - offload_ratio) * (num_layers - 2)) / num_layers


def shape_errors(plan) -> list[str]:
    """Rank lists, capacity, virtual stages, EP groups, recomputed layers, sequence lengths."""
    errors = []
    if len(plan.ranks) != plan.num_ranks:
        errors.append(f"plan has {len(plan.ranks)} rank lists for {plan.num_ranks} ranks")
    if plan.capacity <= 0:
        errors.append(f"capacity must be positive, got {plan.capacity}")
    if plan.virtual_stages < 1:
        errors.append(f"virtual_stages={plan.virtual_stages} must be at least 1 (model chunks per pipeline device)")
    if plan.expert_parallel < 1 or plan.num_ranks % plan.expert_parallel:
        errors.append(f"expert_parallel={plan.expert_parallel} must divide the {plan.num_ranks} ranks into EP groups")
    if not 0 <= plan.recomputed_layers <= plan.num_layers:
        errors.append(f"recomputed_layers={plan.recomputed_layers} outside [0, num_layers={plan.num_layers}]")
    for sid, s in enumerate(plan.seq_lens):
        if s <= 0:
            errors.append(f"sequence {sid} has length {s}; lengths must be positive")
    return errors


def micro_batch_errors(plan) -> list[str]:
    """Each micro-batch: offload ratio in [0, 1], not empty (outside EP slots), within the
    device capacity and the host budget once offloaded; its pieces name known sequences
    once, with their lengths, on rings that hold this rank; one ring and one heads_split."""
    errors = []
    limit = plan.capacity * (1 + 1e-9)
    host_limit = None if plan.host_capacity is None else plan.host_capacity * (1 + 1e-9)
    layers = plan.activation_layers
    for rank, mbs in enumerate(plan.ranks):
        for m, mb in enumerate(mbs):
            where = f"rank {rank} micro-batch {m}"
            if not 0.0 <= mb.offload_ratio <= 1.0:
                errors.append(f"{where}: offload ratio {mb.offload_ratio} outside [0, 1]")
            if not mb.pieces and plan.expert_parallel == 1:
                errors.append(f"{where}: empty micro-batch")
            resident = mb.tokens * resident_fraction(mb.offload_ratio, layers)
            if resident > limit:
                errors.append(
                    f"{where}: {mb.tokens} tokens at offload ratio {mb.offload_ratio:.3f} keep "
                    f"{resident:.0f} token-equivalents on the device, over capacity {plan.capacity}"
                )
            if host_limit is not None and mb.offload_ratio > 0:
                parked = mb.tokens * (1.0 - resident_fraction(mb.offload_ratio, layers))
                if parked > host_limit:
                    errors.append(
                        f"{where}: {mb.tokens} tokens at offload ratio {mb.offload_ratio:.3f} park "
                        f"{parked:.0f} token-equivalents in host memory, over the host budget {plan.host_capacity}"
                    )
            seen_here = set()
            for p in mb.pieces:
                if not 0 <= p.seq_id < len(plan.seq_lens):
                    errors.append(f"{where}: unknown sequence id {p.seq_id}")
                    continue
                if p.seq_id in seen_here:
                    errors.append(f"{where}: sequence {p.seq_id} appears twice")
                seen_here.add(p.seq_id)
                if p.seq_len != plan.seq_lens[p.seq_id]:
                    errors.append(
                        f"{where}: piece of sequence {p.seq_id} says length {p.seq_len}, "
                        f"batch says {plan.seq_lens[p.seq_id]}"
                    )
                if rank not in p.ring:
                    errors.append(f"{where}: sequence {p.seq_id}'s ring {p.ring} does not contain this rank")
            rings = {p.ring for p in mb.pieces if p.is_distributed}
            if len(rings) > 1:
                errors.append(f"{where}: distributed pieces use {len(rings)} different rings; one allowed")
            splits = {p.heads_split for p in mb.pieces if p.is_distributed}
            if len(splits) > 1:
                errors.append(f"{where}: pieces use heads_split {sorted(splits)}; one micro-batch has one")
            carried = {p.transport for p in mb.pieces if p.is_distributed}
            if len(carried) > 1:
                errors.append(f"{where}: its ring pieces carry {sorted(carried)}; one ring carries one transport")
    return errors


def sequence_errors(plan) -> list[str]:
    """Every token of every sequence appears exactly once; a whole sequence is one piece
    ``[0, s)``; a distributed one's ring has distinct ranks, each holding its zigzag share."""
    covered: dict[int, list[tuple[int, int]]] = defaultdict(list)
    holders: dict[int, list] = defaultdict(list)  # seq -> (rank, piece)
    for rank, mbs in enumerate(plan.ranks):
        for mb in mbs:
            for p in mb.pieces:
                if 0 <= p.seq_id < len(plan.seq_lens):
                    covered[p.seq_id].extend(p.ranges)
                    holders[p.seq_id].append((rank, p))
    errors = []
    for sid, s in enumerate(plan.seq_lens):
        spans = sorted(covered.get(sid, []))
        pos = 0
        for start, end in spans:
            if start < pos:
                errors.append(f"sequence {sid}: tokens [{start}, {min(pos, end)}) appear more than once")
            elif start > pos:
                errors.append(f"sequence {sid}: tokens [{pos}, {start}) are not in the plan")
            if end <= start:
                errors.append(f"sequence {sid}: empty or reversed range [{start}, {end})")
            pos = max(pos, end)
        if pos < s:
            errors.append(f"sequence {sid}: tokens [{pos}, {s}) are not in the plan")
        if pos > s:
            errors.append(f"sequence {sid}: ranges reach {pos}, past its length {s}")
        errors.extend(_ring_errors(plan.num_ranks, sid, s, holders.get(sid, [])))
    return errors


def _ring_errors(num_ranks: int, sid: int, s: int, held: list) -> list[str]:
    if not held:
        return []
    ring = held[0][1].ring
    if any(p.ring != ring for _, p in held):
        return [f"sequence {sid}: pieces disagree about the ring: {sorted({p.ring for _, p in held})}"]
    if len(set(ring)) != len(ring) or not all(0 <= r < num_ranks for r in ring):
        return [f"sequence {sid}: ring {ring} repeats a rank or names a rank outside 0..{num_ranks - 1}"]
    u = held[0][1].heads_split
    if any(p.heads_split != u for _, p in held):
        return [f"sequence {sid}: pieces disagree about heads_split: {sorted({p.heads_split for _, p in held})}"]
    if u < 1 or len(ring) % u or (u > 1 and len(ring) == 1):
        return [f"sequence {sid}: heads_split {u} does not divide its ring of {len(ring)} ranks into groups"]
    carried = {p.transport for _, p in held}
    if len(carried) > 1:
        return [f"sequence {sid}: its ring's pieces disagree about what it carries: {sorted(carried)}"]
    transport = carried.pop()
    if transport not in RING_TRANSPORTS:
        return [f"sequence {sid}: ring transport {transport!r} is not one of {', '.join(RING_TRANSPORTS)}"]
    if transport != "kv" and (len(ring) == 1 or u > 1):
        what = "a whole sequence has no ring" if len(ring) == 1 else f"its two-level ring (heads_split {u}) splits it"
        return [f"sequence {sid}: transport {transport!r} needs a plain ring, but {what}; use 'kv'"]
    ranks_holding = sorted(r for r, _ in held)
    if ranks_holding != sorted(ring):
        return [f"sequence {sid}: held by ranks {ranks_holding}, ring is {ring}; each member holds one piece"]
    if len(ring) > s:
        return [f"sequence {sid}: ring of {len(ring)} ranks for {s} tokens"]
    shares = zigzag_ranges(s, len(ring))
    errors = []
    for rank, p in held:
        i = ring.index(rank)
        if p.ranges != shares[i]:
            errors.append(f"sequence {sid}: rank {rank} (ring index {i}) holds {p.ranges}, zigzag share is {shares[i]}")
    return errors


def ring_order_errors(plan) -> list[str]:
    """Members of a ring meet in the same ring micro-batch (``MicroBatch.ring_key``), each
    once, and the ranks order their ring micro-batches consistently (no P2P deadlock)."""
    ring_keys = {rank: [key for key in keys if key is not None] for rank, keys in enumerate(plan.ring_keys())}
    errors = []
    members_of: dict[tuple, set[int]] = defaultdict(set)
    for rank, keys in ring_keys.items():
        if len(set(keys)) != len(keys):
            errors.append(f"rank {rank}: the same ring micro-batch appears twice")
        for key in keys:
            members_of[key].add(rank)
    for key, members in members_of.items():
        ring, seqs = key
        if members != set(ring):
            errors.append(
                f"ring micro-batch of sequences {list(seqs)} on ring {ring} is scheduled only on ranks "
                f"{sorted(members)}"
            )
    # Deadlock freedom: the "runs before" relation between ring micro-batches on each rank
    # must be acyclic (then the lowest unfinished one can always make progress).
    before: dict[tuple, set[tuple]] = {k: set() for k in members_of}
    for keys in ring_keys.values():
        for a, b in zip(keys, keys[1:]):
            before[b].add(a)
    try:
        tuple(TopologicalSorter(before).static_order())
    except CycleError:
        errors.append("ring micro-batches are ordered inconsistently across ranks: P2P would deadlock")
    return errors


def stage_order_errors(plan) -> list[str]:
    """``stage_orders``, when given: the same number of stages for every rank, each stage
    running every chunk of every micro-batch of its rank once forward and then once
    backward, devices passing micro-batches on in the order the receiver runs them
    (``crossing_order_mismatch``), and the pipelines free of deadlock in those orders."""
    if plan.stage_orders is None:
        return []
    if len(plan.stage_orders) != plan.num_ranks:
        return [f"stage_orders has {len(plan.stage_orders)} rank lists for {plan.num_ranks} ranks"]
    errors = []
    stages = plan.stage_count
    if stages < 1:
        return ["stage_orders must give at least one stage per rank"]
    v = plan.virtual_stages
    for rank, per_stage in enumerate(plan.stage_orders):
        if len(per_stage) != stages:
            errors.append(f"rank {rank}: stage_orders gives {len(per_stage)} stages, rank 0 gives {stages}")
            continue
        count = len(plan.ranks[rank])
        want = sorted(list(range(count * v)) + [-1 - x for x in range(count * v)])
        for stage, codes in enumerate(per_stage):
            where = f"rank {rank} stage {stage}"
            if sorted(codes) != want:
                chunks = f" (each of its {v} chunks)" if v > 1 else ""
                errors.append(
                    f"{where}: the order must run each of the {count} micro-batches{chunks} once forward and once "
                    "backward"
                )
                continue
            seen = set()
            for c in codes:
                if c < 0 and -1 - c not in seen:
                    m, chunk = divmod(-1 - c, v)
                    chunk_name = f" chunk {chunk}" if v > 1 else ""
                    errors.append(f"{where}: the backward of micro-batch {m}{chunk_name} comes before its forward")
                    break
                seen.add(c)
    if not errors:
        for rank, orders in enumerate(plan.decoded_stage_orders()):
            mismatch = crossing_order_mismatch(orders, v)
            if mismatch:
                errors.append(f"rank {rank}: {mismatch}")
    if not errors:
        stuck = plan_pipeline_deadlock(plan, stages)
        if stuck:
            errors.append(f"stage_orders deadlock: {stuck}")
    return errors


def plan_pipeline_deadlock(plan, stages: int) -> str | None:
    """None if every pipeline running ``plan``'s micro-batches over ``stages`` stages, in the
    default orders or the plan's own (``Plan.stage_orders``), always makes progress; else
    where they get stuck (``graph.find_pipeline_deadlock``). Under expert parallelism an EP
    group's slot is one unit of all its members (``slots.slot_unit_keys``): the all-to-alls
    join them at every stage."""
    orders = plan.decoded_stage_orders()
    if orders is not None and plan.stage_count != stages:
        return f"the plan orders {plan.stage_count} pipeline stages but the pipeline has {stages}"
    if stages <= 1 and plan.virtual_stages <= 1:
        return None
    keys = slot_unit_keys(plan) if plan.expert_parallel > 1 else plan.ring_keys()
    return find_pipeline_deadlock(keys, stages, orders, plan.virtual_stages)


def barrier_errors(plan) -> list[str]:
    """``barriers``: per barrier, for every rank, a non-decreasing count of micro-batches
    finished before it, at most the rank's micro-batches; no stage orders beside them."""
    counts = [len(mbs) for mbs in plan.ranks]
    prev = [0] * plan.num_ranks
    for b, entry in enumerate(plan.barriers):
        if len(entry) != plan.num_ranks or any(not prev[r] <= entry[r] <= counts[r] for r in range(plan.num_ranks)):
            return [
                f"barrier {b} must give, for each of {plan.num_ranks} ranks, a non-decreasing count of "
                f"micro-batches finished before it (at most the rank's micro-batches); got {list(entry)}"
            ]
        prev = list(entry)
    if plan.barriers and plan.stage_orders is not None:
        return ["a plan with barriers runs the default orders: stage orders and barriers do not mix"]
    return []


def crossing_order_mismatch(stage_orders: Sequence[Sequence[Sequence[int]]], chunks: int = 1) -> str | None:
    """None if the devices of one pipeline agree on the order of the messages between them,
    else where they differ. Activations go to the next virtual stage and their gradients back
    in posting order (NCCL matches point-to-point messages between two ranks of one
    communicator in order; the runtime sends activations and gradients on two, so each
    direction is its own stream), so for every ordered pair of devices and direction, the
    sender's sends and the receiver's receives must list the same (micro-batch, virtual stage)
    in the same order.
    Without chunks this is: stage ``k + 1`` runs its forwards in stage ``k``'s order of
    forwards, stage ``k`` its backwards in stage ``k + 1``'s order. ``stage_orders``: per
    device, its ops in run order."""
    p = len(stage_orders)
    last = p * chunks - 1
    sent: dict[tuple[int, int], list] = defaultdict(list)
    received: dict[tuple[int, int], list] = defaultdict(list)
    for d, order in enumerate(stage_orders):
        for direction, m, c in as_ops(order):
            vs = c * p + d
            step = 1 if direction == FORWARD else -1
            if 0 <= vs + step <= last:  # sends to the next virtual stage (the previous one, backward)
                sent[d, (vs + step) % p, direction].append((direction, m, vs + step))
            if 0 <= vs - step <= last:  # received from the previous virtual stage (the next one)
                received[(vs - step) % p, d, direction].append((direction, m, vs))
    for pair in sorted(set(sent) | set(received)):
        a, b = sent.get(pair, []), received.get(pair, [])
        if a != b:
            i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

            def name(msgs):
                if i >= len(msgs):
                    return "nothing"
                d, m, vs = msgs[i]
                kind = "forward" if d == FORWARD else "backward"
                return f"the {kind} of micro-batch {m}" + (f" at virtual stage {vs}" if chunks > 1 else "")

            if chunks == 1:
                k = min(pair[:2])
                kind = "forwards" if pair[2] == FORWARD else "backwards"
                ma = [m for _, m, _ in a]
                mb = [m for _, m, _ in b]
                return f"stages {k} and {k + 1} run their {kind} in different orders ({ma} vs {mb})"
            return (
                f"device {pair[0]} sends {name(a)} as its {i}-th message of that direction to device "
                f"{pair[1]}, which expects {name(b)}"
            )
    return None
