import math

from hypothesis import given, settings, strategies as st

from megatron_bytescale.planner.offload_policy import (
    RATIO_STEP,
    copy_hides,
    decide,
    max_tokens,
    ratio_for_share,
    share_pairs,
)
from megatron_bytescale.planner.plan import resident_fraction

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


def clearly_feasible(s, d, capacity, cost):
    """Independent of the policy's code: ring size d works with room to spare if the real
    smallest fitting ratio is at least one ratio step below the largest that hides."""
    l = cost.num_layers
    share = math.ceil(s / d)
    if share <= capacity:
        return True
    r_fit = 1 - (l * capacity / share - 2) / (l - 2)  # share * resident_fraction(r) = C
    r_hide = cost.layer_time(share, s * s / d) * cost.bw_offload / cost.act_bytes(share)
    return r_fit + 2 * RATIO_STEP <= min(1.0, r_hide)


@settings(max_examples=60, deadline=None)
@given(
    s=st.integers(1, 4000),
    capacity=st.integers(16, 600),
    layers=st.integers(2, 12),
    bw=st.sampled_from([1e2, 1e6, 1e7, 1e8, 1e12]),
)
def test_decision_meets_both_constraints_and_is_minimal(s, capacity, layers, bw):
    cost = small_cost(bw_offload=bw, num_layers=layers)
    d = decide(s, capacity, cost, True)
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
        # the smallest ratio reaching this ring size
        assert share * resident_fraction(max(0.0, d.ratio - RATIO_STEP), layers) > capacity
    if layers > 2:  # no smaller ring would clearly have worked
        assert not any(clearly_feasible(s, k, capacity, cost) for k in range(1, d.ranks))


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


def test_copy_hides_per_rank_share():
    cost = small_cost(bw_offload=1e6)
    # share of 100 tokens, pairs 1e4: compute 1e-2 + 1e-2 + 1e-4; copy r * 1e5 / 1e6
    assert copy_hides(cost, 100, 1e4, 0.2)
    assert not copy_hides(cost, 100, 1e4, 0.21)
    assert copy_hides(cost, 100, 1e4, 0.0)
