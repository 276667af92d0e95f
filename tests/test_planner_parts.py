import dataclasses

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from megatron_bytescale.errors import ConfigError
from megatron_bytescale.planner.balance import Unit, make_buckets, schedule
from megatron_bytescale.planner.placement import Ranks
from megatron_bytescale.planner.sizing.packing import fill_ring_spare, pack_best_fit
from megatron_bytescale.planner.sizing.rings import RingSizer, balanced_target, ring_decisions

from planner_cases import small_cost
from planner_oracles import plain_placement


# ------------------------------------------------------------------ packing
@given(st.lists(st.integers(1, 100), min_size=1, max_size=200), st.integers(100, 300))
def test_best_fit_packs_every_item_once_within_capacity(sizes, capacity):
    bins = pack_best_fit(list(enumerate(sizes)), capacity)
    packed = sorted(i for b in bins for i in b)
    assert packed == list(range(len(sizes)))
    assert all(sum(sizes[i] for i in b) <= capacity for b in bins)
    # any-fit: an item opens a new bin only if no open bin has room, so at most one bin
    # is half empty (else the later one's items would have fitted into the earlier)
    assert sum(1 for b in bins if 2 * sum(sizes[i] for i in b) <= capacity) <= 1


def test_best_fit_chooses_the_tightest_bin():
    # 60 and 50 open two bins (free 40, 50); 40 goes to the 60-bin (tightest), 50 to the other
    bins = pack_best_fit([(0, 60), (1, 50), (2, 40), (3, 50)], 100)
    assert sorted(map(sorted, bins)) == [[0, 2], [1, 3]]


def test_fill_ring_spare_uses_only_the_given_room():
    added, left = fill_ring_spare([30, 10], [(0, 25), (1, 10), (2, 20), (3, 5)])
    assert added == [[0, 3], [1]]
    assert left == [(2, 20)]


# ------------------------------------------------------------------ ring sizing
def test_ring_sizes_are_any_size_at_least_the_memory_floor():
    cost = small_cost()
    lens = [3000, 1001, 777, 250, 120, 90] + [50] * 40
    sizer = RingSizer(100, cost, True, 12, 4)
    target = balanced_target(np.array(lens), sizer)
    rings = ring_decisions(lens, sizer, target)
    assert rings.seq_ids.tolist() == [0, 1, 2, 3, 4]  # every sequence over the capacity, none under
    for sid, size in zip(rings.seq_ids.tolist(), rings.ring_size.tolist()):
        assert sizer.floor(lens[sid]).ranks <= size <= 12
    assert any(size not in (1, 2, 4, 8) for size in rings.ring_size.tolist())  # not powers of two
    naive = ring_decisions(lens, sizer, None)
    assert naive.ring_size.tolist() == [sizer.floor(lens[i]).ranks for i in naive.seq_ids.tolist()]


@given(
    st.lists(st.integers(1, 4000), min_size=1, max_size=40),
    st.floats(0.2, 3.0),
    st.floats(0.2, 3.0),
    st.booleans(),
)
def test_ring_decisions_are_each_sequence_sized_alone(lens, scale_a, scale_b, resized):
    """``ring_decisions`` holds, per sequence over the capacity in id order, its smallest ring
    within the target (``RingSizer.size``) and that ring's two-level group, one decision per
    distinct length (``resize`` applied to each); ``same_rings`` is true exactly where two
    targets give every sequence the same ring size and ratio (the planner then skips the
    second target)."""
    cost = small_cost()
    sizer = RingSizer(100, cost, True, 24, 4)
    base = balanced_target(np.array(lens), sizer)
    resize = (lambda s, n, r, u: (min(24, n + s % 2), r, u)) if resized else None  # odd lengths one rank more
    a, b = (ring_decisions(lens, sizer, base * k, resize) for k in (scale_a, scale_b))
    for rings, k in ((a, scale_a), (b, scale_b)):
        expected = {}  # one sequence at a time: its smallest ring within the target, its two-level group
        for i, s in enumerate(lens):
            if s > 100:
                d, r, _ = sizer.size(s, base * k)
                decided = (d, r, sizer.heads_split(s, d))
                expected[i] = (s, *(resize(s, *decided) if resized else decided))
        columns = (rings.seq_lens, rings.ring_size, rings.ratio, rings.heads_split)
        got = {i: decided for i, *decided in zip(rings.seq_ids.tolist(), *(c.tolist() for c in columns))}
        assert {i: tuple(d) for i, d in got.items()} == expected and list(got) == list(expected)  # in sequence order
    per_sequence = [dict(zip(r.seq_ids.tolist(), zip(r.ring_size.tolist(), r.ratio.tolist()))) for r in (a, b)]
    assert a.same_rings(b) == (per_sequence[0] == per_sequence[1])
    assert a.same_rings(a) and not a.same_rings(None)
    if a.seq_ids.size:  # another ratio alone is another ring decision
        assert not a.same_rings(dataclasses.replace(a, ratio=a.ratio + 0.25))
    floor = ring_decisions(lens, sizer, None)
    assert floor.ring_size.tolist() == [sizer.floor(s).ranks for s in lens if s > 100]


def test_target_is_a_fixed_point_of_the_spread():
    cost = small_cost()
    lens = np.array([4000, 2500, 900] + [60] * 300)
    sizer = RingSizer(100, cost, True, 32, 8)
    t = balanced_target(lens, sizer)
    work = sum(d * tt for d, _, tt in (sizer.size(int(s), t) for s in lens if s > 100))
    work += sum(cost.num_layers * (cost.a1 * s * s + cost.b1 * s + cost.g * s / 100) for s in lens if s <= 100)
    assert work / 32 <= t * (1 + 1e-9)
    lower = t * 0.99  # a slightly smaller target fails one of the tests
    work_lo = sum(d * tt for d, _, tt in (sizer.size(int(s), lower) for s in lens if s > 100))
    work_lo += work - sum(d * tt for d, _, tt in (sizer.size(int(s), t) for s in lens if s > 100))
    held = sum(d for d, _, tt in (sizer.size(int(s), lower) for s in lens if s > 100) if tt > lower / 2)
    floor = max(sizer.fastest(int(s)) for s in lens if s > 100)
    assert work_lo / 32 > lower or held > 32 or lower < floor


# ------------------------------------------------------------------ placement
# (the rules, as the scheduler kernel follows them: tests/test_planner_kernels.py checks it)
def test_small_ring_stays_inside_the_node_that_frees_up_first():
    loads = [5, 5, 5, 5, 1, 9, 1, 1, 2, 2, 2, 2, 3, 0, 0, 7]
    # three free ranks: node 1 can start at 1, node 2 at 2, node 3 at 3, node 0 at 5
    assert plain_placement(loads, 3, 1, 4) == [4, 6, 7]
    # same start, less idle wins: node 1 (nobody waits) over node 0 (rank 1 waits 2)
    assert plain_placement([2, 0, 9, 9, 2, 2, 9, 9] + [9] * 8, 2, 1, 4) == [4, 5]


def test_large_ring_on_an_idle_cluster_takes_whole_consecutive_nodes():
    assert plain_placement([0.0] * 32, 12, 1, 8) == list(range(12))
    assert plain_placement([5.0] * 8 + [0.0] * 24, 16, 1, 8) == list(range(8, 24))
    units = [Unit("ring", (0,), 12, 1.0, 10)]  # the scheduler on an idle cluster: the same ranks
    assert schedule(units, Ranks.of(32, 8), "dp").members[0] == tuple(range(12))


@given(st.lists(st.floats(0, 100), min_size=12, max_size=12), st.integers(1, 12))
def test_placement_returns_distinct_sorted_ranks(loads, size):
    ring = plain_placement(loads, size, 1, 4)
    assert len(set(ring)) == size == len(ring)
    assert ring == sorted(ring)
    if size <= 4:
        assert len({r // 4 for r in ring}) == 1  # one node
    else:  # the earliest possible start among all ranks
        assert np.max(np.array(loads)[ring]) == pytest.approx(np.sort(loads)[size - 1])


def test_cluster_shape_errors():
    with pytest.raises(ConfigError, match="do not fill whole nodes of 8 ranks"):
        Ranks.of(12, 8)
    with pytest.raises(ConfigError, match="ranks_per_node must be at least 1"):
        Ranks.of(8, 0)
    assert Ranks.of(6, 8).ranks_per_node == 6  # fewer ranks than a node: one node


# ------------------------------------------------------------------ balance
def unit(t, size=1, seq=0):
    return Unit("short" if size == 1 else "ring", (seq,), size, float(t), 10)


def test_buckets_hold_about_equal_work_longest_first():
    weights = [50, 20, 10, 10, 5, 5] + [1] * 20
    buckets = make_buckets(list(range(len(weights))), weights, 4)
    assert buckets[0] == [0]  # the longest bucket holds one unit
    assert [u for b in buckets for u in b] == list(range(len(weights)))
    assert len(buckets) <= 4


def test_dp_balance_gives_the_longest_work_to_the_least_loaded_rank():
    units = [unit(t, seq=i) for i, t in enumerate([7, 5, 4, 3, 3, 2, 2])]
    a = schedule(units, Ranks.of(3, 3), "dp")
    # LPT: 7 | 5 | 4; 3 -> the rank at 4, 3 -> the rank at 5; 2, 2 -> the two ranks at 7
    assert sorted(a.clock.tolist()) == [8.0, 9.0, 9.0]
    assert a.runs[0][0] == 0  # every rank starts with its longest unit
    for run in a.runs:
        times = [units[u].time for u in run]
        assert times == sorted(times, reverse=True)


def test_ring_waits_for_its_last_member_and_counts_the_wait():
    units = [unit(4, seq=0), unit(3, size=2, seq=1)]
    a = schedule(units, Ranks.of(2, 2), "dp")
    assert a.members[1] == (0, 1)
    assert sorted(a.clock.tolist()) == [7.0, 7.0]
    assert sorted(a.idle.tolist()) == [0.0, 4.0]


def test_token_mode_balances_tokens_not_time():
    units = [Unit("pack", (0,), 1, 10.0, 100), Unit("pack", (1,), 1, 1.0, 100), Unit("pack", (2,), 1, 1.0, 50)]
    a = schedule(units, Ranks.of(2, 2), "tokens")
    tokens = sorted(sum(units[u].tokens for u in run) for run in a.runs)
    assert tokens == [100, 150]


def test_unknown_balance_mode():
    with pytest.raises(ConfigError, match="unknown balance mode 'lpt'"):
        schedule([unit(1)], Ranks.of(1, 1), "lpt")
