"""Megatron's hybrid ("dynamic") context parallelism as a Plan.

The assignment is megatron-core's own: ``BalancedCPScheduler.get_groups_and_subsamples``
(megatron-core 0.16.1, ``pipeline_parallel/hybrid_cp_schedule.py``), called exactly as
``HybridCPDataLoaderWrapper`` calls it, with ``max_seq_len_per_rank`` = our capacity. It
returns *groups*; in each group every DP x CP rank holds a list of sample ids, and a sample's
CP ranks are the ranks that hold it. ``hybrid_context_parallel_forward_backward`` then runs,
on every rank, group after group: each sample of the group as its own micro-batch (forward
then backward, one sample per micro-batch), over a CP group of that many ranks, and a
``torch.distributed.barrier`` over all DP x CP ranks after every group but the last. So:

* one Plan micro-batch per (rank, sample); a sample on ``N`` ranks is one ring over them
  (ascending rank order, the order of Megatron's pre-built groups), zigzag split;
* ``Plan.barriers`` carries the barriers to the costing engine;
* no offloading; no pipelining (``forward_backward_no_pipelining`` is the only schedule that
  dispatches to it), so PP > 1 is reported as unsupported.

What the runtime would do differently is reported, not hidden (``meta["notes"]``): Megatron
only pre-builds CP groups of power-of-two sizes 2 .. d/2 at aligned offsets
(``create_hybrid_dp_cp_groups``) plus the whole DP x CP group, and looks a sample's group up
by size alone; a scheduled set of ranks that is not such a block cannot run as scheduled.
It also slices each sample into ``2 * CP`` equal chunks without padding (a TODO in
``get_batch_on_this_hybrid_cp_rank``), so lengths not divisible by ``2 * CP`` would fail
there; we cost the exact zigzag split instead.
"""

from __future__ import annotations

import math
import time
from collections import Counter, defaultdict
from collections.abc import Sequence

from ..planner.contract import MicroBatch, Plan, ring_pieces, whole_piece
from .cluster import Cluster
from .static_cp import StrategyError


class _GroupOfSize:
    """All BalancedCPScheduler asks of its ``dp_cp_group``: ``.size()``."""

    def __init__(self, n: int):
        self._n = n

    def size(self) -> int:
        return self._n


def megatron_prebuilt_group(members: Sequence[int], d_hdp: int) -> bool:
    """Is ``members`` one of the CP groups megatron-core 0.16.1 builds for hybrid CP?"""
    n = len(members)
    if n == d_hdp:
        return list(members) == list(range(d_hdp))
    sizes = [2**i for i in range(int(math.log2(d_hdp)))][1:]
    return n in sizes and members[0] % n == 0 and list(members) == list(range(members[0], members[0] + n))


def megatron_groups(seq_lens: Sequence[int], d_hdp: int, capacity: int):
    """Run megatron-core's BalancedCPScheduler: (groups, sample_id_groups, wall seconds)."""
    try:
        from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler
    except ImportError as exc:  # pragma: no cover - megatron-core is a dependency
        raise StrategyError(f"megatron-dcp needs megatron-core 0.16.1 (hybrid_cp_schedule): {exc}") from None
    scheduler = BalancedCPScheduler(max_seq_len_per_rank=capacity, dp_cp_group=_GroupOfSize(d_hdp))
    t0 = time.perf_counter()
    try:
        groups, sample_id_groups = scheduler.get_groups_and_subsamples(
            [(i, int(s)) for i, s in enumerate(seq_lens)], None
        )
    except (AssertionError, IndexError, KeyError, ValueError, TypeError, ZeroDivisionError) as exc:
        raise StrategyError(
            f"megatron-dcp: megatron-core's BalancedCPScheduler failed on this batch "
            f"({type(exc).__name__}: {exc or 'assertion'}) with {d_hdp} DP x CP ranks and "
            f"max_seq_len_per_rank={capacity}"
        ) from None
    return groups, sample_id_groups, time.perf_counter() - t0


def megatron_dcp_plan(seq_lens: Sequence[int], cluster: Cluster, capacity: int, num_layers: int) -> Plan:
    if cluster.pp > 1:
        raise StrategyError(
            f"megatron-dcp: Megatron's hybrid context parallelism (megatron-core 0.16.1) runs only without "
            f"pipelining (forward_backward_no_pipelining); PP={cluster.pp} is not supported"
        )
    d = cluster.d_hdp
    _, sample_id_groups, wall = megatron_groups(seq_lens, d, capacity)

    ranks: list[list[MicroBatch]] = [[] for _ in range(d)]
    barriers: list[list[int]] = []
    sizes: Counter = Counter()
    not_prebuilt: Counter = Counter()
    for j, group in enumerate(sample_id_groups):
        holders: dict[int, list[int]] = defaultdict(list)
        for r, ids in enumerate(group):
            for sid in ids:
                holders[int(sid)].append(r)
        pieces_of: dict[int, dict[int, object]] = {}
        for sid, members in holders.items():
            s = int(seq_lens[sid])
            ring = tuple(members)
            sizes[len(ring)] += 1
            if len(ring) > 1 and not megatron_prebuilt_group(ring, d):
                not_prebuilt[len(ring)] += 1
            if len(ring) > s:
                raise StrategyError(
                    f"megatron-dcp: BalancedCPScheduler put sample {sid} ({s} tokens) on {len(ring)} ranks; "
                    "some would hold no token"
                )
            if len(ring) == 1:
                pieces_of[sid] = {ring[0]: whole_piece(sid, s, ring[0])}
            else:
                pieces_of[sid] = dict(zip(ring, ring_pieces(sid, s, ring)))
        for r, ids in enumerate(group):
            for sid in ids:
                ranks[r].append(MicroBatch((pieces_of[int(sid)][r],)))
        if j < len(sample_id_groups) - 1:
            barriers.append([len(mbs) for mbs in ranks])

    notes = []
    if not_prebuilt:
        shown = ", ".join(f"{n} of size {size}" for size, n in sorted(not_prebuilt.items()))
        notes.append(
            f"{sum(not_prebuilt.values())} scheduled CP groups are not among Megatron's pre-built aligned "
            f"power-of-two groups ({shown}); costed as scheduled, the runtime would pick a different group"
        )
    non_pow2 = sorted(n for n in sizes if n & (n - 1) and n != d)
    if non_pow2:
        notes.append(f"CP group sizes that are neither powers of two nor all {d} ranks: {non_pow2}")
    return Plan(
        num_ranks=d,
        capacity=capacity,
        num_layers=num_layers,
        seq_lens=tuple(int(s) for s in seq_lens),
        ranks=tuple(tuple(mbs) for mbs in ranks),
        barriers=tuple(tuple(b) for b in barriers),
        meta={
            "strategy": "megatron-dcp",
            "plan_time_s": wall,
            "groups": len(sample_id_groups),
            "cp_sizes": {str(k): v for k, v in sorted(sizes.items())},
            "notes": notes,
        },
    )
