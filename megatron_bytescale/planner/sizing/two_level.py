"""Two-level attention in the planner: which group sizes u a ring may use, and what they cost.

A ring of N = M*u ranks that spans nodes may run two-level (``runtime/two_level_attention``):
its members on one node, u at a time, swap heads by all-to-all over NVLink, then the ring runs
across the M groups with blocks u times larger and 1/u of the heads. Per member and layer,
with share b = s/N tokens:

* compute is the plain ring's when u splits the heads evenly (the largest head slice sets
  the pace: ``ceil(hq/u)/hq`` of the heads, times u);
* the ring has M - 1 hops (not N - 1) of ``u*b`` tokens with the slice's KV heads: the same
  bytes per hop against u times the compute per step, so far less of it is exposed; the dK/dV
  accumulators go home once more (when M > 1);
* the all-to-alls move ``b * (1 - 1/u) * (4 q + 2 kv)`` bytes over NVLink (forward: Q, K, V
  out and O back; backward: dO out and dQ, dK, dV back) and overlap nothing.

Only group sizes whose head slices are whole KV groups are offered (no KV head copied, so
every byte above is exact): with GQA u must split the query heads at KV-group boundaries.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np

from ..cost_model import CostModel, layer_seconds
from ..jit import jitable


def slice_bounds(q_heads: int, u: int) -> list[int]:
    """Query-head boundaries of the u places (as the runtime's ``head_slices`` cuts them)."""
    return [a * q_heads // u for a in range(u + 1)]


@lru_cache(maxsize=256)
def _valid(q_heads: int, kv_heads: int, u: int) -> bool:
    if q_heads <= 0 or kv_heads <= 0 or not 2 <= u <= q_heads or q_heads % kv_heads:
        return False
    group = q_heads // kv_heads
    return all(b % group == 0 for b in slice_bounds(q_heads, u))


def valid_splits(cost: CostModel, ranks_per_node: int) -> list[int]:
    """Group sizes two-level attention may use: divisors of ranks_per_node from 2 (so a node
    holds whole groups), whole KV groups per head slice."""
    return [
        u for u in range(2, ranks_per_node + 1) if ranks_per_node % u == 0 and _valid(cost.q_heads, cost.kv_heads, u)
    ]


def head_fractions(cost: CostModel, u: int) -> tuple[float, float]:
    """(query, KV) share of the heads in the largest slice."""
    bounds = slice_bounds(cost.q_heads, u)
    widest = max(b - a for a, b in zip(bounds, bounds[1:]))
    return widest / cost.q_heads, widest / cost.q_heads  # whole KV groups: the same share


def a2a_bytes(cost: CostModel, tokens: float, u: int) -> float:
    """Bytes one member sends over NVLink in the all-to-alls of one layer (forward+backward)."""
    return tokens * (1.0 - 1.0 / u) * (4 * cost.q_bytes_per_token + 2 * cost.kv_bytes_per_token)


def a2a_time(cost: CostModel, tokens: float, u: int) -> float:
    """Seconds of one layer's four all-to-alls (exposed: attention waits for them)."""
    return 4 * cost.p2p_latency_s + a2a_bytes(cost, tokens, u) / cost.bw_intra_node


@jitable
def member_pairs(seq_len, ring_size, u_fq):
    """The attention pairs one member of a two-level ring computes per layer: its zigzag
    share ``s^2 / N`` of the causal pairs, for the u blocks of its group (``u_fq``: u times
    the widest head slice's share of the heads, ``head_fractions``)."""
    return seq_len * seq_len / ring_size * u_fq


def share_times(cost: CostModel, seq_len, ring_sizes: np.ndarray, u, ranks_per_node: int) -> np.ndarray:
    """Per-member seconds (all layers) of a sequence run two-level over each ring size (a
    multiple of u, larger than a node; others inf).
    ``u`` may be a list of group sizes: then one row per group size. ``seq_len`` is one
    length or one per ring size (the planner prepares many lengths' curves at once)."""
    us = np.atleast_1d(np.asarray(u, dtype=np.int64))[:, None]
    sizes = np.asarray(ring_sizes)[None, :]
    ok = (sizes % us == 0) & (sizes > ranks_per_node)
    d = sizes.astype(np.float64)
    s = np.asarray(seq_len, dtype=np.float64)
    share = np.ceil(s / d)
    fq = np.array([head_fractions(cost, int(v))[0] for v in us[:, 0]])[:, None]
    fkv = fq  # whole KV groups per slice: the same share of the KV heads
    m = d / us
    pairs = member_pairs(s, d, us * fq)
    per_layer = layer_seconds(cost.a1, cost.b1, cost.g, share, pairs, *cost.recompute)
    step = cost.a1 * pairs / m  # one of the M ring steps: its share of layer_seconds' attention term
    block = us * share * fkv  # a cross-ring block, in full-head token equivalents
    bw, lat = cost.bw_inter_node, cost.p2p_latency_s
    hop_f = lat + block * cost.kv_bytes_per_token / bw
    hop_b = lat + block * (cost.kv_bytes_per_token + cost.grad_bytes_per_token) / bw
    home = np.where(m > 1, lat + block * cost.grad_bytes_per_token / bw, 0.0)
    fs = cost.forward_share
    exposed = (m - 1) * (np.maximum(0.0, hop_f - fs * step) + np.maximum(0.0, hop_b - (1 - fs) * step))
    exposed += home + a2a_time(cost, share, us)
    out = np.where(ok, cost.num_layers * (per_layer + exposed), np.inf)
    return out[0] if np.ndim(u) == 0 else out


def share_time(cost: CostModel, seq_len: int, ring_size: int, u: int, ranks_per_node: int) -> float:
    return float(share_times(cost, seq_len, np.array([ring_size]), u, ranks_per_node)[0])


def realized_split(ring: Sequence[int], u: int, ranks_per_node: int, cost: CostModel) -> int:
    """The group size a placed ring can really use: the largest valid divisor of ``u`` that
    cuts every node's consecutive run of members into whole groups (1: a plain ring)."""
    if u <= 1:
        return 1
    runs, prev = [], None
    for r in ring:
        node = r // ranks_per_node
        if node == prev:
            runs[-1] += 1
        else:
            runs.append(1)
            prev = node
    if len(runs) < 2:
        return 1  # inside one node: the plain ring is on NVLink already
    for v in range(u, 1, -1):
        if u % v == 0 and _valid(cost.q_heads, cost.kv_heads, v) and all(c % v == 0 for c in runs):
            return v
    return 1
