"""Estimated seconds of micro-batches and ranks, from the CostModel (one pipeline stage).

* A micro-batch costs ``num_layers * layer_time(tokens, pairs)``: a whole sequence of s
  tokens adds s^2 attention pairs, a zigzag share of a ring of N adds s^2 / N.
* A ring micro-batch adds the ring communication that compute does not hide. Per layer a
  ring of N runs N attention steps; steps 2..N wait for one hop each (forward: KV; backward:
  KV and dKV). A step costs ``max(attention of one step, hop)``, so the exposed part is
  ``(N - 1) * max(0, hop - step)`` for forward and for backward. After the last backward
  step the dK/dV accumulators travel home in one more hop that no compute overlaps (the
  N-th of ``ring_traffic.p2p_bytes_per_rank``'s N backward dKV hops): it is exposed whole. The
  slowest link sets the pace of a synchronous ring, so a ring that crosses nodes runs at
  the inter-node bandwidth.
* An offloaded micro-batch adds the copy time its passes do not hide (``copy_exposure``,
  the offload policy's rule; zero for every ratio the planner picks).
* With ``pipeline_stages = p > 1`` a rank (one pipeline) takes the makespan of 1F1B over
  its micro-batches (``one_f_one_b_time``, the longest path through the contract's
  dependency graph): every stage runs each micro-batch's forward
  (``CostModel.forward_share`` of its time) and backward in 1F1B order, a forward after the previous
  stage's, a backward after the next stage's. ``sum + (p - 1) * max`` (``pipeline_time``,
  what the balance scheduler keeps while it places work) is exact for equal micro-batches
  only: a short one between long ones stalls the first stage longer.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .contract import MicroBatch, graph, rank_tokens
from .cost_model import FORWARD_SHARE, CostModel
from .sizing.offload import copy_exposure


def dkv_home_time(cost: CostModel, block_tokens: float, inter_node: bool) -> float:
    """Seconds per layer of the backward's last hop: the dK/dV accumulators of a block go
    home to its owner once all members have added to them; nothing overlaps it."""
    bw = cost.bw_inter_node if inter_node else cost.bw_intra_node
    return cost.p2p_latency_s + block_tokens * cost.grad_bytes_per_token / bw


def _positive_part(x):
    """``max(0.0, x)``, elementwise where ``x`` is an array (the same values)."""
    return np.maximum(x, 0.0) if isinstance(x, np.ndarray) else max(0.0, x)


def exposed_ring_time(cost: CostModel, pairs: float, block_tokens: float, ring_size: int, inter_node: bool) -> float:
    """Seconds per layer that ring hops add beyond compute, for one member.

    ``pairs``: this member's attention pairs of the distributed sequences; ``block_tokens``:
    the KV block a hop carries (the largest member share). ``pairs``, ``block_tokens`` and
    ``ring_size`` may be arrays (rings of 2 or more, one ``inter_node`` for all): the same
    floats, elementwise.
    """
    if not isinstance(ring_size, np.ndarray) and ring_size <= 1:
        return 0.0
    step = cost.a1 * pairs / ring_size  # one of the N ring steps: its share of layer_seconds' attention term
    fwd = _positive_part(cost.hop_time(block_tokens, inter_node, backward=False) - cost.forward_share * step)
    bwd = _positive_part(cost.hop_time(block_tokens, inter_node, backward=True) - (1.0 - cost.forward_share) * step)
    fwd *= 1.0 + cost.recompute_attention_share  # a recomputed attention runs its forward ring again
    return (ring_size - 1) * (fwd + bwd) + dkv_home_time(cost, block_tokens, inter_node)


def ring_share_time(cost: CostModel, seq_len: int, ring_size: int, inter_node: bool) -> float:
    """Seconds one member of a ring spends on its share of one sequence (a micro-batch of its
    own). ``seq_len`` and ``ring_size`` may be int64 arrays (rings of 2 or more, one
    ``inter_node`` for all): the same floats, elementwise (squares below 2^53 are exact)."""
    share = -(-seq_len // ring_size)
    pairs = seq_len * seq_len / ring_size
    per_layer = cost.layer_time(share, pairs) + exposed_ring_time(cost, pairs, share, ring_size, inter_node)
    return cost.num_layers * per_layer


def micro_batch_time(cost: CostModel, mb: MicroBatch, inter_node: bool = False) -> float:
    """Seconds of one micro-batch on one member (every member of a ring takes the same time
    up to one token, except for the whole sequences packed next to the ring's pieces)."""
    pieces = mb.pieces
    if len(pieces) == 1:  # most micro-batches: a ring member's share or one sequence
        p = pieces[0]
        return piece_time(cost, p.seq_len, len(p.ring), p.tokens, mb.offload_ratio, inter_node)
    tokens = 0
    pairs = 0.0
    dist_pairs = 0.0
    block = 0
    ring = mb.ring
    for p in mb.pieces:
        tokens += p.tokens
        if p.is_distributed:
            share_pairs = p.seq_len * p.seq_len / p.ring_size
            pairs += share_pairs
            dist_pairs += share_pairs
            block += rank_tokens(p.seq_len, p.ring_size, 0)
        else:
            pairs += p.seq_len * p.seq_len
    per_layer = cost.layer_time(tokens, pairs)
    if ring is not None:
        per_layer += exposed_ring_time(cost, dist_pairs, block, len(ring), inter_node)
    return cost.num_layers * per_layer + offload_time(cost, tokens, pairs, mb.offload_ratio)


def piece_time(
    cost: CostModel,
    seq_len: int,
    ring_size: int,
    tokens: int,
    ratio: float,
    inter_node: bool,
    exposed: float | None = None,
) -> float:
    """``micro_batch_time`` of a micro-batch of one piece (``tokens`` of a sequence of
    ``seq_len`` on a ring of ``ring_size``, 1: whole), the same sums in the same order.
    ``exposed``: the ring's ``exposed_ring_time``, where the caller knows it (it is the same on
    every member)."""
    if ring_size > 1:
        pairs = seq_len * seq_len / ring_size
        if exposed is None:
            exposed = ring_exposed_time(cost, seq_len, ring_size, inter_node)
        per_layer = cost.layer_time(tokens, pairs) + exposed
    else:
        pairs = 0.0 + seq_len * seq_len  # a float, as the sum over pieces makes it
        per_layer = cost.layer_time(tokens, pairs)
    return cost.num_layers * per_layer + offload_time(cost, tokens, pairs, ratio)


def ring_exposed_time(cost: CostModel, seq_len: int, ring_size: int, inter_node: bool) -> float:
    """``exposed_ring_time`` of one member's share of a sequence on a ring (``piece_time``'s
    ``exposed``)."""
    pairs = seq_len * seq_len / ring_size
    return exposed_ring_time(cost, pairs, rank_tokens(seq_len, ring_size, 0), ring_size, inter_node)


def ring_time(cost: CostModel, mbs: Sequence[MicroBatch], inter_node: bool = False) -> float:
    """Seconds of one ring micro-batch, whose members' micro-batches are ``mbs``: the ring runs
    in lockstep, each layer waiting for the member with the most linear work, then (ring step
    0) for the one with the most attention of whole sequences packed beside its share; they
    may be different members, so this can exceed every member's ``micro_batch_time``."""
    tokens = local = dist_pairs = 0.0
    block = 0
    for mb in mbs:
        t = lp = dp = 0.0
        b = 0
        for p in mb.pieces:
            t += p.tokens
            if p.is_distributed:
                dp += p.seq_len * p.seq_len / p.ring_size
                b += rank_tokens(p.seq_len, p.ring_size, 0)
            else:
                lp += p.seq_len * p.seq_len
        tokens, local, dist_pairs, block = max(tokens, t), max(local, lp), max(dist_pairs, dp), max(block, b)
    n = len(mbs[0].ring) if mbs and mbs[0].ring is not None else 1
    per_layer = cost.layer_time(tokens, dist_pairs + local) + exposed_ring_time(cost, dist_pairs, block, n, inter_node)
    offload = max((offload_time(cost, mb.tokens, _pairs(mb), mb.offload_ratio) for mb in mbs), default=0.0)
    return cost.num_layers * per_layer + offload


def _pairs(mb: MicroBatch) -> float:
    return sum(p.seq_len * p.seq_len / p.ring_size if p.is_distributed else p.seq_len * p.seq_len for p in mb.pieces)


def offload_time(cost: CostModel, tokens: float, pairs: float, ratio: float) -> float:
    """Seconds the copies of an offloaded micro-batch add beyond compute, all ``l - 2``
    offloaded layers of the stage (``copy_exposure``: 0 whenever the planner chose ``ratio``)."""
    layers = cost.activation_layers  # recomputed layers keep nothing to copy
    if ratio <= 0 or layers <= 2:
        return 0.0
    return (layers - 2) * sum(copy_exposure(cost, tokens, pairs, ratio))


def crosses_nodes(ring: Sequence[int], ranks_per_node: int) -> bool:
    return len({r // ranks_per_node for r in ring}) > 1


def pipeline_time(mb_times: Sequence[float], pipeline_stages: int) -> float:
    if not mb_times:
        return 0.0
    return sum(mb_times) + (pipeline_stages - 1) * max(mb_times)


def one_f_one_b_time(mb_times: Sequence[float], pipeline_stages: int, forward_share: float = FORWARD_SHARE) -> float:
    """Seconds a pipeline of ``pipeline_stages`` equal stages takes for micro-batches of these
    stage times under 1F1B, nothing else waiting (the contract's dependency graph)."""
    return graph.one_f_one_b_time(mb_times, pipeline_stages, forward_share)


def rank_times(plan, cost: CostModel, ranks_per_node: int, pipeline_stages: int = 1) -> list[float]:
    """Estimated seconds per rank (no waiting for ring partners; with pipelines, 1F1B's)."""
    out = []
    for mbs in plan.ranks:
        times = [
            micro_batch_time(cost, mb, mb.ring is not None and crosses_nodes(mb.ring, ranks_per_node)) for mb in mbs
        ]
        out.append(one_f_one_b_time(times, pipeline_stages, cost.forward_share))
    return out


def finish_times(plan, cost: CostModel, ranks_per_node: int) -> list[float]:
    """Estimated finish seconds per rank when ranks run their micro-batches in plan order
    and every ring micro-batch starts once all of its members reach it (no pipeline)."""
    ranks = plan.ranks
    pos = [0] * len(ranks)
    clock = [0.0] * len(ranks)
    waiting: dict[tuple, list[int]] = {}
    progress = True
    while progress:
        progress = False
        for rank, mbs in enumerate(ranks):
            while pos[rank] < len(mbs):
                mb = mbs[pos[rank]]
                ring = mb.ring
                t = micro_batch_time(cost, mb, ring is not None and crosses_nodes(ring, ranks_per_node))
                if ring is None:
                    clock[rank] += t
                    pos[rank] += 1
                    progress = True
                    continue
                key = mb.ring_key
                arrived = waiting.setdefault(key, [])
                if rank not in arrived:
                    arrived.append(rank)
                if len(arrived) < len(ring):
                    break
                # a ring is synchronous: it starts when its last member arrives and every
                # member finishes with the slowest (shares differ by a token, or by fillers)
                start = max(clock[r] for r in ring)
                inter = crosses_nodes(ring, ranks_per_node)
                end = start + ring_time(cost, [ranks[r][pos[r]] for r in ring], inter)
                for r in ring:
                    clock[r] = end
                    pos[r] += 1
                del waiting[key]
                progress = True
    return clock


def whole_sequences_time(cost: CostModel, tokens: int, pairs: float, offload_ratio: float = 0.0) -> float:
    """``micro_batch_time`` of a micro-batch of whole sequences only (no ring), from its
    ``tokens`` and ``pairs`` (the sum of its sequences' squared lengths): for a caller that
    has summed them already and costs many such micro-batches (expert slots' estimates)."""
    return cost.num_layers * cost.layer_time(tokens, pairs) + offload_time(cost, tokens, pairs, offload_ratio)
