"""What the planner tries for a step, and how it picks (``search``), with what each kind earns
on the simulator's headline batches (dense, PP, VPP and EP configurations, Byted-like and
GitHub-like; ``benchmarks/bench_candidates.py`` leaves each out in turn, docs/results.md has
the figures). A kind that wins none of those batches stays only where leaving it out changes a
plan the tests or ``benchmarks/plan_digests.py`` record, which is where it wins.

1. Ring sizes without pipelines (and hdp-naive's): the balanced target
   (``sizing.rings.balanced_target``) times each scale of ``RETARGET`` in turn, until a
   schedule stays within ``1 + slack`` of the target (plus EP's all-to-alls). Picked: the
   smallest scheduler bound (a rank's largest key). The target itself wins half the dense
   model's batches, by several per cent of the total, and a third of the EP model's (where
   leaving it out is about as short in total); the smaller scales win a few dense batches, by
   a fraction of a per cent; the larger ones win none there (they free ranks where rigid rings
   do not pack, as in some of the tests' batches).
2. Ring sizes with pipelines: the target times each scale of ``PIPELINE_RETARGET`` that
   changes some ring, scheduled; the ``PIPELINE_ORDERED`` smallest bounds go on, each in each
   1F1B order of ``ORDERS``: slot-aligned in schedule order (``order.aligned``) and the rings
   placed again at levels (``order.levels``). Picked: the shortest estimated pipelined step
   (``order.slots.rank_estimates``). Each scale from 0.5 to 0.09 wins some batches, by about a
   per cent at most; the target itself, 0.7 and 0.06 win none there. Ordering the second to
   fourth smallest bounds gains up to about five per cent with virtual stages, one with 1F1B
   alone; the aligned order wins most batches, by a few per cent, the level order some, by
   under one.
3. Where every candidate of 2 deadlocks: ``order.slots.order_runs``' searches on the best
   schedule (``order.slots.FALLBACKS``: the aligned pass's order where 1F1B runs through it
   anyway, slots from the ring structure in two ring orders, the level order). Picked: the
   shortest safe one. No headline batch needs them; each makes some test's batch safe.
4. Chunk orders with virtual stages (``order.stage_schedule.chunk_schedule``): the default
   interleaved order, the slot-aligned ones (the greedy run's, Megatron's with its shifts),
   the list schedule. Picked: the shortest safe one. The interleaved order is kept on every
   headline batch (the others tie at best); the others keep the orders safe, and the list
   schedule finds one, where the interleaved order deadlocks.
5. Stage orders with ``pipeline_schedule="search"`` (``order.stage_schedule.stage_schedule``):
   the list schedule, kept where shorter than 1F1B. It finds none on the headline batches.

The target is a bound, not a promise: rigid rings with little short work to fill the gaps
between them may not pack under it, so rescaled targets are tried (a larger one frees ranks, a
smaller one cuts work finer). With pipelines a rank's 1F1B fill and drain grows with its
longest stage time, which larger rings shorten until their communication, or the lack of short
work to align them, eats the gain, and not monotonically; so the candidates are estimated in
full, the pipelines running together as the simulator runs them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .balance import Assignment, Unit, schedule
from .config import PlannerConfig
from .cost_model import CostModel
from .expert.slots import round_rings_to_groups
from .expert.timing import ep_all_to_all_time
from .lengths import lengths_array
from .order.items import rank_items
from .order.levels import order_by_level
from .order.runs import Item, Ordered, PackSplitter, RunArrays, run_arrays
from .order.slots import order_runs, rank_estimates
from .order.walk import Longer
from .placement import Ranks
from .sizing.rings import RingDecisions, RingSizer, balanced_target, ring_decisions
from .units import UnitMemo, make_units, short_units

RETARGET = (1.0, 1.1, 1.2, 0.85, 0.7, 1.5)  # target scales tried while the step overshoots the target
# With pipelines: target scales tried from the top down, and how many of them are ordered for
# 1F1B and estimated in full
PIPELINE_RETARGET = (1.0, 0.7, 0.5, 0.35, 0.25, 0.18, 0.13, 0.09, 0.06)
PIPELINE_ORDERED = 4
ORDERS = ("aligned", "by_level")  # each pipelined candidate's 1F1B orders


@dataclass
class Found:
    """The search's choice: its ring decisions, the target they were sized for (None: the
    memory floor) and its scale, the units, their assignment and 1F1B order, and where the
    search estimated it, the estimate per rank and the chunk orders it walked."""

    rings: RingDecisions
    target: float | None
    scale: float
    units: list[Unit]
    assignment: Assignment
    ordered: Ordered
    finish: list[float] | None = None
    known: dict = field(default_factory=dict)


def search(lens, config: PlannerConfig, cost: CostModel, ranks: Ranks, host: int | None) -> Found:
    """The step's ring sizes, assignment and order (the table of the module docstring)."""
    if config.balance != "none" and config.pipeline_stages > 1:
        return _pipelined(lens, config, cost, ranks, host)
    return _retargeted(lens, config, cost, ranks, host)


def _retargeted(lens, config: PlannerConfig, cost: CostModel, ranks: Ranks, host: int | None) -> Found:
    """Without pipelines (or hdp-naive): ``RETARGET``'s targets in turn, the smallest bound."""
    balanced = config.balance != "none"
    best = None
    # under EP the units' times count their all-to-alls and the target does not: the
    # average rank's are allowed on top of it before another target is tried
    allowance = ep_all_to_all_time(
        cost, float(sum(lens)) / config.num_ranks, config.expert_parallel, ranks.ranks_per_node
    )
    shorts = short_units(lens, config, cost, ranks.ranks_per_node) if balanced else None
    memo = UnitMemo()  # what the targets share of their units
    # under EP rings are rounded up to whole EP groups
    on_groups = round_rings_to_groups(config.expert_parallel, config.num_ranks) if config.expert_parallel > 1 else None
    lengths = lengths_array(lens)
    sizer = _ring_sizer(config, cost, 1, host)
    base = balanced_target(lengths, sizer) if balanced else None
    for scale in RETARGET if balanced else (1.0,):
        target = None if base is None else base * scale
        rings = ring_decisions(lengths, sizer, target, on_groups)
        units, columns = make_units(lens, rings, config, cost, ranks.ranks_per_node, shorts, memo)
        mode = config.balance if balanced else "tokens"
        # a schedule whose largest key passes the best step so far cannot be chosen: it stops
        # there (its key never falls as units are given out)
        limit = best[0] if best is not None else float("inf")
        assignment = schedule(
            units, ranks, mode, config.slack, config.pipeline_stages, give_up_above=limit, columns=columns
        )
        if assignment is None:
            continue
        step = float(assignment.key.max())
        if best is None or step < best[0]:
            best = (step, rings, target, units, assignment, scale)
        if base is None or step <= (1 + config.slack) * base + allowance:
            break
    _, rings, target, units, assignment, scale = best
    return Found(rings, target, scale, units, assignment, order(lens, units, assignment, config, cost, ranks))


def order(
    lens,
    units,
    assignment: Assignment,
    config: PlannerConfig,
    cost: CostModel,
    ranks: Ranks,
    fallback: bool = True,
    runs: list[list[Item]] | None = None,
    arrays: RunArrays | None = None,
) -> Ordered:
    """Rings start when their last member reaches them (a member is held until the slowest
    is done). With pipelines each ring also takes one slot on all its members
    (``order.slots``), else 1F1B could deadlock. ``runs``: ``rank_items``' result, if made
    already (``arrays``: their ``run_arrays``, if made)."""
    return order_runs(
        rank_items(lens, units, assignment, config.capacity, cost) if runs is None else runs,
        [u for u in assignment.order if u in assignment.members],
        assignment.members,
        {u: units[u].time for u in assignment.members},
        config.pipeline_stages,
        PackSplitter(lens, cost),
        ranks.ranks_per_node,
        fallback=fallback,
        forward_share=cost.forward_share,
        arrays=arrays,
    )


def _pipelined(lens, config: PlannerConfig, cost: CostModel, ranks: Ranks, host: int | None) -> Found:
    """With pipelines: the scheduled targets with the best bounds, each ordered for 1F1B in
    each of ``ORDERS`` and estimated in full; the shortest deadlock-free estimate wins (a
    candidate's walk stops once it is bound to be longer than the best so far)."""
    stages = config.pipeline_stages
    best = None
    for _, rings, target, units, assignment, scale in _best_schedules(
        _pipeline_targets(lens, config, cost, ranks, host), ranks, config
    ):
        ring_time = {u: units[u].time for u in assignment.members}
        for ordered in _candidate_orders(lens, units, assignment, config, cost, ranks):
            known: dict = {}
            limit = float("inf") if best is None else best[0]  # only a shorter step is kept
            finish = (
                None
                if ordered.deadlock
                else rank_estimates(ordered, stages, ring_time, cost.forward_share, config.virtual_stages, known, limit)
            )
            step = float("inf") if finish is None or isinstance(finish, Longer) else max(finish, default=0.0)
            if best is None or step < best[0]:
                best = (step, Found(rings, target, scale, units, assignment, ordered, finish, known))
    found = best[1]
    if found.ordered.deadlock:  # no candidate has a safe order of either kind: order_runs' searches, on the first
        found.ordered = order(lens, found.units, found.assignment, config, cost, ranks)
        found.finish, found.known = None, {}
    return found


def _candidate_orders(lens, units, assignment: Assignment, config: PlannerConfig, cost: CostModel, ranks) -> list:
    """A pipelined candidate's 1F1B orders (``ORDERS``): slot-aligned in schedule order
    (without ``order_runs``' searches: it may come back deadlocked), and, where that is safe,
    the rings placed again at levels: every ring on ranks that ran as many rings before it,
    the long rings back to back and the short work after them. Neither wins everywhere, so
    both are estimated."""
    runs = rank_items(lens, units, assignment, config.capacity, cost)
    arrays = run_arrays(runs)  # read by both passes
    out = []
    aligned = None
    if "aligned" in ORDERS or "by_level" in ORDERS:  # the level order takes the aligned one's unaligned rings
        aligned = order(lens, units, assignment, config, cost, ranks, fallback=False, runs=runs, arrays=arrays)
    if "aligned" in ORDERS:
        out.append(aligned)
    if "by_level" in ORDERS:
        ring_order = [u for u in assignment.order if u in assignment.members]
        ring_time = {u: units[u].time for u in assignment.members}
        by_level = order_by_level(runs, ring_order, assignment.members, ring_time, ranks.ranks_per_node, arrays)
        if by_level is not None:
            by_level.unaligned = aligned.unaligned
            out.append(by_level)
    return out or [aligned]


def _ring_sizer(config: PlannerConfig, cost: CostModel, stages: int, host: int | None) -> RingSizer:
    """The config's ring sizer, rings sized as if a share ran ``stages`` x its stage time."""
    return RingSizer(config.capacity, cost, config.offload, config.num_ranks, config.ranks_per_node, stages, host)


def _pipeline_targets(lens, config: PlannerConfig, cost: CostModel, ranks: Ranks, host: int | None) -> list[tuple]:
    """(position in ``PIPELINE_RETARGET``, target, its ``RingDecisions``, units, their
    ``UnitColumns``) of each target scale that changes some ring from the scale before it.
    A rank that runs a share alone fills and drains its pipeline with it: rings are sized as
    if a share ran ``stages`` x its stage time."""
    sizer = _ring_sizer(config, cost, config.pipeline_stages, host)
    lengths = lengths_array(lens)
    base = balanced_target(lengths, sizer)
    targets, previous = [], None
    shorts = short_units(lens, config, cost, ranks.ranks_per_node)  # the same for every target
    memo = UnitMemo()  # what the targets share of their units
    for position, scale in enumerate(PIPELINE_RETARGET):
        target = base * scale
        rings = ring_decisions(lengths, sizer, target)
        if rings.same_rings(previous):
            continue
        previous = rings
        units, columns = make_units(lens, rings, config, cost, ranks.ranks_per_node, shorts, memo)
        targets.append((position, target, rings, units, columns))
    return targets


def _best_schedules(targets: list, ranks: Ranks, config: PlannerConfig) -> list[tuple]:
    """The ``PIPELINE_ORDERED`` targets whose schedules have the smallest bound (the largest
    key; ties to the earlier target of ``PIPELINE_RETARGET``), best first, as (key, rings,
    target, units, assignment, scale). ``targets``: (position, target, rings, units, columns).

    A schedule's largest key never falls as units are given out, so once it passes the
    ``PIPELINE_ORDERED``-th smallest bound of the schedules made so far the target cannot
    be among the best: its schedule stops there (``schedule``'s ``give_up_above``). The
    targets go nearest to the best so far first (from the middle: the bound is about
    unimodal in the scale), so that good bounds stop the others early; the result does not
    depend on the order."""
    done: list[tuple] = []  # (key, position, index into targets, assignment)
    left = list(range(len(targets)))
    best = len(targets) // 2
    while left:
        i = min(left, key=lambda j: (abs(j - best), -j))  # ties: the smaller scale
        left.remove(i)
        position, target, rings, units, columns = targets[i]
        limit = sorted(d[0] for d in done)[PIPELINE_ORDERED - 1] if len(done) >= PIPELINE_ORDERED else float("inf")
        assignment = schedule(
            units, ranks, config.balance, config.slack, config.pipeline_stages, give_up_above=limit, columns=columns
        )
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
