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
its members, so that 1F1B cannot deadlock (``order/``): members run some of their local
micro-batches before or after a ring instead, or split a pack, and only if they have none
left take one from another rank. A batch with too little short work to fill the slots may
get its rings reordered, or placed again (``meta["pipeline_order"]`` says which). With
``pipeline_schedule="search"`` the planner also looks for per-stage orders other than 1F1B
(``order.stage_schedule``) and keeps them in the plan (``Plan.stage_orders``) when their
estimated step is shorter. What the planner tries for a step, and how it picks: ``search``.

The package by concern: ``sizing/`` (ring sizes, offload ratios, two-level groups, packing),
``balance/`` (the balance scheduler), ``order/`` (rank items, ring slots, pipeline orders and
their estimates), ``expert/`` (EP slots); shared: ``cost_model``, ``placement``, ``units``,
``build``, ``estimate``, ``jit`` (the kernels' compile helper).
"""

from __future__ import annotations

import gc
import time
from collections import Counter
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import replace

import numpy as np

from ..errors import ConfigError
from . import jit
from .build import build_ranks
from .config import PIPELINE_SCHEDULES, PlannerConfig
from .contract import Plan, encode_stage_orders
from .cost_model import CostModel
from .expert.fill import fill_ring_waits
from .expert.pipelines import align_pipelined_slots, pipelined_slot_finish_times
from .expert.slots import align_expert_slots
from .fields import FieldPlanError
from .lengths import Lengths, lengths_array
from .order.runs import ordered_item_arrays, run_lists
from .order.slots import rank_estimates
from .order.stage_schedule import chunk_schedule, stage_schedule
from .order.walk import ArrayOrders
from .placement import Ranks
from .search import Found, search
from .sizing.offload import host_capacity

__all__ = ["PIPELINE_SCHEDULES", "PlannerConfig", "check_lengths", "plan_step"]


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
    """Pause the cyclic garbage collector: a large plan allocates many pieces and
    micro-batches (no reference cycles), and the collections they trigger would walk every
    live object again and again."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            if gc.get_freeze_count() == 0:
                # the objects made while paused would all sit in the youngest generation,
                # and the first allocation after ``enable`` would walk every one of them;
                # freeze + unfreeze moves them to the oldest generation untouched (no cycles
                # to find among them; a full collection still sees them). Skipped when the
                # caller froze objects of its own.
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
    t0, compiling = time.perf_counter(), jit.compile_seconds()
    config.check()
    lens = check_lengths(seq_lens)
    ranks = Ranks.of(config.num_ranks, config.ranks_per_node, config.expert_parallel)
    # pinned host memory per GPU, shared by the micro-batches a 1F1B stage holds in flight
    host = host_capacity(cost, config.pipeline_stages)
    found = search(lens, config, cost, ranks, host)
    ordered, units, assignment, stages = found.ordered, found.units, found.assignment, config.pipeline_stages
    if ordered.deadlock:
        raise FieldPlanError(
            f"no 1F1B order without deadlock found for {stages} pipeline stages: {len(ordered.unaligned)} ring "
            f"micro-batches could not take one slot on all their members ({ordered.deadlock}); the batch has too "
            "little short work to fill the gaps: add short sequences, lower {pipeline_stages}, or raise {capacity}"
        )
    ring_time = {u: units[u].time for u in assignment.members}
    mbs = build_ranks(lens, units, ordered.members or assignment.members, ordered.runs, ranks.ranks_per_node, cost)
    finish = found.finish
    if finish is None:
        finish = rank_estimates(ordered, stages, ring_time, cost.forward_share, config.virtual_stages, found.known)
    one_f_one_b = max(finish, default=0.0)
    ep_pipelines = config.expert_parallel > 1 and stages > 1
    if ep_pipelines:  # EP members run the same default order: no stage orders (expert/pipelines.py)
        stage_orders, found_cap, notes = None, None, []
    else:
        stage_orders, finish, found_cap, notes = _stage_orders(ordered, ring_time, finish, config, cost, found.known)
    plan = Plan(
        num_ranks=config.num_ranks,
        capacity=config.capacity,
        num_layers=cost.num_layers,
        seq_lens=tuple(lens),  # a plain tuple: plans travel between processes
        ranks=mbs,
        host_capacity=host,
        recomputed_layers=cost.recomputed_layers,
        stage_orders=stage_orders,
        virtual_stages=config.virtual_stages,
    )
    if ep_pipelines:  # one slot numbering over all pipelines; EP groups in lock-step at every stage
        plan = align_pipelined_slots(plan, config.expert_parallel)
        finish = pipelined_slot_finish_times(plan, stages, cost, ranks.ranks_per_node)
    elif config.expert_parallel > 1:  # aligned slots: an EP group's slot waits for its slowest member
        # and local slots moved into the waits before rings, where that is shorter
        plan, finish = fill_ring_waits(align_expert_slots(plan, config.expert_parallel), cost, ranks.ranks_per_node)
    plan.meta = {
        **plan.meta,  # expert slots' counts
        **_meta(lens, config, cost, ranks, found, np.array(finish), stage_orders, one_f_one_b, found_cap, notes),
    }
    # the planning time without compiling kernels (once per environment and machine: not planning)
    compile_s = jit.compile_seconds() - compiling
    plan.meta.update(compile_s=compile_s, plan_time_s=time.perf_counter() - t0 - compile_s)
    return plan


def _stage_orders(ordered, ring_time: dict, finish, config: PlannerConfig, cost: CostModel, known: dict):
    """The orders the plan keeps besides the default ones: with virtual stages always chunk
    orders (``chunk_schedule``: the slot alignment, made for 1F1B, does not keep the default
    interleaved order free of deadlock), with ``pipeline_schedule="search"`` stage orders where
    shorter than 1F1B. Returns their codes (None: the defaults), the estimate per rank under
    them, the chunk forwards a device may hold (None: the default order's) and notes."""
    stages, chunks = config.pipeline_stages, config.virtual_stages
    if stages > 1 and chunks > 1:
        # the default and slot-aligned interleaved orders (at most Megatron's p V + p - 1 chunk
        # forwards in flight) and the list schedule over chunk ops (p V first: the activations of
        # 1F1B's p micro-batches, what capacity, offload ratios and the host budget are sized
        # for); the shortest safe one
        keys, times = run_lists(*ordered_item_arrays(ordered, ring_time))
        chosen = chunk_schedule(keys, times, stages, cost.forward_share, chunks, known)
        if chosen is None:
            raise FieldPlanError(
                f"no deadlock-free order of {chunks} model chunks over {stages} pipeline stages found for this "
                "batch; set {virtual_stages} to 1 or lower {pipeline_stages}"
            )
        orders, finish, found_cap, what = chosen
        codes = None
        if orders is not None:
            codes = orders.codes(chunks) if isinstance(orders, ArrayOrders) else encode_stage_orders(orders, chunks)
        return codes, finish, found_cap, [f"chunk orders: {what}"]
    if stages > 1 and config.pipeline_schedule == "search":
        keys, times = run_lists(*ordered_item_arrays(ordered, ring_time))
        found = stage_schedule(keys, times, stages, cost.forward_share)
        one_f_one_b = max(finish, default=0.0)
        if found is None:
            return None, finish, None, ["searched stage orders: none shorter than 1F1B"]
        note = f"searched stage orders: kept ({found.makespan:.4g} s against 1F1B's {one_f_one_b:.4g} s)"
        return encode_stage_orders(found.orders), found.finish, None, [note]
    return None, finish, None, []


def _meta(
    lens, config: PlannerConfig, cost: CostModel, ranks: Ranks, found: Found, est, orders, one_f_one_b, cap, notes
) -> dict:
    """The plan's figures (``Plan.meta``)."""
    ordered, rings = found.ordered, found.rings
    return {
        "strategy": "hdp-balanced" if config.balance != "none" else "hdp-naive",
        "balance": config.balance,
        "offload": config.offload,
        "ranks_per_node": ranks.ranks_per_node,
        "pipeline_stages": config.pipeline_stages,
        "slack": config.slack,
        "buckets": found.assignment.num_buckets,
        "target_time_s": found.target,  # the step time rings were sized for (None: memory floor)
        "target_scale": found.scale,  # 1 unless a rescaled target packed better
        "compute_bound_s": cost.compute_bound(lengths_array(lens), config.num_ranks),
        "est_time_max_s": float(est.max()),
        "est_time_mean_s": float(est.mean()),
        "est_rank_time_s": est.tolist(),
        "ring_sizes": {str(k): v for k, v in sorted(Counter(rings.ring_size.tolist()).items())},
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
        "stage_orders": {"found": orders is not None, "one_f_one_b_est_s": one_f_one_b, "chunk_cap": cap},
        **({"notes": notes} if notes else {}),
    }
