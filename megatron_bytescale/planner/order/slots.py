"""Ring slots: order each rank's micro-batches so that ring micro-batches cannot deadlock
under 1F1B, and estimate the result.

``order_runs`` takes each rank's work in schedule order and gives every ring one *slot* on
all its members (the aligned pass, ``order.aligned``); only when no local work is left may a
ring miss its slot, and then the shortest safe of the candidate orders wins (``Ordered.deadlock``
says why if none is safe). ``rank_estimates`` times the result. Why one slot per ring is safe
under 1F1B, and the passes in detail: docs/design.md, "Pipeline order".
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..contract import find_pipeline_deadlock
from ..cost_model import FORWARD_SHARE
from ..estimate import one_f_one_b_time
from .aligned import LOOKAHEAD, aligned
from .interleaved import slot_interleaved_orders, slot_offsets
from .levels import order_by_level
from .runs import (
    Item,
    LocalBatch,
    Ordered,
    PackSplitter,
    RunArrays,
    ordered_item_arrays,
    rings_at_one_index,
    run_arrays,
    run_lists,
    sequential,
    unit_keys,
)
from .walk import Longer, PipelineArrays, finish_times, pipelined_finish_times

# ``order_runs``' candidates where some ring could not take one slot: the aligned pass as it
# is, slots from the ring structure (rings in schedule order, then largest first) and the
# rings placed again at levels
FALLBACKS = ("aligned", "ring slots", "ring slots by size", "by level")


def order_runs(
    runs: Sequence[Sequence[Item]],
    ring_order: Sequence[int],
    members: dict[int, tuple[int, ...]],
    ring_time: dict[int, float],
    stages: int = 1,
    split: PackSplitter | None = None,
    ranks_per_node: int = 1,
    lookahead: int = LOOKAHEAD,
    fallback: bool = True,
    forward_share: float = FORWARD_SHARE,
    arrays: RunArrays | None = None,
) -> Ordered:
    """Each rank's items in run order, and the estimated finish of each rank when every ring
    starts as soon as its last member reaches it. ``runs[r]`` holds ``r``'s rings in
    ``ring_order``. With ``stages > 1`` the order is made safe for 1F1B (see above);
    ``Ordered.deadlock`` says why if no safe order was found. ``fallback=False`` skips the
    searches of step 2 (slow on large plans): the first ring left unaligned then sets
    ``deadlock`` and ends the pass (the runs are then incomplete: only ``deadlock`` counts).
    ``forward_share``: the forward's share of a stage's time (``CostModel.forward_share``);
    ``arrays``: ``run_arrays(runs)``, where the caller has it."""
    if stages <= 1:
        return sequential(runs, ring_order, members, ring_time)
    if arrays is None:
        arrays = run_arrays(runs)  # what the passes below read of the runs, made once
    result = aligned(runs, ring_order, members, ring_time, split, lookahead, stop_unaligned=not fallback, arrays=arrays)
    if not result.unaligned:
        return result
    if not fallback:
        result.deadlock = f"ring micro-batch {result.unaligned[0]} could not take one slot on all its members"
        return result
    # Local work ran out: some rings could not take one slot. The candidates, of which the
    # shortest estimated step wins: the pass's order if 1F1B runs through it anyway; slots
    # from the ring structure alone; and, if the placement admits no safe order (three rings
    # on three ranks, each pair sharing a rank, nothing else to run), the rings placed again.
    safe = []
    if "aligned" in FALLBACKS and not _deadlocks(result.runs, stages):
        safe.append(result)
    by_size = sorted(ring_order, key=lambda u: -len(members[u]))
    for order in [o for kind, o in (("ring slots", ring_order), ("ring slots by size", by_size)) if kind in FALLBACKS]:
        placed = _slot_search(runs, order, members, split)
        if placed is not None and not _deadlocks(placed[0], stages):
            runs_by_slot, slots = placed
            again = sequential(runs_by_slot, sorted(slots, key=slots.get), members, ring_time)
            again.searched = True
            safe.append(again)
    again = (
        order_by_level(runs, ring_order, members, ring_time, ranks_per_node, arrays)
        if "by level" in FALLBACKS
        else None
    )
    if again is not None:
        safe.append(again)
    if not safe:
        result.deadlock = _deadlock_of(result.runs, stages)
        return result
    best = min(safe, key=lambda o: max(rank_estimates(o, stages, ring_time, forward_share)))  # first of equals
    best.unaligned = result.unaligned
    return best


def rank_estimates(
    ordered: Ordered,
    stages: int,
    ring_time: dict[int, float],
    forward_share: float = FORWARD_SHARE,
    chunks: int = 1,
    known: dict | None = None,
    limit: float = math.inf,
) -> list[float] | Longer:
    """Estimated seconds per rank. Without pipelines: its clock (micro-batches back to back,
    each ring starting when its last member reaches it). With pipelines: its finish when
    every rank runs 1F1B and rings start on each stage when all members are ready there
    (``pipelined_finish_times``; a ring counts its slowest member's time), which is how the
    simulator runs them; with ``chunks`` model chunks per device, the interleaved order, or
    where it deadlocks the shorter slot-aligned one, ``slot_interleaved_orders``: the greedy
    run's or Megatron's fixed schedule, as ``stage_schedule.chunk_schedule`` will choose); an
    order that would deadlock gets each rank's 1F1B makespan
    (``estimate.one_f_one_b_time``) or clock, the longer. With chunks, ``known`` (a dict)
    receives each order evaluated, for ``stage_schedule.chunk_schedule`` to reuse: None (the
    interleaved order) or (megatron, shift) -> (orders, finish). ``limit``: a
    step the caller already has; the slot-aligned orders' walks stop once they are bound to be
    longer (they cannot deadlock, ``slot_interleaved_orders``, so one stopped is longer
    whatever follows), and so does the default order's where every ring is the same
    micro-batch of all its members (``rings_at_one_index``: it cannot deadlock either; the
    level orders of ``order_by_level``); where every order the estimate could come from is
    longer, this is ``Longer(limit)`` (``known`` then holds ``Longer`` for the orders stopped)."""
    if stages <= 1:
        return list(ordered.clock)
    rings, seconds, counts = ordered_item_arrays(ordered, ring_time)
    # the graph's arrays, made once from the items' arrays for every order evaluated; the
    # lists of keys and times only where the slot orders read them
    pipes = PipelineArrays.of_rings(rings, seconds, counts, stages, forward_share, chunks)
    lists = []

    def keys_and_times():
        if not lists:
            lists[:] = run_lists(rings, seconds, counts)
        return lists

    def finish_of(orders, bound=math.inf):
        return finish_times(pipes, orders, bound)

    known = {} if known is None else known
    # walked to the end where it might deadlock (whether it does decides what follows); where
    # it cannot, an order longer than the caller's step loses whatever follows: stopped there
    # (checked only where there is a step to stop at)
    safe = math.isfinite(limit) and rings_at_one_index(rings, counts)
    finish = finish_of(None, limit if safe else math.inf)
    known[None] = (None, finish)
    if isinstance(finish, Longer):
        return finish
    if finish is None and chunks > 1:  # the slot-aligned interleaved orders are safe where rings share slots
        keys = keys_and_times()[0]
        offsets = slot_offsets(keys)
        # Megatron's first (the shorter on most batches), so that the other's walk may stop
        # at its step; the first of (not Megatron, Megatron) wins a tie, as in that order
        found = {}
        for megatron in (True, False):
            orders = (
                None
                if offsets is None
                else slot_interleaved_orders(keys, stages, chunks, megatron=megatron, offsets=offsets)
            )
            bound = limit if finish is None else min(limit, max(finish))
            found[megatron] = None if orders is None else finish_of(orders, bound)
            known[megatron, 0] = (orders, found[megatron])
            if isinstance(found[megatron], list) and (
                finish is None
                or max(found[megatron]) < max(finish)
                or (not megatron and max(found[megatron]) == max(finish))
            ):
                finish = found[megatron]
        if finish is None and any(isinstance(f, Longer) for f in found.values()):
            return Longer(limit)
    if finish is not None:
        return finish
    return [
        max(clock, one_f_one_b_time(t, stages, forward_share)) for clock, t in zip(ordered.clock, keys_and_times()[1])
    ]


def _deadlock_of(runs: Sequence[Sequence[Item]], stages: int) -> str | None:
    """Where 1F1B over ``runs`` gets stuck, or None (the contract's walk: slow on large
    plans, for the message; ``_deadlocks`` answers yes or no)."""
    return find_pipeline_deadlock(unit_keys(runs), stages)


def _deadlocks(runs: Sequence[Sequence[Item]], stages: int) -> bool:
    """Whether 1F1B over ``runs`` deadlocks: the planner's graph walk, which finds a cycle
    exactly where the contract's does."""
    keys = unit_keys(runs)
    return pipelined_finish_times(keys, [[1.0] * len(run) for run in keys], stages, FORWARD_SHARE) is None


def _slot_search(runs, order, members, split: PackSplitter | None):
    """Slots for rings from the ring structure alone: each ring, in ``order``, takes the slot
    that opens the fewest gaps on its members: after or before the slots a member holds, or
    in one of its gaps. A rank's gaps must be filled by its own local micro-batches (packs
    may be split); the rest run after its last ring. Returns the runs in slot order and the
    slots, or None."""
    n = len(runs)
    locals_ = [[x for x in run if isinstance(x, LocalBatch)] for run in runs]
    supply = [sum(len(x.seq_ids) for x in batches) if split else len(batches) for batches in locals_]
    used: list[dict[int, int]] = [{} for _ in range(n)]
    span: list[tuple[int, int] | None] = [None] * n
    slots: dict[int, int] = {}

    def fits(r: int, lo: int, hi: int, count: int) -> bool:
        return hi - lo + 1 - count <= supply[r]

    for u in order:
        ring = members[u]
        cands = set()
        for r in ring:
            if span[r] is not None:
                lo, hi = span[r]
                cands.update((lo - 1, hi + 1))
                cands.update(v for v in range(lo + 1, hi) if v not in used[r])
        best = None
        for v in sorted(cands or {0}, reverse=True):  # ties: the latest slot, as the schedule runs
            cost = 0
            for r in ring:
                if span[r] is None:
                    continue
                if v in used[r]:
                    break
                lo, hi = min(span[r][0], v), max(span[r][1], v)
                if not fits(r, lo, hi, len(used[r]) + 1):
                    break
                cost += (hi - lo) - (span[r][1] - span[r][0]) - 1
            else:
                if best is None or cost < best[0]:
                    best = (cost, v)
        if best is None:
            return None
        v = best[1]
        slots[u] = v
        for r in ring:
            used[r][v] = u
            span[r] = (v, v) if span[r] is None else (min(span[r][0], v), max(span[r][1], v))

    out = []
    for r in range(n):
        batches = list(locals_[r])
        if span[r] is None:
            out.append(batches)
            continue
        lo, hi = span[r]
        holes = hi - lo + 1 - len(used[r])
        while len(batches) < holes and split is not None and any(len(x.seq_ids) > 1 for x in batches):
            big = max((x for x in batches if len(x.seq_ids) > 1), key=lambda x: (len(x.seq_ids), x.time))
            _replace(batches, big, list(split(big)))
        run: list[Item] = []
        for v in range(lo, hi + 1):
            if v in used[r]:
                run.append(used[r][v])
            elif batches:
                run.append(batches.pop(0))
        out.append(run + batches)
    return out, slots


def _replace(items: list, old, new: list) -> None:
    i = next(i for i, x in enumerate(items) if x is old)
    items[i : i + 1] = new
