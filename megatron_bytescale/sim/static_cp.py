"""Megatron's static DP x CP mesh as a Plan (the baseline of the design, section 1).

* **CP degree**: the smallest divisor of ``d_hdp`` that is at least ``ceil(context / C)``,
  so the longest sequence the run must fit (the context) fits at capacity ``C`` per rank.
  (Megatron only needs CP to divide the DP x CP ranks; a non-divisor would leave ranks out.)
* **Packing**: sequences, longest first, go best-fit into packs of ``C * CP`` tokens, never
  split across packs. Each sequence of a pack is spread zigzag over all CP ranks of its
  group (one ring per micro-batch, shared by the pack's pieces); a pack is closed when any
  rank's share would exceed ``C`` (zigzag shares differ by one token, so packs end a few
  tokens short of ``C * CP``). Megatron would pad each sequence to a multiple of ``2 * CP``;
  we do not charge that padding. A sequence shorter than CP cannot give every rank a token:
  it runs whole on the group's least-loaded rank (Megatron would pad it to ``2 * CP`` tokens
  and spread it) — both choices favour the baseline slightly.
* **DP**: before packing, sequences go to the DP groups longest first, each to the group
  with the fewest tokens so far, so DP groups get equal token counts (within the shortest
  sequence), as Megatron's fixed-length packing intends; each group then packs its own
  sequences. DP group ``g`` owns HDP ranks ``[g * CP, (g + 1) * CP)`` (CP varies faster than
  DP in Megatron's rank order), in that ring order.
"""

from __future__ import annotations

import bisect
import heapq
import math
import time
from collections.abc import Sequence

import numpy as np

from ..errors import ConfigError
from ..planner.contract import MicroBatch, Plan, micro_batch, ring_pieces, whole_piece
from .cluster import Cluster


class StrategyError(ConfigError):
    """A strategy cannot plan this batch; the simulator reports it as that strategy's result."""


def static_cp_degree(context: int, capacity: int, d_hdp: int) -> int:
    need = math.ceil(context / capacity)
    for cp in range(need, d_hdp + 1):
        if d_hdp % cp == 0:
            return cp
    raise ConfigError(
        f"a {context}-token context needs CP >= {need} ranks of capacity {capacity}, but there are only {d_hdp} "
        "HDP ranks; raise the capacity or the GPU count, or lower the context"
    )


class _Pack:
    __slots__ = ("loads", "total", "members")

    def __init__(self, cp: int):
        self.loads = np.zeros(cp, dtype=np.int64)
        self.total = 0
        self.members: list[tuple[int, int | None]] = []  # (seq id, rank index if whole else None)


def pack_sequences(seq_lens: Sequence[int], cp: int, capacity: int, seq_ids: Sequence[int]) -> list[_Pack]:
    """Best-fit decreasing of sequences ``seq_ids`` into packs of ``capacity`` tokens per rank over ``cp`` ranks."""
    order = sorted(seq_ids, key=lambda i: -seq_lens[i])
    packs: list[_Pack] = []
    room: list[tuple[int, int]] = []  # sorted (free tokens, pack index)
    idx = np.arange(cp)
    for sid in order:
        s = seq_lens[sid]
        whole = cp > 1 and s < cp
        if whole and s > capacity:
            raise StrategyError(
                f"static: a {s}-token sequence is shorter than CP={cp} (cannot be spread) "
                f"and longer than the capacity {capacity}"
            )
        base, extra = divmod(s, cp)
        add = base + (idx < extra)
        chosen = None
        for j in range(bisect.bisect_left(room, (s, -1)), len(room)):
            pack = packs[room[j][1]]
            if whole:
                if pack.loads.min() + s <= capacity:
                    chosen = j
                    break
            elif int((pack.loads + add).max()) <= capacity:
                chosen = j
                break
        if chosen is None:
            packs.append(_Pack(cp))
            pid = len(packs) - 1
        else:
            pid = room.pop(chosen)[1]
        pack = packs[pid]
        if whole:
            member = int(pack.loads.argmin())
            pack.loads[member] += s
            pack.members.append((sid, member))
        else:
            pack.loads += add
            pack.members.append((sid, None))
        pack.total += s
        bisect.insort(room, (capacity * cp - pack.total, pid))
    return packs


def static_plan(seq_lens: Sequence[int], cluster: Cluster, capacity: int, context: int, num_layers: int) -> Plan:
    t0 = time.perf_counter()
    d = cluster.d_hdp
    cp = static_cp_degree(context, capacity, d)
    dp = d // cp
    # sequences to DP groups, longest first, each to the group with the fewest tokens so far
    heap = [(0, g) for g in range(dp)]
    shares: list[list[int]] = [[] for _ in range(dp)]
    for sid in sorted(range(len(seq_lens)), key=lambda i: -seq_lens[i]):
        tokens, g = heapq.heappop(heap)
        shares[g].append(sid)
        heapq.heappush(heap, (tokens + seq_lens[sid], g))
    owned = [pack_sequences(seq_lens, cp, capacity, ids) for ids in shares]
    plan_time = time.perf_counter() - t0

    ranks: list[list[MicroBatch]] = [[] for _ in range(d)]
    for g in range(dp):
        ring = tuple(range(g * cp, (g + 1) * cp))
        for pack in owned[g]:
            spread = [ring_pieces(sid, seq_lens[sid], ring) for sid, member in pack.members if member is None]
            # one row per ring member: its share of every spread sequence, in pack order (a
            # pack of a 1,024-GPU step holds ~10^5 pieces: the transpose runs in C)
            rows = [list(row) for row in zip(*spread)] if spread else [[] for _ in range(cp)]
            for sid, member in pack.members:
                if member is not None:
                    rows[member].append(whole_piece(sid, seq_lens[sid], ring[member]))
            for j in range(cp):
                if rows[j]:
                    ranks[ring[j]].append(micro_batch(tuple(rows[j])))
    return Plan(
        num_ranks=d,
        capacity=capacity,
        num_layers=num_layers,
        seq_lens=tuple(int(s) for s in seq_lens),
        ranks=tuple(tuple(mbs) for mbs in ranks),
        meta={"strategy": "static", "plan_time_s": plan_time, "cp": cp, "dp": dp, "packs": sum(map(len, owned))},
    )
