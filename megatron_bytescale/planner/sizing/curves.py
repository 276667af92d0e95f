"""The ring-time curves the ring sizer reads: for each long sequence, the per-member seconds
(all layers) of every candidate ring size, each ring two-level where a group size makes it
strictly faster (``sizing.two_level``)."""

from __future__ import annotations

import numpy as np

from ..cost_model import CostModel, layer_seconds
from ..jit import kernel
from . import two_level
from .two_level import member_pairs


def ring_curves_of(
    cost: CostModel, lengths: list[int], lo: list[int], hi: list[int], spanning: list[bool], rpn: int, us: list[int]
):
    """``ring_curves`` of ``lengths`` over ring sizes ``lo .. hi`` (two-level group sizes
    ``us`` where ``spanning``): the sizes, times and group sizes end to end, and each length's
    count."""
    ring = np.array(
        [
            cost.a1,
            cost.b1,
            cost.g,
            cost.kv_bytes_per_token,
            cost.kv_bytes_per_token + cost.grad_bytes_per_token,
            cost.grad_bytes_per_token,
            cost.p2p_latency_s,
            cost.bw_intra_node,
            cost.bw_inter_node,
            cost.forward_share,
            1 - cost.forward_share,
            cost.num_layers,
            cost.recomputed_layers,
            cost.recomputed_attention_layers,
        ],
        dtype=np.float64,
    )
    per_u = np.array(
        [
            [
                two_level.head_fractions(cost, u)[0],
                u * two_level.head_fractions(cost, u)[0],
                u,
                1.0 - 1.0 / u,
                4 * cost.q_bytes_per_token + 2 * cost.kv_bytes_per_token,
                4 * cost.p2p_latency_s,
            ]
            for u in us
        ],
        dtype=np.float64,
    ).reshape(len(us), 6)
    return ring_curves(
        np.array(lengths, dtype=np.int64),
        np.array(lo, dtype=np.int64),
        np.array(hi, dtype=np.int64),
        np.array(spanning, dtype=np.bool_),
        rpn,
        ring,
        np.array(us, dtype=np.int64),
        per_u,
    )


@kernel(size=lambda lengths, lo, hi, *_: int((hi - lo + 1).sum()))
def ring_curves(
    lengths: np.ndarray,
    lo: np.ndarray,
    hi: np.ndarray,
    spanning: np.ndarray,
    rpn: int,
    ring: np.ndarray,
    us: np.ndarray,
    per_u: np.ndarray,
):
    """Per length its ring sizes ``lo .. hi`` end to end, the per-member time of each (the
    share's compute plus the ring hops compute does not hide, and the dK/dV home hop) and,
    where the length is ``spanning``, the two-level time of each group size in ``us``
    (ascending) where it applies (a multiple of the group size, larger than a node) and is
    strictly faster, with the group size taken (1: the plain ring; ties keep the plain ring,
    then the smaller group size). ``ring``: a1, b1, g, KV bytes, KV + dKV bytes, dKV bytes,
    latency, intra- and inter-node bandwidth, forward share, 1 - forward share, layers, layers
    recomputed whole, layers whose attention is recomputed (``CostModel.recompute``);
    ``per_u`` (a row per group size): its query share of the heads, u x that share, u, 1 - 1 /
    u, the all-to-all bytes per token (4 q + 2 kv) and four latencies. Returns sizes, times,
    group sizes and each length's count."""
    a1, b1, g, kv, kvg, grad, lat, bw_in, bw_out, fs, bs, layers, rec, rec_attn = (
        ring[0],
        ring[1],
        ring[2],
        ring[3],
        ring[4],
        ring[5],
        ring[6],
        ring[7],
        ring[8],
        ring[9],
        ring[10],
        ring[11],
        ring[12],
        ring[13],
    )
    counts = hi - lo + 1
    total = 0
    for i in range(lengths.size):
        total += counts[i]
    sizes = np.empty(total, dtype=np.int64)
    times = np.empty(total)
    splits = np.ones(total, dtype=np.int64)
    at = 0
    for i in range(lengths.size):
        s = float(lengths[i])
        for size in range(lo[i], hi[i] + 1):
            d = float(size)
            share = np.ceil(s / d)
            pairs = s * s / d
            per_layer = layer_seconds(a1, b1, g, share, pairs, fs, rec, rec_attn, layers)
            bw = bw_out if size > rpn else bw_in
            step = a1 * pairs / d  # one of the N ring steps: its share of the attention term
            hop_f = share * kv / bw + lat
            hop_b = share * kvg / bw + lat
            home = share * grad / bw + lat
            hop_f -= fs * step
            hop_b -= bs * step
            exposed = max(hop_f, 0.0) + max(hop_b, 0.0)
            exposed *= d - 1
            exposed += home
            if size <= 1:
                exposed = 0.0
            per_layer += exposed
            per_layer *= layers
            split = 1
            if spanning[i] and size > rpn:
                for j in range(us.size):
                    u = us[j]
                    if size % u:
                        continue
                    fq, ufq, uf, a2a_share, a2a_bytes, a2a_lat = (
                        per_u[j, 0],
                        per_u[j, 1],
                        per_u[j, 2],
                        per_u[j, 3],
                        per_u[j, 4],
                        per_u[j, 5],
                    )
                    m = d / uf
                    pairs2 = member_pairs(s, d, ufq)
                    t = layer_seconds(a1, b1, g, share, pairs2, fs, rec, rec_attn, layers)
                    step2 = a1 * pairs2 / m  # one of the M ring steps
                    block = uf * share
                    block *= fq
                    f2 = block * kv / bw_out + lat
                    b2 = block * kvg / bw_out + lat
                    home2 = block * grad / bw_out + lat
                    if m <= 1:
                        home2 = 0.0
                    f2 -= fs * step2
                    b2 -= bs * step2
                    exposed2 = max(0.0, f2) + max(0.0, b2)
                    exposed2 *= m - 1
                    a2a = share * a2a_share
                    a2a *= a2a_bytes
                    a2a /= bw_in
                    a2a += a2a_lat
                    home2 += a2a
                    exposed2 += home2
                    t += exposed2
                    t *= layers
                    if t < per_layer:
                        per_layer, split = t, u
            sizes[at], times[at], splits[at] = size, per_layer, split
            at += 1
    return sizes, times, splits, counts
