"""plan_step: one training step's HDP plan from the global batch's sequence lengths.

    shard (ring sizes, offload ratios) -> units of work -> balance (which rank, which order)
    -> pack each rank's short sequences into micro-batches -> order them (pipelines) -> Plan

Strategies (``Plan.meta["strategy"]``):

* ``hdp-balanced`` (``balance="dp"`` or ``"pp"``): rings sized for memory and for the step's
  target time, work given out by estimated time (``balance.schedule``).
* ``hdp-naive`` (``balance="none"``): HDP without the balance scheduler: rings at the
  memory floor, short sequences packed best-fit (first into the spare room of ring
  micro-batches), micro-batches given to ranks by equal token counts, as static DP does.

In ``hdp-balanced`` short sequences stay separate until their rank is known, then are packed
best-fit between that rank's ring micro-batches; they are not packed beside ring shares,
because a ring member that carries extra tokens holds up every other member of its ring.

With ``pipeline_stages > 1`` (every mode) each ring micro-batch then takes one slot on all
its members, so that 1F1B cannot deadlock (``slot_alignment.py``): members run some of
their local micro-batches before or after a ring instead, or split a pack, and only if they
have none left take one from another rank. A batch with too little short work to fill the
slots may get its rings reordered, or placed again (``meta["pipeline_order"]`` says which).
With ``pipeline_schedule="search"`` the planner also looks for per-stage orders other than
1F1B (``stage_schedule.stage_schedule``) and keeps them in the plan (``Plan.stage_orders``)
when their estimated step is shorter.
"""

from __future__ import annotations

import gc
import time
from collections import Counter
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from itertools import chain, pairwise, repeat
from operator import attrgetter, itemgetter

import numpy as np

from ..errors import ConfigError, PlanError
from . import compiled, two_level
from .balance import BALANCE_MODES, Assignment, Unit, UnitColumns, schedule
from .contract import MicroBatch, Piece, Plan, encode_stage_orders, micro_batch, ring_pieces, whole_pieces
from .contract.slots import check_expert_parallel
from .contract.zigzag import rank_tokens, zigzag_ranges
from .cost_model import CostModel
from .estimate import exposed_ring_time, ring_share_time
from .expert_fill import fill_ring_waits
from .expert_slots import (
    GroupPlacer,
    align_expert_slots,
    ep_all_to_all_time,
    round_rings_to_groups,
)
from .lengths import Lengths, lengths_array
from .offload_policy import host_capacity
from .pipeline_times import ArrayOrders, Longer
from .placement import RingPlacer, check_shape
from .sharding import RingDecisions, RingSizer, balanced_target, fill_ring_spare, pack_best_fit, ring_decisions
from .slot_alignment import (
    Item,
    LocalBatch,
    Ordered,
    PackSplitter,
    RunArrays,
    order_by_level,
    order_runs,
    ordered_item_arrays,
    rank_estimates,
    run_arrays,
    run_lists,
)
from .stage_schedule import chunk_schedule, stage_schedule

PIPELINE_SCHEDULES = ("1f1b", "search")
RETARGET = (1.0, 1.1, 1.2, 0.85, 1.35, 0.7, 1.5)  # target scales tried while the step overshoots the target
# With pipelines, target scales tried from the top down (see _pipeline_candidates)
PIPELINE_RETARGET = (1.0, 0.7, 0.5, 0.35, 0.25, 0.18, 0.13, 0.09, 0.06)
PIPELINE_ORDERED = 4  # of those, how many are ordered for 1F1B and estimated in full


@dataclass(frozen=True)
class PlannerConfig:
    num_ranks: int  # d_hdp: HDP ranks (DP x CP flattened)
    capacity: int  # C: tokens per micro-batch per rank without offloading
    ranks_per_node: int = 8  # HDP ranks sharing a node's NVLink (GPUs per node / TP)
    balance: str = "dp"  # "none" (hdp-naive) | "dp" | "pp"
    slack: float = 0.05  # delta, a fraction of the max estimated time (PP runs; DP gives one unit at a time)
    offload: bool = True
    pipeline_stages: int = 1
    # "1f1b": every stage runs 1F1B; "search": per-stage orders from stage_schedule when shorter
    pipeline_schedule: str = "1f1b"
    expert_parallel: int = 1  # EP size: members of an EP group get aligned slots (expert_slots.py)
    # model chunks per pipeline device (virtual pipeline stages; Plan.virtual_stages); > 1
    # needs pipeline_stages > 1
    virtual_stages: int = 1
    # the capacity's flag in error messages: Megatron's by default; the CLI's commands say --capacity
    capacity_flag: str = "--hdp-token-capacity"
    # what plain rings carry (Piece.transport): K and V, an MLA model's "latent", or "auto": per
    # ring, whichever the cost model runs faster (CostModel.cheaper_transport)
    ring_transport: str = "kv"

    def check(self) -> None:
        def whole(name: str, value, low: int, fix: str = "") -> None:
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
                raise ConfigError(f"{name} must be a whole number >= {low}, got {value!r}{fix}")

        whole("num_ranks", self.num_ranks, 1, "; pass the HDP ranks (GPUs / (TP x PP))")
        whole(
            "token capacity",
            self.capacity,
            1,
            f"; set {self.capacity_flag} to the tokens one rank holds per micro-batch (e.g. 8K)",
        )
        whole("ranks_per_node", self.ranks_per_node, 1, "; pass the HDP ranks per node (GPUs per node / TP)")
        whole("pipeline_stages", self.pipeline_stages, 1)
        whole("expert_parallel", self.expert_parallel, 1, "; pass --expert-model-parallel-size")
        whole("virtual_stages", self.virtual_stages, 1, "; pass the model chunks per pipeline stage (1 without VPP)")
        if self.virtual_stages > 1 and self.pipeline_stages == 1:
            raise ConfigError(
                f"virtual_stages={self.virtual_stages} needs pipeline stages: virtual pipeline stages interleave the "
                "chunks of a pipeline; set pipeline_stages > 1 or virtual_stages=1"
            )
        check_expert_parallel(self.num_ranks, self.expert_parallel)
        if self.expert_parallel > 1 and self.pipeline_stages > 1:
            raise ConfigError(
                f"expert parallelism (EP {self.expert_parallel}) with {self.pipeline_stages} pipeline stages is not "
                "supported under HDP: use --pipeline-model-parallel-size 1 or --expert-model-parallel-size 1"
            )
        check_shape(self.num_ranks, self.ranks_per_node)
        if self.balance not in BALANCE_MODES:
            raise ConfigError(f"unknown balance mode {self.balance!r}; choose one of {', '.join(BALANCE_MODES)}")
        if self.pipeline_schedule not in PIPELINE_SCHEDULES:
            raise ConfigError(
                f"unknown pipeline schedule {self.pipeline_schedule!r}; choose one of {', '.join(PIPELINE_SCHEDULES)}"
            )
        if not 0.0 <= self.slack < 1.0:
            raise ConfigError(f"slack must be in [0, 1) (a fraction of the maximum time), got {self.slack}")


def check_lengths(seq_lens: Sequence[int]) -> Lengths:
    arr = np.asarray(seq_lens)
    if arr.ndim != 1 or arr.size == 0:
        raise ConfigError("empty batch: plan_step needs the lengths of at least one sequence")
    if arr.dtype.kind not in "iu":
        if arr.dtype.kind == "f" and np.all(np.isfinite(arr)) and np.all(arr == np.round(arr)):
            arr = arr.astype(np.int64)
        else:
            raise ConfigError(f"sequence lengths must be whole token counts, got {arr.dtype} values")
    bad = np.flatnonzero(arr <= 0)
    if bad.size:
        i = int(bad[0])
        raise ConfigError(
            f"sequence {i} has length {int(arr[i])}: lengths must be positive ({bad.size} bad); drop empty samples "
            "before planning"
        )
    return Lengths.of(arr)


@contextmanager
def _no_cyclic_gc():
    """Pause the cyclic garbage collector: a 16K-rank plan allocates ~10^5 pieces and
    micro-batches (no reference cycles), and the collections they trigger walk every live
    object again and again (a third of the planning time at 512M tokens)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            if gc.get_freeze_count() == 0:
                # the objects made while paused would all sit in the youngest generation,
                # and the first allocation after ``enable`` would walk every one of them
                # (~0.1 s at 512M tokens); freeze + unfreeze moves them to the oldest
                # generation untouched (no cycles to find among them; a full collection
                # still sees them). Skipped when the caller froze objects of its own.
                gc.freeze()
                gc.unfreeze()
            gc.enable()


def plan_step(seq_lens: Sequence[int], config: PlannerConfig, cost: CostModel) -> Plan:
    """The HDP plan for one step. The result passes ``Plan.validate()`` (not run here: it is
    the tests' job, and slow on large clusters)."""
    with _no_cyclic_gc():
        plan = _plan_step(seq_lens, config, cost)
        if config.ring_transport == AUTO_TRANSPORT:
            return with_cheaper_transports(plan, cost, config.ranks_per_node)
        return plan.with_ring_transport(config.ring_transport)


AUTO_TRANSPORT = "auto"


def with_cheaper_transports(plan: Plan, cost: CostModel, ranks_per_node: int) -> Plan:
    """``plan`` with each plain ring micro-batch carrying the transport its sequences run
    fastest with (``CostModel.cheaper_transport`` at the ring's size and links): the latent
    where a ring's hops would be exposed, K and V where re-expanding costs more than it hides."""
    if len(cost.ring_transports) == 1:
        return plan
    latent = plan.with_ring_transport("latent")
    choice: dict[tuple, str] = {}
    ranks = []
    for mbs, carried in zip(plan.ranks, latent.ranks):
        row = []
        for mb, other in zip(mbs, carried):
            key = mb.ring_key
            if key is not None and mb.heads_split == 1 and key not in choice:
                lens = [p.seq_len for p in mb.pieces if p.is_distributed]
                inter = len({r // ranks_per_node for r in key[0]}) > 1
                choice[key] = cost.cheaper_transport(sum(lens), len(key[0]), inter, sum(s * s for s in lens))
            row.append(other if key is not None and choice.get(key) == "latent" else mb)
        ranks.append(tuple(row))
    return replace(plan, ranks=tuple(ranks))


def _plan_step(seq_lens: Sequence[int], config: PlannerConfig, cost: CostModel) -> Plan:
    t0 = time.perf_counter()
    config.check()
    lens = check_lengths(seq_lens)
    balanced = config.balance != "none"
    placer = (  # under EP rings go on whole EP groups (expert_slots.py)
        GroupPlacer(config.num_ranks, config.ranks_per_node, config.expert_parallel)
        if config.expert_parallel > 1
        else RingPlacer(config.num_ranks, config.ranks_per_node)
    )
    # pinned host memory per GPU, shared by the micro-batches a 1F1B stage holds in flight
    host = host_capacity(cost, config.pipeline_stages)
    # The target is a bound, not a promise: rigid rings with little short work to fill the
    # gaps between them may not pack under it. Then a few rescaled targets are tried (a
    # larger one frees ranks, a smaller one cuts work finer) and the shortest step wins.
    # With pipelines (PP-balance) the candidates are estimated in full, 1F1B bubbles
    # included (``_pipeline_candidates``).
    stages = config.pipeline_stages
    # the estimate per rank, where the candidates' search already made it, and the chunk orders
    # it evaluated (rank_estimates' ``known``)
    finish, known = None, {}
    if balanced and stages > 1:
        rings, target, units, assignment, scale, ordered, finish, known = _pipeline_candidates(
            lens, config, cost, placer
        )
    else:
        factors = sorted({1, stages}) if balanced else [1]
        best = None
        # under EP the units' times count their all-to-alls and the target does not: the
        # average rank's are allowed on top of it before another target is tried
        allowance = ep_all_to_all_time(
            cost, float(sum(lens)) / config.num_ranks, config.expert_parallel, placer.ranks_per_node
        )
        shorts = None if config.balance == "none" else _short_units(lens, config, cost, placer.ranks_per_node)
        memo = _UnitMemo()  # what the targets share of their units
        # under EP rings are rounded up to whole EP groups (expert_slots.py)
        on_groups = (
            round_rings_to_groups(config.expert_parallel, config.num_ranks) if config.expert_parallel > 1 else None
        )
        lengths = lengths_array(lens)
        for factor in factors:
            sizer = _ring_sizer(config, cost, factor, host)
            base = balanced_target(lengths, sizer) if balanced else None
            for scale in RETARGET if balanced else (1.0,):
                target = None if base is None else base * scale
                rings = ring_decisions(lengths, sizer, target, on_groups)
                units, columns = _units(lens, rings, config, cost, placer.ranks_per_node, shorts, memo)
                mode = config.balance if balanced else "tokens"
                # a schedule whose largest key passes the best step so far cannot be chosen:
                # it stops there (its key never falls as units are given out)
                limit = best[0] if best is not None else float("inf")
                assignment = schedule(units, placer, mode, config.slack, stages, give_up_above=limit, columns=columns)
                if assignment is None:
                    continue
                step = float(assignment.key.max())
                if best is None or step < best[0]:
                    best = (step, rings, target, units, assignment, scale)
                if base is None or step <= (1 + config.slack) * base + allowance:
                    break
        _, rings, target, units, assignment, scale = best
        ordered = _order(lens, units, assignment, config, cost, placer)
    if ordered.deadlock:
        raise PlanError(
            f"no 1F1B order without deadlock found for {stages} pipeline stages: {len(ordered.unaligned)} ring "
            f"micro-batches could not take one slot on all their members ({ordered.deadlock}); the batch has too "
            "little short work to fill the gaps: add short sequences, use fewer pipeline stages, or raise the capacity"
        )
    ring_time = {u: units[u].time for u in assignment.members}
    ranks = _build(lens, units, ordered.members or assignment.members, ordered.runs, placer.ranks_per_node, cost)
    if finish is None:
        finish = rank_estimates(ordered, stages, ring_time, cost.forward_share, config.virtual_stages, known)
    est = np.array(finish)
    stage_orders, one_f_one_b_est, notes, found_cap = None, float(est.max()) if est.size else 0.0, [], None
    chunks = config.virtual_stages
    if stages > 1 and chunks > 1:
        # With virtual stages the slot alignment (slot_alignment.py, made for 1F1B) does not
        # keep the default interleaved order free of deadlock, so chunk orders are always
        # chosen (stage_schedule.chunk_schedule): the default and slot-aligned interleaved
        # orders (at most Megatron's p V + p - 1 chunk forwards in flight) and the list
        # schedule over chunk ops (p V first: the activations of 1F1B's p micro-batches, what
        # capacity, offload ratios and the host budget are sized for); the shortest safe one.
        keys, times = run_lists(*ordered_item_arrays(ordered, ring_time))
        chosen = chunk_schedule(keys, times, stages, cost.forward_share, chunks, known)
        if chosen is None:
            raise PlanError(
                f"no deadlock-free order of {chunks} model chunks over {stages} pipeline stages found for this batch; "
                "use --vpp 1 or fewer pipeline stages"
            )
        orders, finish, found_cap, what = chosen
        est = np.array(finish)
        if orders is not None:
            stage_orders = (
                orders.codes(chunks) if isinstance(orders, ArrayOrders) else encode_stage_orders(orders, chunks)
            )
        notes.append(f"chunk orders: {what}")
    elif stages > 1 and config.pipeline_schedule == "search":
        found = _search_stage_orders(ordered, stages, ring_time, cost)
        if found is not None:
            stage_orders, est = encode_stage_orders(found.orders), np.array(found.finish)
        notes.append(
            "searched stage orders: "
            + (
                f"kept ({found.makespan:.4g} s against 1F1B's {one_f_one_b_est:.4g} s)"
                if found
                else "none shorter than 1F1B"
            )
        )

    plan = Plan(
        num_ranks=config.num_ranks,
        capacity=config.capacity,
        num_layers=cost.num_layers,
        seq_lens=tuple(lens),  # a plain tuple: plans travel between processes
        ranks=ranks,
        host_capacity=host,
        recomputed_layers=cost.recomputed_layers,
        stage_orders=stage_orders,
        virtual_stages=config.virtual_stages,
    )
    if config.expert_parallel > 1:  # aligned slots: an EP group's slot waits for its slowest member
        # and local slots moved into the waits before rings, where that is shorter
        plan, finish = fill_ring_waits(align_expert_slots(plan, config.expert_parallel), cost, placer.ranks_per_node)
        est = np.array(finish)
    ring_hist = Counter(rings.ring_size.tolist())
    plan.meta = {
        **plan.meta,  # expert_slots' counts
        "strategy": "hdp-balanced" if balanced else "hdp-naive",
        "balance": config.balance,
        "offload": config.offload,
        "ranks_per_node": placer.ranks_per_node,
        "pipeline_stages": config.pipeline_stages,
        "slack": config.slack,
        "buckets": assignment.num_buckets,
        "target_time_s": target,  # the step time rings were sized for (None: memory floor)
        "target_scale": scale,  # 1 unless a rescaled target packed better
        "compute_bound_s": _compute_bound(lens, cost, config.num_ranks),
        "est_time_max_s": float(est.max()),
        "est_time_mean_s": float(est.mean()),
        "est_rank_time_s": est.tolist(),
        "ring_sizes": {str(k): v for k, v in sorted(ring_hist.items())},
        "offloaded_sequences": int(np.count_nonzero(rings.ratio > 0)),
        # how making the order safe for 1F1B changed the schedule's (all 0 without pipelines)
        "pipeline_order": {
            "pulled": ordered.pulled,
            "deferred": ordered.deferred,
            "splits": ordered.splits,
            "moved": ordered.moved,
            "reordered_rings": ordered.reordered,
            "unaligned_rings": len(ordered.unaligned),
            "slot_search": ordered.searched,
            "rings_placed_again": ordered.members is not None,
        },
        # with pipeline_schedule="search": the 1F1B estimate the stage orders beat (if found)
        # (with virtual stages the base is the interleaved order; chunk_cap: the chunk forwards
        # a device may hold under the orders found, None for the interleaved order)
        "stage_orders": {
            "found": stage_orders is not None,
            "one_f_one_b_est_s": one_f_one_b_est,
            "chunk_cap": found_cap,
        },
        **({"notes": notes} if notes else {}),
        "plan_time_s": time.perf_counter() - t0,
    }
    return plan


def _order(
    lens,
    units,
    assignment: Assignment,
    config: PlannerConfig,
    cost: CostModel,
    placer: RingPlacer,
    fallback: bool = True,
    runs: list[list[Item]] | None = None,
    arrays: RunArrays | None = None,
) -> Ordered:
    """Rings start when their last member reaches them (a member is held until the slowest
    is done). With pipelines each ring also takes one slot on all its members
    (slot_alignment.py), else 1F1B could deadlock. ``runs``: ``_rank_items``' result, if
    made already (``arrays``: their ``run_arrays``, if made)."""
    return order_runs(
        _rank_items(lens, units, assignment, config.capacity, cost) if runs is None else runs,
        [u for u in assignment.order if u in assignment.members],
        assignment.members,
        {u: units[u].time for u in assignment.members},
        config.pipeline_stages,
        PackSplitter(lens, cost),
        placer.ranks_per_node,
        fallback=fallback,
        forward_share=cost.forward_share,
        arrays=arrays,
    )


def _search_stage_orders(ordered: Ordered, stages: int, ring_time: dict[int, float], cost: CostModel):
    """Per-stage orders shorter than 1F1B for the ordered runs (``stage_schedule``), or None."""
    keys, times = run_lists(*ordered_item_arrays(ordered, ring_time))
    return stage_schedule(keys, times, stages, cost.forward_share)


def _pipeline_candidates(lens, config: PlannerConfig, cost: CostModel, placer: RingPlacer):
    """PP-balance's ring sizes: the target that gives the shortest estimated pipelined step.

    A pipeline takes ``sum(stage times) + (p - 1) x max(stage time)`` (1F1B fill and drain,
    ``rank_estimates``). The sum hardly depends on ring sizes, the bubble falls with the
    longest share: larger rings than ``balanced_target`` (sized as if a share ran alone for
    p x its stage time) pay until their communication or the lack of short work to align
    them eats the gain, and not monotonically (which rings share ranks changes with the
    sizes). So the targets of ``PIPELINE_RETARGET`` below that one are scheduled, the best
    ``PIPELINE_ORDERED`` by the scheduler's bound are ordered for 1F1B and estimated in full
    (``rank_estimates``: the pipelines run together, as the simulator runs them), and the
    shortest deadlock-free estimate wins; targets that change no ring are skipped, and a
    schedule stops once its bound cannot be among the best (``_best_schedules``). Each
    candidate is ordered two ways (``_candidate_orders``): slot-aligned where the schedule
    placed its rings, and with its rings placed again at levels, which runs the long rings
    back to back and often wins (large rings over most ranks, little short work between them)."""
    stages = config.pipeline_stages
    candidates = _best_schedules(_pipeline_targets(lens, config, cost, placer), placer, config, stages)
    # Ordering for 1F1B is the slow part: only the candidates the scheduler's own bound
    # (sum + (p - 1) x max per rank) ranks best are ordered and estimated in full.
    best = None
    for _, rings, target, units, assignment, scale in candidates:
        ring_time = {u: units[u].time for u in assignment.members}
        for ordered in _candidate_orders(lens, units, assignment, config, cost, placer):
            known: dict = {}
            limit = float("inf") if best is None else best[0]  # only a shorter step is kept
            finish = (
                None
                if ordered.deadlock
                else rank_estimates(ordered, stages, ring_time, cost.forward_share, config.virtual_stages, known, limit)
            )
            step = float("inf") if finish is None or isinstance(finish, Longer) else max(finish, default=0.0)
            if best is None or step < best[0]:
                best = (step, rings, target, units, assignment, scale, ordered, finish, known)
    step, rings, target, units, assignment, scale, ordered, finish, known = best
    if ordered.deadlock:  # no candidate has a safe order of either kind: the searches of order_runs, on the first
        ordered, finish, known = _order(lens, units, assignment, config, cost, placer), None, {}
    return rings, target, units, assignment, scale, ordered, finish, known


def _candidate_orders(lens, units, assignment: Assignment, config: PlannerConfig, cost: CostModel, placer) -> list:
    """A PP-balance candidate's 1F1B orders: slot-aligned in schedule order (without the
    searches, ``order_runs``' ``fallback=False``: it may come back deadlocked), and, where
    that is safe, the rings placed again at levels (``order_by_level``): every ring on ranks
    that ran as many rings before it, the long rings back to back and the short work after
    them. Neither wins everywhere (the level order is 20% shorter on some interleaved
    pipelines, longer on others), so both are estimated."""
    runs = _rank_items(lens, units, assignment, config.capacity, cost)
    arrays = run_arrays(runs)  # read by both passes
    aligned = _order(lens, units, assignment, config, cost, placer, fallback=False, runs=runs, arrays=arrays)
    ring_order = [u for u in assignment.order if u in assignment.members]
    ring_time = {u: units[u].time for u in assignment.members}
    by_level = order_by_level(runs, ring_order, assignment.members, ring_time, placer.ranks_per_node, arrays)
    if by_level is None:
        return [aligned]
    by_level.unaligned = aligned.unaligned
    return [aligned, by_level]


def _ring_sizer(config: PlannerConfig, cost: CostModel, factor: int, host: int | None) -> RingSizer:
    """The config's ring sizer, rings sized as if a share ran ``factor`` x its stage time."""
    return RingSizer(
        config.capacity,
        cost,
        config.offload,
        config.num_ranks,
        config.ranks_per_node,
        factor,
        host,
        config.capacity_flag,
    )


def _pipeline_targets(lens, config: PlannerConfig, cost: CostModel, placer: RingPlacer) -> list[tuple]:
    """(position in ``PIPELINE_RETARGET``, target, its ``RingDecisions``, units, their
    ``UnitColumns``) of each target scale that changes some ring from the scale before it."""
    stages = config.pipeline_stages
    sizer = _ring_sizer(config, cost, stages, host_capacity(cost, stages))
    lengths = lengths_array(lens)
    base = balanced_target(lengths, sizer)
    targets, previous = [], None
    shorts = _short_units(lens, config, cost, placer.ranks_per_node)  # the same for every target
    memo = _UnitMemo()  # what the targets share of their units
    for position, scale in enumerate(PIPELINE_RETARGET):
        target = base * scale
        rings = ring_decisions(lengths, sizer, target)
        if rings.same_rings(previous):
            continue
        previous = rings
        units, columns = _units(lens, rings, config, cost, placer.ranks_per_node, shorts, memo)
        targets.append((position, target, rings, units, columns))
    return targets


def _best_schedules(targets: list, placer: RingPlacer, config: PlannerConfig, stages: int) -> list[tuple]:
    """The ``PIPELINE_ORDERED`` targets whose schedules have the smallest bound (the largest
    key; ties to the earlier target of ``PIPELINE_RETARGET``), best first, as (key, rings,
    target, units, assignment, scale). ``targets``: (position, target, rings, units, columns).

    A schedule's largest key never falls as units are given out, so once it passes the
    ``PIPELINE_ORDERED``-th smallest bound of the schedules made so far the target cannot
    be among the best: its schedule stops there (``schedule``'s ``give_up_above``). The
    targets go nearest to the best so far first (from the middle: the bound is about
    unimodal in the scale), so that good bounds stop the others early; the result does not
    depend on the order (at 512M tokens about half the scheduling time is saved)."""
    done: list[tuple] = []  # (key, position, index into targets, assignment)
    left = list(range(len(targets)))
    best = len(targets) // 2
    while left:
        i = min(left, key=lambda j: (abs(j - best), -j))  # ties: the smaller scale
        left.remove(i)
        position, target, rings, units, columns = targets[i]
        limit = sorted(d[0] for d in done)[PIPELINE_ORDERED - 1] if len(done) >= PIPELINE_ORDERED else float("inf")
        assignment = schedule(units, placer, config.balance, config.slack, stages, give_up_above=limit, columns=columns)
        if assignment is None:
            continue
        done.append((float(assignment.key.max()), position, i, assignment))
        if min(done)[2] == i:
            best = i
    out = []
    for key, position, i, assignment in sorted(done)[:PIPELINE_ORDERED]:
        _, target, rings, units, _ = targets[i]
        out.append((key, rings, target, units, assignment, PIPELINE_RETARGET[position]))
    return out


def _compute_bound(lens, cost: CostModel, num_ranks: int) -> float:
    """Seconds if all FLOPs of the batch were spread perfectly over all ranks."""
    s = lengths_array(lens).astype(np.float64)
    return float(cost.num_layers * np.sum(cost.a1 * s * s + cost.b1 * s)) / num_ranks


# ----------------------------------------------------------------------------- units
class _UnitMemo:
    """What the candidate targets of one step share: the long units by (sequence, ring size,
    ratio, two-level group), which is all a long unit depends on within a step (most of a
    step's rings keep their size from one target to the next: a 512M-token step's targets
    hold ~6 x 10^4 rings, ~8 x 10^3 of them different), and the short units' columns. Units
    are not changed once made, except hdp-naive's, whose packs fill their rings: those are
    made fresh (``_units``)."""

    def __init__(self):
        self.units: dict[tuple, Unit] = {}
        self.short_columns: UnitColumns | None = None  # the short units' (``_units``)


def _units(
    lens,
    rings: RingDecisions,
    config: PlannerConfig,
    cost: CostModel,
    ranks_per_node: int,
    shorts: list[Unit] | None = None,
    memo: _UnitMemo | None = None,
) -> tuple[list[Unit], UnitColumns]:
    """The long sequences' units for their ``rings``, then the short sequences' (``shorts``: the
    ones ``_short_units`` made, shared by candidates that only resize rings; ``memo``: what
    they share of the long ones), and their ``UnitColumns``: the long units' from the rings'
    arrays, the short units' read once per step (``memo``)."""
    if config.balance == "none":
        units, _ = _long_units(rings, cost, ranks_per_node)
        short_ids = np.flatnonzero(lengths_array(lens) <= config.capacity).tolist()
        units += _naive_packs(units, short_ids, lens, config.capacity, cost, ranks_per_node)
        return units, UnitColumns.of(units)
    a2a = None
    if config.expert_parallel > 1:
        # every micro-batch also runs the MoE all-to-alls: counted so that the scheduler evens
        # them out too (a rank of many short sequences sends more tokens than one of a ring share)
        def a2a(tokens):
            return ep_all_to_all_time(cost, tokens, config.expert_parallel, ranks_per_node)

    memo = _UnitMemo() if memo is None else memo
    units, columns = _long_units(rings, cost, ranks_per_node, memo, a2a)
    if shorts is None:
        shorts = _short_units(lens, config, cost, ranks_per_node)
    if memo.short_columns is None:
        memo.short_columns = UnitColumns.of(shorts)
    return units + shorts, columns.join(memo.short_columns)


def _short_units(lens, config: PlannerConfig, cost: CostModel, ranks_per_node: int) -> list[Unit]:
    """One unit per short sequence (at most ``capacity`` tokens), in sequence order. They do
    not depend on the ring sizes, and nothing changes them once made."""
    arr = lengths_array(lens)
    short = np.flatnonzero(arr <= config.capacity)
    # a short sequence's share of its micro-batch's fixed cost g, before packing decides it
    tokens = arr[short]
    s = tokens.astype(np.float64)
    times = cost.num_layers * (cost.a1 * s * s + cost.b1 * s + cost.g * s / config.capacity)
    if config.expert_parallel > 1:
        # a short sequence's share of its micro-batch's all-to-alls: its tokens, the latency pro rata
        times = times + ep_all_to_all_time(cost, s, config.expert_parallel, ranks_per_node, s / config.capacity)
    return [Unit("short", (i,), 1, t, n) for i, t, n in zip(short.tolist(), times.tolist(), tokens.tolist())]


def _long_columns(rings: RingDecisions, cost: CostModel, ranks_per_node: int, a2a=None) -> UnitColumns:
    """The ``UnitColumns`` of ``rings``' long units, from the arrays: a sequence on one rank
    takes its layers' time whole, a ring member its share's (``ring_share_time``, or
    ``two_level.share_times`` in two-level groups), all elementwise, the same floats a unit
    made alone gets; ``a2a``'s seconds (EP) added to each."""
    s, size, split = rings.seq_lens, rings.ring_size, rings.heads_split
    time = np.empty(s.size)
    tokens = np.where(size == 1, s, -(-s // np.maximum(size, 1)))
    one = size == 1
    time[one] = cost.num_layers * cost.layer_time(s[one])
    plain = ~one & (split <= 1)
    for inter_node in (False, True):
        at = np.flatnonzero(plain & ((size > ranks_per_node) == inter_node))
        time[at] = ring_share_time(cost, s[at], size[at], inter_node)
    # two-level rings (head all-to-all in each node, ring across nodes): per group size
    for u in np.unique(split[~one & (split > 1)]).tolist():
        at = np.flatnonzero(~one & (split == u))
        time[at] = two_level.share_times(cost, s[at], size[at], u, ranks_per_node)
    if a2a is not None:
        time += a2a(tokens)
    return UnitColumns(time, tokens.astype(np.float64), rings.seq_ids, size, np.where(one, 1, split))


def _long_units(
    rings: RingDecisions,
    cost: CostModel,
    ranks_per_node: int,
    memo: _UnitMemo | None = None,
    a2a=None,
) -> tuple[list[Unit], UnitColumns]:
    """A unit per long sequence of ``rings``, made once per step where ``memo`` is shared
    (``_UnitMemo``), and their columns (``_long_columns``, whose seconds the new units take).
    ``a2a``: a function of tokens (elementwise on arrays) giving the seconds they add (EP's
    all-to-alls), or None."""
    made = (_UnitMemo() if memo is None else memo).units
    columns = _long_columns(rings, cost, ranks_per_node, a2a)
    keys = list(zip(*(c.tolist() for c in (rings.seq_ids, rings.ring_size, rings.ratio, rings.heads_split))))
    missing = [i for i, key in enumerate(keys) if key not in made]
    if missing:
        times = columns.time[missing].tolist()
        tokens = columns.tokens[missing].astype(np.int64).tolist()
        for i, t, n in zip(missing, times, tokens):
            key = keys[i]
            sid, size, ratio, split = key
            if size == 1:
                made[key] = Unit("long", (sid,), 1, t, n, ratio)
            else:
                made[key] = Unit("ring", (sid,), size, t, n, ratio, heads_split=split)
    return [made[key] for key in keys], columns


def _naive_packs(
    long_units: list[Unit], short_ids: list[int], lens, capacity: int, cost: CostModel, ranks_per_node: int
) -> list[Unit]:
    """hdp-naive: short sequences best-fit into ring spare room (rings that do not offload),
    the rest best-fit into fresh micro-batches. Fills ``fillers`` of the ring units in place."""
    slots = []  # (unit index, slot, spare tokens)
    for k, u in enumerate(long_units):
        if u.kind == "ring" and u.ratio == 0.0:
            s = lens[u.seq_ids[0]]
            for i in range(u.ring_size):
                spare = capacity - rank_tokens(s, u.ring_size, i)
                if spare > 0:
                    slots.append((k, i, spare))
    added, left = fill_ring_spare([sp for _, _, sp in slots], [(i, lens[i]) for i in short_ids])
    by_unit: dict[int, dict[int, list[int]]] = {}
    for (k, i, _), extra in zip(slots, added):
        if extra:
            by_unit.setdefault(k, {})[i] = extra
    for k, extra in by_unit.items():
        u = long_units[k]
        s = lens[u.seq_ids[0]]
        n = u.ring_size
        fillers, local_pairs, tokens = [], [], []
        pairs_share = s * s / n
        block = rank_tokens(s, n, 0)
        exposed = exposed_ring_time(cost, pairs_share, block, n, n > ranks_per_node)
        for i in range(n):
            f = tuple(extra.get(i, ()))
            fillers.append(f)
            tokens.append(rank_tokens(s, n, i) + sum(lens[j] for j in f))
            local_pairs.append(sum(lens[j] ** 2 for j in f))
        # the ring runs in lockstep: each layer waits for the member with the most linear
        # work, then for the one with the most packed attention (ring step 0), so its time
        # takes the two maxima, which may be different members (as sim.timeline runs it)
        u.fillers, u.tokens = tuple(fillers), max(tokens)
        u.time = cost.num_layers * (cost.layer_time(max(tokens), pairs_share + max(local_pairs)) + exposed)
    packs = [tuple(b) for b in pack_best_fit([(i, lens[i]) for i, _ in left], capacity)]
    # num_layers * layer_time(tokens, sum of squares) of every pack at once (the same figures)
    return [Unit("pack", b, 1, t, sum(lens[i] for i in b)) for b, t in zip(packs, _pack_times(lens, packs, cost))]


# --------------------------------------------------------------------- micro-batches
def _rank_items(lens, units: list[Unit], assignment: Assignment, capacity: int, cost: CostModel) -> list[list[Item]]:
    """Each rank's work in run order: ring unit indices and local micro-batches.

    Short sequences are packed best-fit within each stretch between two of the rank's ring
    or long micro-batches, so the rank still reaches each ring when the schedule expects."""
    kernel = compiled.stretch_packs()
    if kernel is not None:  # the same walk compiled: the same items
        return _rank_items_compiled(kernel, lens, units, assignment, capacity, cost)
    # the local micro-batches are timed all at once at the end (one vectorised layer_time)
    packed: list[tuple[int, ...]] = []  # their sequences
    where: list[tuple[list, int]] = []  # their place: (a rank's items, index)

    def pack(stretch: list[int], tokens: int, items: list) -> None:
        if len(stretch) > 1 and tokens > capacity:
            bins = pack_best_fit([(i, lens[i]) for i in stretch], capacity)
        else:
            bins = [stretch]
        for b in bins:
            packed.append(tuple(b))
            where.append((items, len(items)))
            items.append(None)

    out = []
    for run in assignment.runs:
        items: list[Item] = []
        stretch: list[int] = []
        tokens = 0
        for u in run:
            unit = units[u]
            if unit.kind == "short":
                sid = unit.seq_ids[0]
                stretch.append(sid)
                tokens += lens[sid]
                continue
            if stretch:
                pack(stretch, tokens, items)
                stretch, tokens = [], 0
            if unit.kind == "ring":
                items.append(u)
            else:  # a long sequence alone, or an hdp-naive pack
                items.append(LocalBatch(unit.seq_ids, unit.ratio, unit.time))
        if stretch:
            pack(stretch, tokens, items)
        out.append(items)
    for (items, k), b, t in zip(where, packed, _pack_times(lens, packed, cost)):
        items[k] = LocalBatch(b, 0.0, t)
    return out


def _rank_items_compiled(
    kernel, lens, units: list[Unit], assignment: Assignment, capacity: int, cost: CostModel
) -> list[list[Item]]:
    """``_rank_items`` with the walk and the packing in ``compiled.stretch_packs``."""
    n = len(units)
    kind = np.fromiter(map(_KIND_CODES.get, map(_kind_of, units), repeat(2, n)), dtype=np.int8, count=n)
    seq = np.fromiter(map(itemgetter(0), map(_seq_ids_of, units)), dtype=np.int64, count=n)
    runs = assignment.runs
    bounds = np.zeros(len(runs) + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, runs), dtype=np.int64, count=len(runs)), out=bounds[1:])
    flat = np.fromiter(chain.from_iterable(runs), dtype=np.int64, count=int(bounds[-1]))
    lens_array = lengths_array(lens)
    codes, item_bounds, pack_seq, pack_ends = kernel(flat, bounds, kind, seq, lens_array, capacity)
    starts = np.concatenate((np.zeros(1, dtype=np.int64), pack_ends))[:-1]
    seqs = pack_seq.tolist()
    packs = [
        LocalBatch(tuple(seqs[a:b]), 0.0, t)
        for a, b, t in zip(starts.tolist(), pack_ends.tolist(), _segment_times(lens_array, pack_seq, starts, cost))
    ]
    # every item by its code shifted by the number of packs: packs (last first), then units
    # (a ring: its index; a local unit, on one rank only: its micro-batch)
    lookup = packs[::-1] + list(range(n))
    for u in np.flatnonzero(kind == 2).tolist():
        unit = units[u]
        lookup[len(packs) + u] = LocalBatch(unit.seq_ids, unit.ratio, unit.time)
    items = list(map(lookup.__getitem__, (codes + len(packs)).tolist()))
    return [items[a:b] for a, b in pairwise(item_bounds.tolist())]


_KIND_CODES = {"short": 0, "ring": 1}  # anything else: 2, a local micro-batch of its own
_kind_of = attrgetter("kind")
_seq_ids_of = attrgetter("seq_ids")


def _segment_times(lens: np.ndarray, flat: np.ndarray, first: np.ndarray, cost: CostModel) -> list[float]:
    """Seconds (all layers) of packs of whole sequences given end to end (``flat``, each pack
    from its ``first`` index on; none empty): ``_pack_times``' arithmetic."""
    if not first.size:
        return []
    s = lens[flat]
    tokens = np.add.reduceat(s, first)  # whole numbers: exact
    pairs = np.add.reduceat(s * s, first)
    return (cost.num_layers * cost.layer_time(tokens, pairs)).tolist()


def _pack_times(lens, packs: list[tuple[int, ...]], cost: CostModel) -> list[float]:
    """Seconds (all layers) of each pack of whole sequences: ``num_layers * _pack_time``,
    the same figures, computed for all packs at once."""
    if not packs:
        return []
    sizes = np.fromiter((len(b) for b in packs), dtype=np.int64, count=len(packs))
    flat = np.fromiter((i for b in packs for i in b), dtype=np.int64, count=int(sizes.sum()))
    first = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    return _segment_times(lengths_array(lens), flat, first, cost)


def _build(
    lens,
    units: list[Unit],
    members: dict[int, tuple[int, ...]],
    runs: list[list[Item]],
    ranks_per_node: int = 1,
    cost: CostModel | None = None,
) -> tuple:
    """The plan's micro-batches from each rank's ordered items (a two-level ring keeps the
    group size its placement allows: ``two_level.realized_split``)."""
    pieces_of: dict[int, dict[int, Piece]] = {}  # rings with whole sequences beside their shares
    ring_mbs: dict[int, dict[int, MicroBatch]] = {}  # the others: each member's micro-batch
    new = object.__new__  # ``_piece`` and ``micro_batch`` inlined: ~3.5 x 10^4 ring members a step
    for u, ring in members.items():
        unit = units[u]
        sid = unit.seq_ids[0]
        split = two_level.realized_split(ring, unit.heads_split, ranks_per_node, cost) if cost is not None else 1
        if unit.fillers:
            pieces_of[u] = dict(zip(ring, ring_pieces(sid, lens[sid], ring, heads_split=split)))
            continue
        s = lens[sid]
        ring_t = tuple(ring)
        ratio = unit.ratio
        key = (ring_t, (sid,))  # MicroBatch.ring_key, one tuple for all members
        per_member = {}
        for r, share in zip(ring, zigzag_ranges(s, len(ring))):  # what ``ring_pieces`` gives, in ring order
            piece = new(Piece)
            d = piece.__dict__
            d["seq_id"] = sid
            d["seq_len"] = s
            d["ranges"] = share
            d["ring"] = ring_t
            d["heads_split"] = split
            mb = new(MicroBatch)
            d = mb.__dict__
            d["pieces"] = (piece,)
            d["offload_ratio"] = ratio
            d["ring_key"] = key
            per_member[r] = mb
        ring_mbs[u] = per_member
    ranges_of: dict[int, tuple] = {}  # shared by the whole pieces of one length
    ranks = []
    for rank, items in enumerate(runs):
        mbs = []
        one = (rank,)
        for x in items:
            if type(x) is LocalBatch:
                mb = new(MicroBatch)
                d = mb.__dict__
                d["pieces"] = whole_pieces(x.seq_ids, lens, one, ranges_of)
                d["offload_ratio"] = x.ratio
                mbs.append(mb)
                continue
            member = ring_mbs.get(x)
            if member is not None:
                mbs.append(member[rank])
                continue
            unit = units[x]
            slot = members[x].index(rank)
            mbs.append(
                micro_batch((pieces_of[x][rank],) + whole_pieces(unit.fillers[slot], lens, one, ranges_of), unit.ratio)
            )
        ranks.append(tuple(mbs))
    return tuple(ranks)
