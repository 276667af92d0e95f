import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_bytescale.planner.contract import resident_fraction
from megatron_bytescale.planner.sizing.offload import (
    RATIO_STEP,
    copy_exposure,
    copy_hides,
    decide,
    host_capacity,
    host_tokens,
    max_tokens,
    ratio_for_share,
    share_pairs,
)

from planner_cases import small_cost


@given(st.integers(1, 10_000), st.floats(0, 1), st.integers(1, 80))
def test_max_tokens_is_the_validators_capacity_rule(capacity, ratio, layers):
    t = max_tokens(capacity, ratio, layers)
    frac = resident_fraction(ratio, layers)
    assert t * frac <= capacity
    assert (t + 1) * frac > capacity


@given(st.integers(1, 5000), st.integers(1, 50_000), st.integers(3, 64))
def test_ratio_for_share_is_the_smallest_that_fits(capacity, tokens, layers):
    r = ratio_for_share(tokens, capacity, layers)
    if tokens <= capacity:
        assert r == 0.0
        return
    if r is None:  # even r = 1 keeps two layers: too many tokens
        assert tokens * resident_fraction(1.0, layers) > capacity
        return
    assert 0 < r <= 1
    assert tokens * resident_fraction(r, layers) <= capacity
    assert tokens * resident_fraction(max(0.0, r - RATIO_STEP), layers) > capacity


def clearly_feasible(s, d, capacity, cost, host=None):
    """Independent of the policy's code: ring size d works with room to spare if the real
    smallest fitting ratio is at least one ratio step below the largest that hides (D2H
    behind the forward, H2D behind the backward) and the largest the host budget allows."""
    l = cost.num_layers
    share = math.ceil(s / d)
    if share <= capacity:
        return True
    r_fit = 1 - (l * capacity / share - 2) / (l - 2)  # share * resident_fraction(r) = C
    t = cost.layer_time(share, s * s / d)
    act = cost.act_bytes(share)
    f = cost.forward_share
    r_hide = min(f * t * cost.bw_d2h / act, (1 - f) * t * cost.bw_h2d / act)
    r_host = 1.0 if host is None else host * l / (share * (l - 2))  # share * r * (l-2)/l = H
    return r_fit + 2 * RATIO_STEP <= min(1.0, r_hide, r_host - 2 * RATIO_STEP)


@settings(max_examples=60, deadline=None)
@given(
    s=st.integers(1, 4000),
    capacity=st.integers(16, 600),
    layers=st.integers(2, 12),
    bw=st.sampled_from([1e2, 1e6, 1e7, 1e8, 1e12]),
    host=st.sampled_from([None, 0, 10, 200, 5000]),
)
def test_decision_meets_both_constraints_and_is_minimal(s, capacity, layers, bw, host):
    cost = small_cost(bw_offload=bw, num_layers=layers)
    d = decide(s, capacity, cost, True, host)
    d0 = math.ceil(s / capacity)
    share = math.ceil(s / d.ranks)
    assert 1 <= d.ranks <= d0
    assert share * resident_fraction(d.ratio, layers) <= capacity  # fits after offload
    if d.ratio == 0.0:
        assert d.ranks == d0
    else:
        assert 0 < d.ratio <= 1
        assert d.ranks < d0  # r_min: offloading only when it saves a rank
        assert copy_hides(cost, share, share_pairs(s, d.ranks), d.ratio)  # the copy hides
        assert host is None or host_tokens(share, d.ratio, layers) <= host  # the host holds it
        # the smallest ratio reaching this ring size
        assert share * resident_fraction(max(0.0, d.ratio - RATIO_STEP), layers) > capacity
    if layers > 2:  # no smaller ring would clearly have worked
        assert not any(clearly_feasible(s, k, capacity, cost, host) for k in range(1, d.ranks))


def test_offload_lowers_ranks_only_when_the_copy_hides():
    s, capacity = 3000, 500
    fast = decide(s, capacity, small_cost(bw_offload=1e12), True)
    slow = decide(s, capacity, small_cost(bw_offload=1e2), True)
    off = decide(s, capacity, small_cost(bw_offload=1e12), False)
    assert (off.ranks, off.ratio) == (6, 0.0)
    assert (slow.ranks, slow.ratio) == (6, 0.0)  # PCIe too slow: no ratio hides
    # 6 layers, r = 1 keeps 2/6: a rank holds 1500 tokens -> 2 ranks
    assert fast.ranks == 2 and fast.ratio == 1.0


def test_exact_r_min_differs_from_the_designs_closed_form():
    # s = 9K, C = 8K, l = 32: the design's r_min = l*C / ((l-2)*s) = 0.95, but 0.12 already
    # fits the sequence on one rank; we take the exact smallest ratio (documented choice)
    cost = small_cost(bw_offload=1e12, num_layers=32)
    d = decide(9216, 8192, cost, True)
    design_r_min = 32 * 8192 / (30 * 9216)
    assert d.ranks == 1
    assert 0.1 < d.ratio < 0.15 < design_r_min


def test_two_layers_never_offload():
    d = decide(1000, 400, small_cost(num_layers=2), True)
    assert (d.ranks, d.ratio) == (3, 0.0)


def test_copy_hides_per_rank_share_and_per_direction():
    cost = small_cost(bw_offload=1e6)
    # share of 100 tokens, pairs 1e4: a layer computes 1e-2 + 1e-2 + 1e-4 = 20.1 ms, its
    # forward a third (6.7 ms). Copy r * Act(100) = r * 1e5 B at 1e6 B/s each way: the
    # D2H copy must fit the forward, r <= 0.067 (behind the whole layer it was r <= 0.201)
    assert copy_hides(cost, 100, 1e4, 0.066)
    assert not copy_hides(cost, 100, 1e4, 0.068)
    assert not copy_hides(cost, 100, 1e4, 0.2)
    assert copy_hides(cost, 100, 1e4, 0.0)
    # r = 0.2: 20 ms each way against 6.7 ms forward and 13.4 ms backward
    fwd, bwd = copy_exposure(cost, 100, 1e4, 0.2)
    assert fwd == pytest.approx(0.020 - 0.0201 / 3)
    assert bwd == pytest.approx(0.020 - 0.0201 * 2 / 3)
    # a slow H2D link alone makes the backward copy the bound
    slow_h2d = cost.with_overrides(bw_d2h=1e9, bw_h2d=1e6)
    assert copy_exposure(slow_h2d, 100, 1e4, 0.2)[0] == 0.0
    assert copy_exposure(slow_h2d, 100, 1e4, 0.2)[1] == pytest.approx(0.020 - 0.0201 * 2 / 3)


def test_host_budget_is_counted_in_token_equivalents():
    # LLaMA-7B-like: 32 layers, 119,296 activation bytes per token and layer, 128 GB per GPU:
    # 128e9 / (32 * 119,296) = 33,530 token-equivalents; two 1F1B micro-batches in flight halve it
    cost = small_cost(num_layers=32, a2=119_296.0, host_memory_bytes=128e9)
    assert host_capacity(cost) == 33_530
    assert host_capacity(cost, in_flight=2) == 16_765
    assert host_capacity(small_cost()) is None  # no budget given: unbounded
    # 131,072 tokens at r = 1 park 30/32 of them: 122,880 token-equivalents = 469 GB
    assert host_tokens(131_072, 1.0, 32) == 122_880
    assert pytest.approx(469e9, rel=1e-3) == 122_880 * 32 * 119_296


def test_host_budget_sets_how_many_ranks_a_long_sequence_needs():
    # 2M tokens, capacity 8K, 32 layers, fast PCIe: without a host budget r = 1 puts
    # 131,072 tokens on each of 16 ranks; with 33,530 token-equivalents of host memory a
    # rank holds at most 8,192 + 33,530 = 41,722 tokens, so at least 51 ranks
    s, cap = 2 * 1024 * 1024, 8192
    cost = small_cost(num_layers=32, a2=119_296.0, bw_offload=1e15)
    assert decide(s, cap, cost, True).ranks == 16
    d = decide(s, cap, cost, True, 33_530)
    assert d.ranks == math.ceil(s / (8192 + 33_530)) == 51
    share = math.ceil(s / d.ranks)
    assert host_tokens(share, d.ratio, 32) <= 33_530
    assert share * resident_fraction(d.ratio, 32) <= cap
    assert decide(s, cap, cost, True, 0).ranks == 256  # no host memory: no offloading
