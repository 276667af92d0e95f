"""Units of work for the balance scheduler, from a step's ring decisions: a ring unit per
sequence on a ring, a long unit per sequence alone on one rank (offloaded), a short unit per
sequence that fits a rank (packed once its rank is known), and hdp-naive's packs."""

from __future__ import annotations

import numpy as np

from .balance import Unit, UnitColumns
from .config import PlannerConfig
from .contract.zigzag import rank_tokens
from .cost_model import CostModel
from .estimate import exposed_ring_time, ring_share_time
from .expert.timing import ep_all_to_all_time
from .lengths import lengths_array
from .order.items import pack_times
from .sizing import two_level
from .sizing.packing import fill_ring_spare, pack_best_fit
from .sizing.rings import RingDecisions


class UnitMemo:
    """What the candidate targets of one step share: the long units by (sequence, ring size,
    ratio, two-level group), which is all a long unit depends on within a step (most rings
    keep their size from one target to the next), and the short units' columns. Units are not
    changed once made, except hdp-naive's, whose packs fill their rings: those are made fresh
    (``make_units``)."""

    def __init__(self):
        self.units: dict[tuple, Unit] = {}
        self.short_columns: UnitColumns | None = None  # the short units' (``make_units``)


def make_units(
    lens,
    rings: RingDecisions,
    config: PlannerConfig,
    cost: CostModel,
    ranks_per_node: int,
    shorts: list[Unit] | None = None,
    memo: UnitMemo | None = None,
) -> tuple[list[Unit], UnitColumns]:
    """The long sequences' units for their ``rings``, then the short sequences' (``shorts``: the
    ones ``short_units`` made, shared by candidates that only resize rings; ``memo``: what
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

    memo = UnitMemo() if memo is None else memo
    units, columns = _long_units(rings, cost, ranks_per_node, memo, a2a)
    if shorts is None:
        shorts = short_units(lens, config, cost, ranks_per_node)
    if memo.short_columns is None:
        memo.short_columns = UnitColumns.of(shorts)
    return units + shorts, columns.join(memo.short_columns)


def short_units(lens, config: PlannerConfig, cost: CostModel, ranks_per_node: int) -> list[Unit]:
    """One unit per short sequence (at most ``capacity`` tokens), in sequence order. They do
    not depend on the ring sizes, and nothing changes them once made."""
    arr = lengths_array(lens)
    short = np.flatnonzero(arr <= config.capacity)
    tokens = arr[short]
    s = tokens.astype(np.float64)
    times = cost.short_time(s, config.capacity)
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
    memo: UnitMemo | None = None,
    a2a=None,
) -> tuple[list[Unit], UnitColumns]:
    """A unit per long sequence of ``rings``, made once per step where ``memo`` is shared
    (``UnitMemo``), and their columns (``_long_columns``, whose seconds the new units take).
    ``a2a``: a function of tokens (elementwise on arrays) giving the seconds they add (EP's
    all-to-alls), or None."""
    made = (UnitMemo() if memo is None else memo).units
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
    return [Unit("pack", b, 1, t, sum(lens[i] for i in b)) for b, t in zip(packs, pack_times(lens, packs, cost))]
