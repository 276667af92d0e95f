"""Selective activation offloading: how many ranks a long sequence needs (design 2.4).

A rank may hold ``t`` tokens of one micro-batch at offload ratio ``r`` when
``t * resident_fraction(r, l) <= C``: the same rule ``Plan.validate()`` checks, so the
planner and the validator always agree on capacity (capacity is counted in tokens; with a
profile whose ``b2`` is not zero the design's byte form differs by that constant only).

A sequence of ``s`` tokens on a ring of ``D`` ranks puts at most ``ceil(s / D)`` tokens on
one rank (zigzag shares differ by at most one token). For each ``D`` the smallest ratio
that fits that share is ``ratio_for_share``; ``D(s)`` is the smallest ``D`` whose ratio is
at most 1 and whose copy hides behind compute, and ``r`` is that smallest ratio (the least
PCIe traffic among all ratios reaching the minimum).

Two decisions, stated once here and tested:

* **The copy must hide per rank share and per direction**, not per whole sequence and not
  behind the whole layer: each rank copies its own activations over its own PCIe link
  while computing its own share; device-to-host copies run during the forward and
  host-to-device copies during the backward, so with ``f`` the forward share of a layer's
  time (``CostModel.forward_share``) the constraint is

      r * act_bytes(t) / B_d2h <= f * layer_time(t, s^2 / D)
      r * act_bytes(t) / B_h2d <= (1 - f) * layer_time(t, s^2 / D)

  for every member's share ``t`` (``floor(s/D)`` or ``ceil(s/D)``). ``copy_exposure`` is
  this rule, and the one the estimate and the simulator charge when a copy does not hide.
* **Host memory is bounded**: the offloaded part of a micro-batch waits in pinned host
  memory until its backward, so ``t * (1 - resident_fraction(r, l)) <= H`` (the same
  token-equivalent form as the device rule, ``Plan.validate()`` checks it too), where
  ``H = host_capacity(cost, in_flight)`` is the host budget per GPU in tokens. With 1F1B a
  stage holds up to ``pipeline_stages`` micro-batches in flight, so the budget is shared by
  that many.
* **r_min is exact**: the design's ``r_min = l*Act(C) / ((l-2)*Act(s))`` is the ratio that
  frees one capacity's worth of tokens, which is more than needed to save a rank when
  ``s / C`` is not whole (for s = 9K, C = 8K, l = 32 it asks 0.95 where 0.12 already fits the
  sequence on one rank). We use the exact smallest ratio that saves a rank under the
  validator's capacity rule. So every chosen ratio is 0 or reaches fewer ranks than r = 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from ..contract import resident_fraction
from ..cost_model import CostModel

RATIO_STEP = 1e-4  # ratios are rounded up to this step: readable, and never below the need


@dataclass(frozen=True)
class OffloadDecision:
    ranks: int  # D(s): ring size (1: the sequence runs whole on one rank)
    ratio: float  # r: offload ratio of the micro-batch holding the sequence's share


def host_capacity(cost: CostModel, in_flight: int = 1) -> int | None:
    """Token-equivalents of host memory one micro-batch may fill, or None for no limit.

    A micro-batch of ``t`` tokens at ratio ``r`` parks ``(l - 2) * r * a2 * t`` bytes, which
    is ``l * a2 * t * (1 - resident_fraction(r, l))``: so the budget in tokens is
    ``host_memory_bytes / (in_flight * l * a2)`` (the per-micro-batch ``b2`` is left out, as
    in the device capacity)."""
    per_token = in_flight * cost.activation_layers * cost.a2  # recomputed layers park nothing
    if math.isinf(cost.host_memory_bytes) or per_token <= 0:
        return None
    return int(cost.host_memory_bytes // per_token)


def host_tokens(tokens: float, ratio: float, num_layers: int) -> float:
    """Token-equivalents of ``tokens`` at ``ratio`` that sit in host memory."""
    return tokens * (1.0 - resident_fraction(ratio, num_layers)) if ratio > 0 else 0.0


def host_bytes(cost: CostModel, tokens: float, ratio: float, layers: int | None = None) -> float:
    """Bytes one micro-batch parks in host memory: ratio r of each of ``l - 2`` layers."""
    layers = cost.activation_layers if layers is None else layers
    if ratio <= 0 or layers <= 2:
        return 0.0
    return (layers - 2) * ratio * cost.act_bytes(tokens)


def max_tokens(capacity: int, ratio: float, num_layers: int) -> int:
    """Most tokens one micro-batch may hold at ``ratio`` (``t * resident_fraction <= C``)."""
    frac = resident_fraction(ratio, num_layers)
    t = int(capacity / frac)
    while (t + 1) * frac <= capacity:
        t += 1
    while t > 0 and t * frac > capacity:
        t -= 1
    return t


def ratio_for_share(tokens: int, capacity: int, num_layers: int, host: int | None = None) -> float | None:
    """Smallest ratio (rounded up to RATIO_STEP) at which ``tokens`` fit, or None if none
    does; ``host`` bounds what the offloaded part may take (token-equivalents, None: no bound)."""
    if tokens <= capacity:
        return 0.0
    if num_layers <= 2:
        return None  # the two resident layers are all there is: nothing to offload
    need = 1.0 - (num_layers * capacity / tokens - 2.0) / (num_layers - 2)
    r = min(1.0, round(math.ceil(need / RATIO_STEP - 1e-9) * RATIO_STEP, 10))
    while r < 1.0 and tokens * resident_fraction(r, num_layers) > capacity:
        r = min(1.0, round(r + RATIO_STEP, 10))
    if tokens * resident_fraction(r, num_layers) > capacity:
        return None
    if host is not None and host_tokens(tokens, r, num_layers) > host:
        return None  # the smallest ratio already overfills the host: larger ones would too
    return r


def copy_exposure(cost: CostModel, tokens: float, attention_pairs: float, ratio: float) -> tuple[float, float]:
    """(forward, backward) seconds one offloaded layer's copies add beyond its compute.

    The one copy rule of planner, estimate and simulator: the device-to-host copy of
    ``ratio * act_bytes(tokens)`` overlaps the layer's forward (``forward_share`` of
    ``layer_time``), the host-to-device copy its backward (the rest)."""
    if ratio <= 0.0:
        return 0.0, 0.0
    t = cost.layer_time(tokens, attention_pairs)
    nbytes = ratio * cost.act_bytes(tokens)
    f = cost.forward_share
    return max(0.0, nbytes / cost.bw_d2h - f * t), max(0.0, nbytes / cost.bw_h2d - (1.0 - f) * t)


def copy_hides(cost: CostModel, tokens: float, attention_pairs: float, ratio: float) -> bool:
    """Do both copies of ``ratio`` of this micro-batch's activations hide behind their pass?"""
    fwd, bwd = copy_exposure(cost, tokens, attention_pairs, ratio)
    return fwd <= 0.0 and bwd <= 0.0


def share_pairs(seq_len: int, ring_size: int) -> float:
    """Attention pairs of one rank's zigzag share (the a1 term of ``layer_time``)."""
    return seq_len * seq_len / ring_size


def ratio_for_ranks(
    seq_len: int, ring_size: int, capacity: int, cost: CostModel, host: int | None = None
) -> float | None:
    """Smallest ratio that fits ``seq_len`` on ``ring_size`` ranks with the copy hidden and
    the host budget ``host`` (token-equivalents) kept, or None."""
    share = -(-seq_len // ring_size)
    r = ratio_for_share(share, capacity, cost.activation_layers, host)
    if r is None:
        return None
    # every member must hide its copy: shares differ by one token, and the condition is
    # linear in the share, so the largest and the smallest share cover all members
    pairs = share_pairs(seq_len, ring_size)
    if not (copy_hides(cost, share, pairs, r) and copy_hides(cost, seq_len // ring_size, pairs, r)):
        return None
    return r


def ranks_without_offload(seq_len: int, capacity: int) -> int:
    return -(-seq_len // capacity)


@lru_cache(maxsize=65536)
def decide(
    seq_len: int, capacity: int, cost: CostModel, offload: bool = True, host: int | None = None
) -> OffloadDecision:
    """D(s) and r for one sequence: the fewest ranks, then the smallest ratio reaching them.

    Offloading is off when ``offload`` is False, when at most two layers per stage keep
    their activations (the others recomputed), or when no ratio that saves a rank hides its
    copy and fits the host budget ``host`` (token-equivalents per micro-batch; then r = 0,
    D = ceil(s / C)).
    """
    d0 = ranks_without_offload(seq_len, capacity)
    if not offload or d0 <= 1 or cost.activation_layers <= 2 or host == 0:  # recomputed layers keep nothing
        return OffloadDecision(d0, 0.0)
    most = max_tokens(capacity, 1.0, cost.activation_layers)
    if host is not None:
        most = min(most, capacity + host)  # device and host together hold every token once
    d1 = -(-seq_len // most)
    # Scan up from the fewest ranks any ratio allows; the first ring size whose smallest
    # ratio hides is D(s). (No monotonicity is assumed, so the answer is exact for any
    # profile; the scan is short: it stops at once whenever offloading at r = 1 hides.)
    for d in range(d1, d0):
        r = ratio_for_ranks(seq_len, d, capacity, cost, host)
        if r is not None:
            return OffloadDecision(d, r)
    return OffloadDecision(d0, 0.0)
