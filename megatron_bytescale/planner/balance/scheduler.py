"""The balance scheduler: which rank runs which work, in which order (design 2.6).

Work comes as units: a ring (``ring_size`` ranks at once, each busy ``time`` seconds), an
offloaded long sequence on one rank, or a short sequence / packed micro-batch on one rank.
The sharding decisions inside the units (ring sizes, offload ratios) are kept.

1. Units are sorted by estimated time, longest first (ties: the lower first sequence), and
   cut into buckets of roughly equal total time (long buckets hold few units).
2. Work goes to the least-loaded ranks (a rank's key: its estimated time, with ``p > 1``
   pipeline stages ``sum(times) + (p - 1) * max(time)``, its fill and drain), bucket by
   bucket:

   * ``dp`` (DP-balance): one unit at a time to the least-loaded rank (longest-processing-
     time first): all ranks run one length level at a time.
   * ``pp`` (PP-balance): the least-loaded rank takes a run: the bucket's next unit and the
     following ones of the same bucket while it stays below the level (``slack`` above an
     even spread of all work, or the largest key so far), so each pipeline runs blocks of
     micro-batches of one length level and 1F1B bubbles appear only where the level changes.
     (Taking the buckets strictly in turn, as the design words it, left long units for the
     end, where they overshot the maximum.)
   * ``tokens`` (hdp-naive): DP-balance of token counts instead of time, as static DP does.

A ring goes to the ranks the placement rules choose (``balance.kernel``); it starts when its
last member is free (the wait is counted) and all members run it at the same step of the
global order, so ring micro-batches are ordered consistently on every rank. The assignment
itself is ``balance.kernel.assign``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ...errors import ConfigError
from ..placement import Ranks
from .kernel import TREE_PICK, assign

# the balance modes: "none" (hdp-naive: equal tokens), "dp" and "pp" (hdp-balanced, this scheduler);
# PlannerConfig.balance chooses among them
BALANCE_MODES = ("none", "dp", "pp")
DEFAULT_BUCKETS = 8


@dataclass(eq=False, slots=True)  # slots: tens of thousands a step, built and read fast
class Unit:
    kind: str  # "ring" | "long" | "short" | "pack"
    seq_ids: tuple[int, ...]  # the sequence (ring, long, short) or the packed sequences
    ring_size: int
    time: float  # estimated seconds on each member (a ring: its slowest member's)
    tokens: int  # tokens on the busiest member
    ratio: float = 0.0
    fillers: tuple[tuple[int, ...], ...] = ()  # per ring slot: whole sequences packed beside its share
    heads_split: int = 1  # a ring's two-level group size: placed in whole groups on nodes


@dataclass(frozen=True)
class UnitColumns:
    """What ``schedule`` reads of every unit, as arrays in the units' order: seconds, tokens,
    first sequence id, ring size and two-level group size. Most units are short ones, which
    every candidate target of a step shares, so the planner reads theirs once per step and
    joins each target's long units' to them (``join``)."""

    time: np.ndarray
    tokens: np.ndarray
    first: np.ndarray
    ring_size: np.ndarray
    heads_split: np.ndarray

    @classmethod
    def of(cls, units: Sequence[Unit]) -> UnitColumns:
        n = len(units)
        return cls(
            np.fromiter((u.time for u in units), np.float64, n),
            np.fromiter((u.tokens for u in units), np.float64, n),  # whole numbers below 2^53: exact
            np.fromiter((u.seq_ids[0] for u in units), np.int64, n),
            np.fromiter((u.ring_size for u in units), np.int64, n),
            np.fromiter((u.heads_split for u in units), np.int64, n),
        )

    def join(self, after: UnitColumns) -> UnitColumns:
        """These units' columns followed by ``after``'s."""
        return UnitColumns(*(np.concatenate((a, b)) for a, b in zip(self._columns(), after._columns(), strict=True)))

    def _columns(self) -> tuple[np.ndarray, ...]:
        return self.time, self.tokens, self.first, self.ring_size, self.heads_split


@dataclass
class Assignment:
    runs: list[list[int]]  # per rank: unit indices in run order
    members: dict[int, tuple[int, ...]]  # ring unit -> its ranks in ring order
    clock: np.ndarray  # estimated finish per rank, waits for ring partners included
    key: np.ndarray  # what was balanced: clock plus pipeline bubble, or tokens
    idle: np.ndarray  # seconds each rank waits for ring partners
    num_buckets: int = 0
    order: list[int] = field(default_factory=list)  # global order in which units were given out


def make_buckets(order: Sequence[int], weights: Sequence[float], num_buckets: int) -> list[list[int]]:
    """Cut ``order`` (heaviest first) into at most ``num_buckets`` runs of about equal weight."""
    w = np.asarray(weights, dtype=np.float64)[np.asarray(order, dtype=np.int64)] if len(order) else np.zeros(0)
    running = np.cumsum(w)  # added one by one in order, as a loop would
    total = float(running[-1]) if w.size else 0.0
    if w.size and w.min() >= 0:
        starts = _bucket_starts(running, num_buckets)
        order = list(order)
        return [order[a:b] for a, b in zip(starts, starts[1:] + [len(order)])]
    buckets: list[list[int]] = [[]]
    acc = 0.0
    for u in order:
        if acc >= total * len(buckets) / num_buckets and buckets[-1] and len(buckets) < num_buckets:
            buckets.append([])
        buckets[-1].append(u)
        acc += weights[u]
    return buckets


def _bucket_starts(running: np.ndarray, num_buckets: int) -> list[int]:
    """Where ``make_buckets``' buckets start, from the running sum of the ordered weights
    (none negative, so it never falls): a new bucket starts at the first unit whose preceding
    weight reaches the next share of the total."""
    total = float(running[-1])
    before = np.concatenate(([0.0], running[:-1]))
    starts = [0]
    while len(starts) < num_buckets:
        i = max(starts[-1] + 1, int(np.searchsorted(before, total * len(starts) / num_buckets, side="left")))
        if i >= running.size:
            break
        starts.append(i)
    return starts


def schedule(
    units: Sequence[Unit],
    ranks: Ranks,
    mode: str = "dp",
    slack: float = 0.05,
    pipeline_stages: int = 1,
    num_buckets: int = DEFAULT_BUCKETS,
    give_up_above: float = float("inf"),
    columns: UnitColumns | None = None,
) -> Assignment | None:
    """Every unit to ranks (``Assignment``; ``mode``: "dp", "pp" or "tokens"). With
    ``give_up_above`` (the candidates' bound so far): None exactly where the schedule's own
    bound (``key.max()``) is above it, found as soon as the largest key passes it (keys never
    fall as units are given). ``columns``: ``UnitColumns.of(units)``, where the caller has it."""
    if mode not in ("dp", "pp", "tokens"):
        raise ConfigError(f"unknown balance mode {mode!r}; choose dp, pp or tokens")
    if columns is None:
        columns = UnitColumns.of(units)
    elif columns.time.size != len(units):
        raise ValueError(f"columns of {columns.time.size} units given for {len(units)} units")
    by_tokens = mode == "tokens"
    weights = columns.tokens if by_tokens else columns.time
    # heaviest first, ties by sequence ids: every sequence is in one unit, so the first id
    # alone decides a tie
    order = np.lexsort((columns.first, -weights))
    n = weights.size
    if n and weights.min() >= 0:  # make_buckets' cuts, without its lists
        starts = _bucket_starts(np.cumsum(weights[order]), num_buckets)
        ends = np.array([*starts[1:], n], dtype=np.int64)
    else:
        buckets = make_buckets(order.tolist(), weights.tolist(), num_buckets) if n else []
        ends = np.cumsum([len(b) for b in buckets], dtype=np.int64)
    water = _water(weights.tolist(), slack, ranks.num_ranks)
    sizes = columns.ring_size
    ev_rank, ev_unit, given, members, clock, key, idle, done = assign(
        order,
        ends,
        columns.time,
        columns.tokens,
        sizes,
        columns.heads_split,
        ranks.num_ranks,
        ranks.ranks_per_node,
        pipeline_stages - 1,
        water,
        give_up_above,
        mode == "pp",
        by_tokens,
        ranks.expert_parallel,
        TREE_PICK,
    )
    if not done or key.max(initial=0.0) > give_up_above:  # gave up, or passed by the last unit
        return None
    # every rank's run: the appends grouped by rank, each rank's in the order made
    by_rank = np.argsort(ev_rank, kind="stable")
    flat = ev_unit[by_rank].tolist()
    bounds = np.zeros(ranks.num_ranks + 1, dtype=np.int64)
    np.cumsum(np.bincount(ev_rank, minlength=ranks.num_ranks), out=bounds[1:])
    bounds = bounds.tolist()
    runs = [flat[a:b] for a, b in zip(bounds, bounds[1:])]
    # each ring's members, the rings in the order given
    rings = given[sizes[given] > 1]
    cuts = np.cumsum(sizes[rings]).tolist()
    flat_members = members.tolist()
    ring_members = {u: tuple(flat_members[a:b]) for u, a, b in zip(rings.tolist(), [0, *cuts], cuts)}
    return Assignment(runs, ring_members, clock, key, idle, ends.size, given.tolist())


def _water(weights: Sequence[float], slack: float, num_ranks: int) -> float:
    """PP balance's level: ``slack`` above the even spread of all work (a ring that outlasts
    it lifts it)."""
    return (1 + slack) * sum(weights) / num_ranks
