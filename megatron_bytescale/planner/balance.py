"""The balance scheduler: which rank runs which work, in which order (design 2.6).

Work comes as units: a ring (``ring_size`` ranks at once, each busy ``time`` seconds), an
offloaded long sequence on one rank, or a short sequence / packed micro-batch on one rank.
The sharding decisions inside the units (ring sizes, offload ratios) are kept.

1. Units are sorted by estimated time, longest first, and cut into buckets of roughly
   equal total time (long buckets hold few units).
2. Work goes to the ranks whose estimated time is more than a slack ``delta`` below the
   current maximum, least-loaded first, bucket by bucket:

   * ``dp`` (DP-balance) takes from the first non-empty (longest) bucket, one unit at a
     time, to the least-loaded rank. That rank is always more than ``delta`` below the
     maximum unless every rank is within ``delta`` of it, and then every rank is eligible
     and the least-loaded one still goes first, so this is the design's rule at its finest
     grain (longest-processing-time first): all ranks run one length level at a time.
   * ``pp`` (PP-balance) gives the least-loaded rank a run: the bucket's next unit and the
     following ones of the same bucket while the rank stays below the level (``delta``
     above an even spread of all work), so each pipeline runs blocks of micro-batches of
     one length level and 1F1B bubbles appear only where the level changes. (Taking the
     buckets strictly in turn, as the design words it, left long units for the end, where
     they overshot the maximum: 1.3-2.2x max/mean on a Byted-like batch, against 1.001.)
   * ``tokens`` (hdp-naive) balances token counts instead of time, as static DP does.

With ``pipeline_stages = p > 1`` a rank's load counts its fill and drain:
``sum(times) + (p - 1) * max(time)``.

PP and DP balance run compiled (``compiled.schedule``: the same assignment, bit for bit,
2-4x faster with the conversions around it; DP from ``COMPILED_DP_MIN_UNITS`` units; rings
placed by ``RingPlacer`` or EP's ``GroupPlacer``) where numba is present; the Python version
below is the reference the tests check it against and what runs without numba.

A ring goes to ``RingPlacer.place``'s members; it starts when its last member is free
(the wait is counted) and all members run it at the same step of the global order, so
ring micro-batches are ordered consistently on every rank.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..errors import ConfigError
from . import compiled
from .expert_slots import GroupPlacer
from .placement import RingPlacer

# the balance modes: "none" (hdp-naive: equal tokens), "dp" and "pp" (hdp-balanced, this scheduler);
# PlannerConfig.balance, `bytescale plan --balance` and --hdp-balance choose among them
BALANCE_MODES = ("none", "dp", "pp")
DEFAULT_BUCKETS = 8
BULK_RUN = 2048  # runs of single-rank units at least this long are given out in rounds
MIN_ROUND = 256  # ... while a round places at least this many
REBUILD_SHARE = 4  # a ring over at least 1 / REBUILD_SHARE of the ranks rebuilds the load heap
# DP balance takes the compiled kernel from this many units: below, Python takes milliseconds,
# and a small job (the demo, a CPU run) is spared the kernel's compile (~16 s, once per
# environment, in every rank process at once) that PP balance needs anyway
COMPILED_DP_MIN_UNITS = 1024


@dataclass(eq=False, slots=True)  # slots: ~6 x 10^4 units a step at 16K ranks, built and read fast
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
    first sequence id, ring size and two-level group size. A 512M-token step's ~4 x 10^4
    units take ~9 ms to read, once per candidate target; most of them are the short units,
    which every target shares, so the planner reads theirs once per step and joins each
    target's long units' to them (``join``)."""

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


def _round(key, clock, count, peak, seconds, tokens, bubble: int, by_tokens: bool):
    """A round of units given out with numpy (``_Loads``' rounds): unit q of ``seconds`` /
    ``tokens`` (arrays, at most one per rank) to the q-th rank in order of (key, rank), each
    starting at once. Returns those ranks, their clocks, token counts, peaks and keys after
    their unit (the same sums as one at a time), and how many of the units go where one unit
    at a time to the least-loaded rank would put them: while every rank given a unit before
    is still above the next one (equal keys end it: a tie might go either way)."""
    r = np.lexsort((np.arange(key.size), key))[: seconds.size]  # least-loaded first, ties to the lowest rank
    new_clock = clock[r] + seconds
    new_count = count[r] + tokens
    new_peak = np.maximum(peak[r], seconds)
    new_key = new_count if by_tokens else new_clock + bubble * new_peak
    low = np.minimum.accumulate(new_key)
    stop = np.flatnonzero(low[:-1] <= key[r[1:]])
    return r, new_clock, new_count, new_peak, new_key, int(stop[0]) + 1 if stop.size else seconds.size


class _Loads:
    """Per-rank estimated clocks and the decision key, with a lazy min-heap over the key."""

    def __init__(self, num_ranks: int, pipeline_stages: int, by_tokens: bool):
        # plain lists: updated one rank at a time ~10^5 times a step, where numpy scalars
        # are slow; only the key, which ring placement reads whole, is an array
        self.clock = [0.0] * num_ranks
        self.idle = [0.0] * num_ranks
        self.peak = [0.0] * num_ranks
        self.tokens = [0.0] * num_ranks
        self.last_key = [0.0] * num_ranks  # the decision key per rank (Python floats, for the heap)
        self._key = np.zeros(num_ranks)  # the same as an array, brought up to date by ``key``
        self._dirty: list[int] = []  # ranks whose key changed since
        self._unplaced: list[int] = []  # ranks whose key changed since ``key_changes``
        self.bubble = pipeline_stages - 1
        self.by_tokens = by_tokens
        # one (key, rank) entry per rank, its key at most the rank's (keys only grow): a rank
        # given work keeps its old entry until it reaches the top, where ``least`` brings it
        # up to date with one sift (no entry pushed per unit or ring member, none popped)
        self.heap = [(0.0, r) for r in range(num_ranks)]
        self.top = 0.0  # current maximum of the key

    @property
    def key(self) -> np.ndarray:
        """Every rank's key as an array (what ring placement reads)."""
        if self._dirty:
            idx = self._dirty
            last = self.last_key
            if len(idx) <= 32:  # a ring's members or a few sequences: one store each
                key = self._key
                for r in idx:
                    key[r] = last[r]
            else:
                self._key[idx] = [last[r] for r in idx]
            self._unplaced += idx
            self._dirty = []
        return self._key

    def key_changes(self) -> tuple[np.ndarray, list[int]]:
        """``key`` and the ranks whose key changed since the last call (ring placement
        keeps its per-node order up to date from them)."""
        key = self.key
        changed, self._unplaced = self._unplaced, []
        return key, changed

    def least(self) -> int:
        """The least-loaded rank (ties to the lowest); its entry stays on top of the heap until
        ``push`` replaces it. Every entry's key is at most its rank's, so an up-to-date top
        entry is the least (key, rank) of all."""
        heap, last = self.heap, self.last_key
        while True:
            k, r = heap[0]
            if k == last[r]:
                return r
            heapq.heapreplace(heap, (last[r], r))  # out of date: the rank was given work since

    def give_many(self, seconds: Sequence[float], tokens: Sequence[int]) -> list[int]:
        """Each of a run of single-rank units, in turn, to the least-loaded rank (ties to
        the lowest), where it starts at once; returns the ranks. ``least()``, ``run`` and
        ``push`` in one loop with the loads in locals: the hot path of the DP balance
        (~5 x 10^4 short sequences a step at 16K ranks)."""
        ranks: list[int] = []
        if len(seconds) >= BULK_RUN:
            ranks = self._give_in_rounds(seconds, tokens)
            seconds, tokens = seconds[len(ranks) :], tokens[len(ranks) :]
            if isinstance(seconds, np.ndarray):  # the loop below works on Python numbers
                seconds, tokens = seconds.tolist(), np.asarray(tokens).tolist()
        heap, clocks = self.heap, self.clock
        counts, peaks, last = self.tokens, self.peak, self.last_key
        by_tokens, bubble, top = self.by_tokens, self.bubble, self.top
        replace = heapq.heapreplace
        given = len(ranks)
        for t, n in zip(seconds, tokens):
            while True:  # least()
                k, r = heap[0]
                if k == last[r]:
                    break
                replace(heap, (last[r], r))
            clock = clocks[r] + t
            clocks[r] = clock
            total = counts[r] + n
            counts[r] = total
            peak = peaks[r]
            if t > peak:
                peaks[r] = peak = t
            k = total if by_tokens else clock + bubble * peak
            last[r] = k
            if k > top:
                top = k
            replace(heap, (k, r))
            ranks.append(r)
        self.top = top
        self._dirty += ranks[given:]
        return ranks

    def _give_in_rounds(self, seconds: Sequence[float], tokens: Sequence[int]) -> list[int]:
        """The first units of ``give_many`` in rounds, with numpy: in a round the units go
        to the ranks in order of (key, rank), the q-th unit to the q-th rank, for as long
        as that is what one unit at a time would do: while every rank given a unit this
        round is still above the next one (then each unit still finds the least-loaded
        rank in the next of that order). A round ends at the first unit where that fails
        (or might: equal keys); the rest go in the next round, after a fresh sort. On a
        DP-balanced 512M-token step the ~5 x 10^4 short sequences take ~5 rounds. Stops
        when rounds get short (the caller's loop takes the rest); returns the ranks."""
        n_ranks = len(self.clock)
        clock, count, peak, key = (
            np.array(x, dtype=np.float64) for x in (self.clock, self.tokens, self.peak, self.last_key)
        )
        t_all = np.asarray(seconds, dtype=np.float64)
        n_all = np.asarray(tokens, dtype=np.float64)
        out: list[np.ndarray] = []
        j = 0
        while j < t_all.size:
            m = min(n_ranks, t_all.size - j)
            r, new_clock, new_count, new_peak, new_key, q = _round(
                key, clock, count, peak, t_all[j : j + m], n_all[j : j + m], self.bubble, self.by_tokens
            )
            r = r[:q]
            clock[r], count[r], peak[r], key[r] = new_clock[:q], new_count[:q], new_peak[:q], new_key[:q]
            out.append(r)
            j += q
            if q < MIN_ROUND and j < t_all.size:
                break
        ranks = np.concatenate(out).tolist()
        self.clock[:], self.tokens[:], self.peak[:], self.last_key[:] = (
            clock.tolist(),
            count.tolist(),
            peak.tolist(),
            key.tolist(),
        )
        self.top = max(self.top, float(key.max()))
        self._dirty += ranks
        # every rank's entry up to date (the rounds changed keys without the heap)
        self.heap = list(zip(self.last_key, range(n_ranks)))
        heapq.heapify(self.heap)
        return ranks

    def give_run(
        self,
        bucket: Sequence[int],
        i: int,
        water: float,
        seconds: Sequence[float],
        tokens: Sequence[int],
        single: Sequence[bool],
        runs: list[list[int]],
        given: list[int],
    ) -> int:
        """PP-balance's run: ``bucket[i]`` to the least-loaded rank, then the bucket's next
        single-rank units to the same rank while its key after each stays within the level
        (``water`` or the maximum key, taken after the first unit); returns the next ``i``.
        ``least()``, then ``run`` per unit and one ``push`` for the run, with the loads in
        locals (the hot path of the PP balance: ~5 x 10^4 short sequences in ~2 x 10^4 runs
        a step at 16K ranks)."""
        heap, clocks, counts, peaks, last, idle = (
            self.heap,
            self.clock,
            self.tokens,
            self.peak,
            self.last_key,
            self.idle,
        )
        by_tokens, bubble, top = self.by_tokens, self.bubble, self.top
        replace = heapq.heapreplace
        while True:  # least()
            k, r = heap[0]
            if k == last[r]:
                break
            replace(heap, (last[r], r))
        run = runs[r]
        dirty = self._dirty
        n = len(bucket)
        level = None
        while True:
            u = bucket[i]
            i += 1
            t = seconds[u]
            start = clocks[r]
            idle[r] += start - clocks[r]  # ``run`` at the rank's own clock: waits nothing
            clock = clocks[r] = start + t
            total = counts[r] = counts[r] + tokens[u]
            if t > peaks[r]:
                peaks[r] = t
            k = total if by_tokens else clock + bubble * peaks[r]
            last[r] = k
            dirty.append(r)
            if k > top:
                top = k
            run.append(u)
            given.append(u)
            if level is None:
                level = max(water, top)
            if i >= n or not single[bucket[i]]:
                break
            w = seconds[bucket[i]]
            if clocks[r] + w + bubble * max(peaks[r], w) > level:  # the key after the next unit
                break
        # nothing reads the heap during the run: the rank's entry (still on top: the run
        # started from it) takes the key after its last unit
        replace(heap, (k, r))
        self.top = top
        return i

    def give_runs_in_rounds(
        self,
        bucket: np.ndarray,
        i: int,
        end: int,
        water: float,
        seconds: np.ndarray,
        tokens: np.ndarray,
        runs: list[list[int]],
        given: list[int],
    ) -> int:
        """``give_run`` from ``bucket[i]`` on, over the single-rank units up to ``bucket[end]``
        (exclusive), for as long as each run is one unit, in rounds with numpy: in a round the
        ranks are taken in order of (key, rank) and the q-th unit goes to the q-th rank while
        that is what ``give_run`` would do: the rank is still the least loaded (every rank
        given a unit before it this round is now above it; equal keys end the round) and its
        run ends after the unit (the bucket's next unit would take it over the level). The
        same sums in the same order, so the same floats. A round ends at the first unit
        where either fails; rounds go on while they place ``MIN_ROUND`` units. Returns the
        next ``i`` (the caller's ``give_run`` takes the run that ended the rounds). Keys
        only grow, so the heap entries of the ranks given units stay valid lower bounds."""
        assert not self.by_tokens  # PP-balance balances time
        n_ranks = len(self.clock)
        bubble = self.bubble
        while end - i > 0:
            m = min(n_ranks, end - i)
            units = bucket[i : i + m]
            r, clock, count, peak, new_key, q = _round(
                np.array(self.last_key),
                np.array(self.clock),
                np.array(self.tokens),
                np.array(self.peak),
                seconds[units],
                tokens[units],
                bubble,
                False,
            )
            # and while the run ends after the unit: the bucket's next unit in the stretch
            # would take the rank over the level (the largest key so far, taken after its unit)
            k = min(q, end - i - 1)
            level = np.maximum(water, np.maximum.accumulate(np.maximum(new_key[:k], self.top)))
            w = seconds[bucket[i + 1 : i + 1 + k]]
            goes_on = np.flatnonzero(clock[:k] + w + bubble * np.maximum(peak[:k], w) <= level)
            if goes_on.size:
                q = int(goes_on[0])
            if q:
                ranks, units = r[:q].tolist(), units[:q].tolist()
                rows = zip(
                    ranks, units, clock[:q].tolist(), new_key[:q].tolist(), peak[:q].tolist(), count[:q].tolist()
                )
                for rank, u, c, key_after, p, n in rows:
                    self.clock[rank], self.last_key[rank], self.peak[rank], self.tokens[rank] = c, key_after, p, n
                    runs[rank].append(u)
                given.extend(units)
                self._dirty += ranks
                self.top = max(self.top, float(new_key[:q].max()))
                i += q
            if q < MIN_ROUND:
                break
        return i

    def run_ring(self, ring_ranks: Sequence[int], start: float, seconds: float, tokens: int) -> None:
        """``run`` for each member of a ring, with the loads in locals (the same operations in
        the same order: ~3 x 10^4 members a step at 16K ranks). The members' heap entries stay
        as they are (``least`` brings one up to date when it reaches the top)."""
        idle, clocks, counts, peaks, last = self.idle, self.clock, self.tokens, self.peak, self.last_key
        by_tokens, bubble, top = self.by_tokens, self.bubble, self.top
        for r in ring_ranks:
            idle[r] += start - clocks[r]
            clock = clocks[r] = start + seconds
            total = counts[r] = counts[r] + tokens
            if seconds > peaks[r]:
                peaks[r] = seconds
            k = total if by_tokens else clock + bubble * peaks[r]
            last[r] = k
            if k > top:
                top = k
        # a ring over a large share of the ranks: every entry brought up to date at once (one
        # heapify) rather than one sift per member as each reaches the top
        if len(ring_ranks) * REBUILD_SHARE >= len(clocks):
            self.heap = list(zip(last, range(len(last))))
            heapq.heapify(self.heap)
        self.top = top
        self._dirty += ring_ranks

    def push(self, r: int) -> None:
        """Rank ``r``'s entry up to date if it is on top (elsewhere ``least`` will see to it)."""
        if self.heap[0][1] == r:
            heapq.heapreplace(self.heap, (self.last_key[r], r))

    def run(self, r: int, start: float, seconds: float, tokens: int) -> None:
        self.idle[r] += start - self.clock[r]
        self.clock[r] = start + seconds
        self.tokens[r] += tokens
        if seconds > self.peak[r]:
            self.peak[r] = seconds
        k = self.tokens[r] if self.by_tokens else self.clock[r] + self.bubble * self.peak[r]
        self.last_key[r] = k
        self._dirty.append(r)
        if k > self.top:
            self.top = k


def schedule(
    units: Sequence[Unit],
    placer: RingPlacer,
    mode: str = "dp",
    slack: float = 0.05,
    pipeline_stages: int = 1,
    num_buckets: int = DEFAULT_BUCKETS,
    give_up_above: float = float("inf"),
    columns: UnitColumns | None = None,
) -> Assignment | None:
    """Every unit to ranks (``Assignment``). With ``give_up_above`` (PP balance's candidates,
    the other modes' retargets): None exactly where the schedule's own bound (``key.max()``) is
    above it, found as soon as the largest key passes it (keys never fall as units are given),
    the same in every mode and in the compiled path. ``columns``: ``UnitColumns.of(units)``,
    where the caller has it."""
    if mode not in ("dp", "pp", "tokens"):
        raise ConfigError(f"unknown balance mode {mode!r}; choose dp, pp or tokens")
    if columns is None:
        columns = UnitColumns.of(units)
    elif columns.time.size != len(units):
        raise ValueError(f"columns of {columns.time.size} units given for {len(units)} units")
    by_tokens = mode == "tokens"
    weights_array = columns.tokens if by_tokens else columns.time
    weights = weights_array.tolist()
    # heaviest first, ties by sequence ids: every sequence is in one unit, so the first id
    # alone decides a tie (one numpy sort instead of a Python sort on tuple keys)
    order_array = np.lexsort((columns.first, -weights_array))
    # PP and DP balance compiled (DP from COMPILED_DP_MIN_UNITS units), the same assignment: the
    # kernel places rings as RingPlacer does, or as GroupPlacer does (whole EP groups); another
    # subclass takes the Python path
    compiled_mode = mode == "pp" or (mode == "dp" and len(units) >= COMPILED_DP_MIN_UNITS)
    compiled_placer = type(placer) in (RingPlacer, GroupPlacer)
    if compiled_mode and compiled_placer and (kernel := compiled.schedule()) is not None:
        return _compiled_schedule(
            kernel,
            columns,
            placer,
            order_array,
            weights,
            weights_array,
            num_buckets,
            slack,
            pipeline_stages,
            give_up_above,
            runs=mode == "pp",
        )
    order = order_array.tolist()
    loads = _Loads(placer.num_ranks, pipeline_stages, by_tokens)
    runs: list[list[int]] = [[] for _ in range(placer.num_ranks)]
    members: dict[int, tuple[int, ...]] = {}
    given: list[int] = []

    def give_ring(u: int) -> None:
        unit = units[u]
        key, changed = loads.key_changes()
        ring_ranks = placer.place_ranks(key, unit.ring_size, unit.heads_split, changed)
        clock = loads.clock
        start = max([clock[r] for r in ring_ranks])
        # synchronous: every member is held until the slowest is done
        loads.run_ring(ring_ranks, start, unit.time, unit.tokens)
        for r in ring_ranks:
            runs[r].append(u)
        members[u] = tuple(ring_ranks)
        given.append(u)

    buckets = make_buckets(order, weights, num_buckets) if order else []
    if mode in ("dp", "tokens"):
        # the buckets in turn, each longest unit first, is ``order`` itself: rings one by
        # one, each stretch of single-rank units between them in one go
        singles: list[int] = []

        columns: list[np.ndarray] = []  # every unit's time and tokens, once a long run needs them

        def give_singles() -> None:
            if len(singles) >= BULK_RUN:  # given in rounds of numpy work: pass arrays
                if not columns:
                    columns[:] = (
                        np.fromiter((u.time for u in units), dtype=np.float64, count=len(units)),
                        np.fromiter((u.tokens for u in units), dtype=np.float64, count=len(units)),
                    )
                at = np.array(singles, dtype=np.int64)
                seconds, tokens = columns[0][at], columns[1][at]
            else:
                seconds, tokens = [units[u].time for u in singles], [units[u].tokens for u in singles]
            for u, r in zip(singles, loads.give_many(seconds, tokens)):
                runs[r].append(u)
            given.extend(singles)
            singles.clear()

        for u in order:
            if units[u].ring_size > 1:
                if singles:
                    give_singles()
                if loads.top > give_up_above:
                    return None
                give_ring(u)
            else:
                singles.append(u)
        if singles:
            give_singles()
        if loads.top > give_up_above:
            return None
        return Assignment(runs, members, np.array(loads.clock), loads.key, np.array(loads.idle), len(buckets), given)

    # pp: the same order, in runs: the least-loaded rank takes the next unit and goes on
    # taking the following ones of the same bucket while it stays below the level, so each
    # pipeline runs blocks of micro-batches of one length level and 1F1B bubbles appear
    # only where the level changes.
    water = _water(weights, slack, placer.num_ranks)

    seconds = [u.time for u in units]
    tokens = [u.tokens for u in units]
    single = [u.ring_size == 1 for u in units]
    columns = None  # every unit's seconds and tokens as arrays, once a long stretch needs them
    for bucket in buckets:
        i, retry = 0, 0
        if len(bucket) >= BULK_RUN:
            # per position: where its stretch of single-rank units ends (the next ring or the end)
            at = np.asarray(bucket, dtype=np.int64)
            rings = np.flatnonzero(~np.asarray([single[u] for u in bucket], dtype=bool))
            stretch_end = np.append(rings, len(bucket))[np.searchsorted(rings, np.arange(len(bucket)))]
        else:
            retry = len(bucket)  # no stretch this long: one run at a time throughout
        while i < len(bucket):
            if loads.top > give_up_above:
                return None
            u = bucket[i]
            if not single[u]:
                give_ring(u)
                i += 1
                continue
            if i >= retry and stretch_end[i] - i >= BULK_RUN:  # a long stretch: runs of one unit in rounds
                if columns is None:
                    columns = np.asarray(seconds, dtype=np.float64), np.asarray(tokens, dtype=np.float64)
                j = loads.give_runs_in_rounds(at, i, int(stretch_end[i]), water, *columns, runs, given)
                # the loop takes the run that ended the rounds (after short rounds, a while longer)
                retry = j + (MIN_ROUND if j - i < MIN_ROUND else 1)
                i = j
                continue
            i = loads.give_run(bucket, i, water, seconds, tokens, single, runs, given)
    if loads.top > give_up_above:  # passed by the last run
        return None
    return Assignment(runs, members, np.array(loads.clock), loads.key, np.array(loads.idle), len(buckets), given)


def _water(weights: Sequence[float], slack: float, num_ranks: int) -> float:
    """PP balance's level: ``slack`` above the even spread of all work (a ring that outlasts
    it lifts it)."""
    return (1 + slack) * sum(weights) / num_ranks


def _compiled_schedule(
    kernel,
    columns: UnitColumns,
    placer: RingPlacer,
    order: np.ndarray,
    weights: list[float],
    weights_array: np.ndarray,
    num_buckets: int,
    slack: float,
    pipeline_stages: int,
    give_up_above: float,
    runs: bool = True,
) -> Assignment | None:
    """``schedule``'s PP balance (``runs``) or DP balance in ``compiled.schedule``: the same
    buckets and level, the same assignment (or None). ``weights_array``: ``weights`` as an array;
    ``columns``: the units' (``UnitColumns``)."""
    n = weights_array.size
    if n and weights_array.min() >= 0:  # make_buckets' cuts, without its lists
        starts = _bucket_starts(np.cumsum(weights_array[order]), num_buckets)
        ends = np.array([*starts[1:], n], dtype=np.int64)
    else:
        buckets = make_buckets(order.tolist(), weights, num_buckets) if n else []
        ends = np.cumsum([len(b) for b in buckets], dtype=np.int64)
    water = _water(weights, slack, placer.num_ranks)
    sizes = columns.ring_size
    ev_rank, ev_unit, given, members, clock, key, idle, done = kernel(
        order,
        ends,
        weights_array,
        sizes,
        columns.heads_split,
        placer.num_ranks,
        placer.ranks_per_node,
        pipeline_stages - 1,
        water,
        give_up_above,
        runs,
        placer.expert_parallel if isinstance(placer, GroupPlacer) else 1,
        compiled.TREE_PICK,
    )
    if not done or key.max(initial=0.0) > give_up_above:  # gave up, or passed by the last unit
        return None
    # every rank's run: the appends grouped by rank, each rank's in the order made
    by_rank = np.argsort(ev_rank, kind="stable")
    flat = ev_unit[by_rank].tolist()
    bounds = np.zeros(placer.num_ranks + 1, dtype=np.int64)
    np.cumsum(np.bincount(ev_rank, minlength=placer.num_ranks), out=bounds[1:])
    bounds = bounds.tolist()
    runs = [flat[a:b] for a, b in zip(bounds, bounds[1:])]
    # each ring's members, the rings in the order given
    rings = given[sizes[given] > 1]
    cuts = np.cumsum(sizes[rings]).tolist()
    flat_members = members.tolist()
    ring_members = {u: tuple(flat_members[a:b]) for u, a, b in zip(rings.tolist(), [0, *cuts], cuts)}
    return Assignment(runs, ring_members, clock, key, idle, ends.size, given.tolist())
