import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_bytescale.errors import BytescaleError, ConfigError
from megatron_bytescale.planner.cost_model import CostModel
from megatron_bytescale.planner.estimate import finish_times, rank_times
from megatron_bytescale.planner.fields import FieldError
from megatron_bytescale.planner.planner import PlannerConfig, plan_step
from megatron_bytescale.planner.sizing.offload import copy_hides, host_capacity
from megatron_bytescale.planner.sizing.rings import memory_floor
from megatron_bytescale.planner.specs import HardwareSpec, ModelSpec

from planner_cases import small_cost


@st.composite
def cases(draw):
    rpn = draw(st.sampled_from([1, 2, 3, 4, 6, 8]))
    if draw(st.booleans()):
        num_ranks = rpn * draw(st.integers(1, 5))
    else:  # fewer ranks than one node
        num_ranks = draw(st.integers(1, rpn))
    capacity = draw(st.integers(8, 200))
    short = draw(st.lists(st.integers(1, capacity), max_size=40))
    exact = [capacity] * draw(st.integers(0, 3))
    # long sequences that fit the cluster without offloading (lengths rarely divide by 2N)
    long = draw(st.lists(st.integers(capacity + 1, capacity * num_ranks), max_size=4)) if num_ranks > 1 else []
    lens = short + exact + long
    if not lens:
        lens = [draw(st.integers(1, capacity))]
    lens = draw(st.permutations(lens))
    config = PlannerConfig(
        num_ranks=num_ranks,
        capacity=capacity,
        ranks_per_node=rpn,
        balance=draw(st.sampled_from(["none", "dp", "pp"])),
        offload=draw(st.booleans()),
        pipeline_stages=draw(st.sampled_from([1, 1, 2, 3])),
        slack=draw(st.sampled_from([0.0, 0.05, 0.2])),
    )
    cost = small_cost(
        bw_offload=draw(st.sampled_from([1e3, 1e6, 1e12])),
        num_layers=draw(st.sampled_from([2, 4, 8])),
        # pinned host bytes per GPU: none, nothing, room for a few tokens, for many (a2 = 1000 B)
        host_memory_bytes=draw(st.sampled_from([math.inf, 0.0, 2e4, 2e5, 2e6])),
    )
    return lens, config, cost


def micro_batch_pairs(mb):
    return sum(p.seq_len**2 / p.ring_size if p.is_distributed else p.seq_len**2 for p in mb.pieces)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_plans_are_valid_for_any_mix_and_cluster_shape(case):
    lens, config, cost = case
    plan = plan_step(lens, config, cost)
    plan.validate()  # every token once, capacity after offload, rings well formed and ordered
    assert plan.meta["strategy"] == ("hdp-naive" if config.balance == "none" else "hdp-balanced")
    assert plan.meta["plan_time_s"] > 0
    rpn = min(config.ranks_per_node, config.num_ranks)
    l = cost.num_layers
    for _rank, mbs in enumerate(plan.ranks):
        for mb in mbs:
            # device memory, in bytes: the last two layers whole, 1 - r of the others
            device = cost.a2 * mb.tokens * (2 + (1 - mb.offload_ratio) * max(0, l - 2))
            assert device <= cost.a2 * l * config.capacity * (1 + 1e-9)
            # host memory, in bytes: r of l - 2 layers, for each micro-batch a 1F1B stage holds
            parked = cost.a2 * mb.tokens * mb.offload_ratio * max(0, l - 2)
            assert parked * config.pipeline_stages <= cost.host_memory_bytes * (1 + 1e-9)
            if mb.offload_ratio > 0:  # offloading only where its copy hides behind compute
                assert config.offload
                assert copy_hides(cost, mb.tokens, micro_batch_pairs(mb), mb.offload_ratio)
            ring = mb.ring
            if ring is not None:
                assert list(ring) == sorted(ring)  # consecutive members are neighbours
                if len(ring) <= rpn:
                    assert len({r // rpn for r in ring}) == 1  # a small ring stays in one node
    for sid, s in enumerate(lens):
        if s <= config.capacity:
            assert plan.ring_sizes()[sid] == 1  # short sequences are never split
    # the reported estimates are the plan's own: busy time plus waits for ring partners
    busy = rank_times(plan, cost, rpn, config.pipeline_stages)
    assert all(e >= b - 1e-9 for e, b in zip(plan.meta["est_rank_time_s"], busy))
    if config.pipeline_stages == 1:
        # ranks that run their micro-batches in plan order finish (no deadlock) when predicted
        done = finish_times(plan, cost, rpn)
        assert np.allclose(done, plan.meta["est_rank_time_s"], rtol=1e-9, atol=1e-12)


def test_single_rank_and_more_ranks_than_tokens():
    cost = small_cost()
    plan = plan_step([5, 7, 3], PlannerConfig(num_ranks=1, capacity=8), cost).validate()
    assert sum(len(mbs) for mbs in plan.ranks) == 2  # 5 + 3 packed, 7 alone
    plan = plan_step([1, 2], PlannerConfig(num_ranks=12, capacity=8, ranks_per_node=4), cost).validate()
    assert sum(1 for mbs in plan.ranks if mbs) <= 2
    plan = plan_step([3], PlannerConfig(num_ranks=12, capacity=1, ranks_per_node=4, offload=False), cost).validate()
    assert plan.ring_sizes() == {0: 3}


def test_sequences_at_capacity_stay_whole_and_alone():
    plan = plan_step([64, 64, 64], PlannerConfig(num_ranks=2, capacity=64, ranks_per_node=2), small_cost()).validate()
    assert plan.ring_sizes() == {0: 1, 1: 1, 2: 1}
    assert all(mb.tokens == 64 for mbs in plan.ranks for mb in mbs)


def test_ring_sizes_are_not_rounded_to_powers_of_two():
    config = PlannerConfig(num_ranks=12, capacity=100, ranks_per_node=4, offload=False, balance="none")
    plan = plan_step([700], config, small_cost()).validate()
    assert plan.ring_sizes()[0] == 7  # the memory floor ceil(700 / 100), not 8
    # balanced: the sequence is all the work, so it spreads over all 12 ranks, not 8 or 16
    plan = plan_step([700], PlannerConfig(num_ranks=12, capacity=100, ranks_per_node=4), small_cost()).validate()
    assert plan.ring_sizes()[0] == 12


def test_offloading_saves_ranks_only_with_fast_pcie():
    lens = [3000]
    config = PlannerConfig(num_ranks=8, capacity=500, ranks_per_node=8, balance="none")
    fast = plan_step(lens, config, small_cost(bw_offload=1e12)).validate()
    slow = plan_step(lens, config, small_cost(bw_offload=1e2)).validate()
    assert fast.ring_sizes()[0] == 2 and {mb.offload_ratio for mbs in fast.ranks for mb in mbs} == {1.0}
    assert slow.ring_sizes()[0] == 6 and {mb.offload_ratio for mbs in slow.ranks for mb in mbs} == {0.0}


# -------------------------------------------------------------- balance quality
def byted_like_small(rng, capacity=8192):
    """Few 128K-1M sequences among many short ones (<= 4K), as in Byted data."""
    long = [1 << 20, 600_000, 300_000, 200_000, 131_072, 131_072, 70_000, 40_000, 20_000, 12_000]
    short = rng.integers(128, 4097, size=1200).tolist()
    return long + short


@pytest.fixture(scope="module")
def llama():
    return CostModel.analytic(ModelSpec.load("llama-7b"), HardwareSpec.load("h100"))


@pytest.mark.parametrize("balance", ["dp", "pp"])
def test_balance_beats_naive_on_skewed_batches(balance, llama):
    lens = byted_like_small(np.random.default_rng(1))
    naive = plan_step(lens, PlannerConfig(num_ranks=64, capacity=8192, balance="none"), llama).validate()
    tuned = plan_step(lens, PlannerConfig(num_ranks=64, capacity=8192, balance=balance), llama).validate()
    t_naive = np.array(finish_times(naive, llama, 8))
    t_tuned = np.array(finish_times(tuned, llama, 8))
    assert t_tuned.max() / t_tuned.mean() < 1.1 < t_naive.max() / t_naive.mean()
    # (with the host budget hdp-naive's rings are wider than at unbounded r = 1, so the gap
    # is narrower than it was: 47.5 s against 73.3 s here)
    assert t_tuned.max() < 0.7 * t_naive.max()
    # within 10% of the better of: all compute spread evenly, the fastest ring of the longest
    bound = max(tuned.meta["compute_bound_s"], tuned.meta["target_time_s"])
    assert t_tuned.max() <= 1.1 * bound


def test_naive_packs_short_sequences_into_ring_spare_room():
    # 150 tokens over 2 ranks (75 + 75, 25 spare each): 20 and 25 fill the spare, 30 does not fit
    config = PlannerConfig(num_ranks=4, capacity=100, ranks_per_node=4, balance="none", offload=False)
    plan = plan_step([150, 30, 20, 25], config, small_cost()).validate()
    ring_mbs = [mb for mbs in plan.ranks for mb in mbs if mb.ring is not None]
    assert len(ring_mbs) == 2
    assert sorted(sorted(p.seq_id for p in mb.pieces if not p.is_distributed) for mb in ring_mbs) == [[2], [3]]
    assert all(mb.tokens <= 100 for mb in ring_mbs)


def test_naive_balances_tokens(llama):
    lens = byted_like_small(np.random.default_rng(2))
    plan = plan_step(lens, PlannerConfig(num_ranks=64, capacity=8192, balance="none"), llama).validate()
    tokens = np.array(plan.tokens_per_rank())
    largest = max(mb.tokens for mbs in plan.ranks for mb in mbs)
    # greedy token balance: each unit goes to the ranks with the fewest tokens, so ranks
    # differ by at most one micro-batch
    assert tokens.max() - tokens.min() <= largest
    assert plan.meta["target_time_s"] is None  # rings at the memory floor: no time target


@pytest.mark.parametrize("offload", [False, True])
def test_naive_rings_sit_at_the_memory_floor_with_or_without_offload(offload, llama):
    # offload=False is the simulator's hdp-sharding ablation: rings of ceil(s / C), nothing
    # offloaded, micro-batches given out by tokens; offload=True is hdp-naive
    lens = byted_like_small(np.random.default_rng(4))
    config = PlannerConfig(num_ranks=128, capacity=8192, balance="none", offload=offload)
    plan = plan_step(lens, config, llama).validate()
    sizes = plan.ring_sizes()
    long_ids = [i for i, s in enumerate(lens) if s > 8192]
    for i in long_ids:
        assert sizes[i] == memory_floor(lens[i], 8192, llama, offload, 128, host_capacity(llama)).ranks
    ratios = {mb.offload_ratio for mbs in plan.ranks for mb in mbs}
    if offload:  # offloading shrinks the rings of the longest sequences
        assert max(ratios) > 0 and all(sizes[i] < -(-lens[i] // 8192) for i in long_ids[:4])
    else:
        assert ratios == {0.0} and all(sizes[i] == -(-lens[i] // 8192) for i in long_ids)
        tokens = np.array(plan.tokens_per_rank())
        assert tokens.max() - tokens.min() <= max(mb.tokens for mbs in plan.ranks for mb in mbs)
    assert plan.meta["strategy"] == "hdp-naive" and plan.meta["offload"] is offload
    assert plan.meta["target_time_s"] is None


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("offload", [False, True])
def test_naive_and_sharding_plans_run_through_pipelines(pp, offload):
    # the simulator's GitHub case that deadlocked under 1F1B (hdp-sharding, PP=2)
    from megatron_bytescale.data.workloads import sample_lengths
    from megatron_bytescale.sim.cluster import Cluster
    from megatron_bytescale.sim.timeline import simulate

    cost = CostModel.analytic(ModelSpec.load("llama-7b"), HardwareSpec.load("h100"), pp=pp)
    lens = sample_lengths("github", 512 * 1024, 64 * 1024, rng=2)
    cluster = Cluster(32, pp=pp, gpus_per_node=4)
    config = PlannerConfig(
        cluster.d_hdp, 8192, cluster.hdp_per_node, balance="none", offload=offload, pipeline_stages=pp
    )
    plan = plan_step(lens, config, cost).validate()
    simulate(plan, cluster, cost)  # raises PlanError if the plan deadlocks
    if not offload:  # still at the memory floor, nothing offloaded, even if rings were placed again
        assert all(plan.ring_sizes()[i] == -(-s // 8192) for i, s in enumerate(lens) if s > 8192)
        assert {mb.offload_ratio for mbs in plan.ranks for mb in mbs} == {0.0}


def test_pipeline_stages_count_in_the_estimate(llama):
    lens = byted_like_small(np.random.default_rng(3))
    one = plan_step(lens, PlannerConfig(num_ranks=64, capacity=8192, pipeline_stages=1), llama)
    four = plan_step(lens, PlannerConfig(num_ranks=64, capacity=8192, pipeline_stages=4), llama)
    assert four.validate().meta["est_time_max_s"] > one.meta["est_time_max_s"]


# ------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "lens, config, message",
    [
        ([], PlannerConfig(4, 8), "empty batch"),
        ([3, 0, 2], PlannerConfig(4, 8), r"sequence 1 has length 0: lengths must be positive"),
        ([3, -5], PlannerConfig(4, 8), r"sequence 1 has length -5"),
        ([2.5], PlannerConfig(4, 8), "whole token counts"),
        ([3], PlannerConfig(4, 0), r"capacity must be a whole number >= 1, got 0: the tokens one rank holds"),
        ([3], PlannerConfig(0, 8), "num_ranks must be a whole number >= 1"),
        ([3], PlannerConfig(12, 8, ranks_per_node=8), "do not fill whole nodes of 8 ranks"),
        (
            [3],
            PlannerConfig(4, 8, ranks_per_node=0),
            "ranks_per_node must be a whole number >= 1, got 0: the HDP ranks per node",
        ),
        ([3], PlannerConfig(4, 8, balance="lpt"), r"unknown balance mode 'lpt'; choose one of none, dp, pp"),
        ([3], PlannerConfig(4, 8, slack=1.5), r"slack must be in \[0, 1\)"),
        ([3], PlannerConfig(4, 8, pipeline_stages=0), "pipeline_stages must be a whole number >= 1"),
        (
            [100],
            PlannerConfig(4, 8, ranks_per_node=4, offload=False),
            r"capacity too small: sequence of 100 tokens needs 13 ranks at capacity 8, only 4 ranks; "
            r"raise capacity, enable offload, or add GPUs \(num_ranks\)",
        ),
        (
            [100],
            PlannerConfig(2, 8, ranks_per_node=2),
            r"capacity too small: sequence of 100 tokens needs 4 ranks at capacity 8 with offloading, only 2 ranks; "
            r"raise capacity, or add GPUs \(num_ranks\)",
        ),
    ],
)
def test_bad_input_names_the_problem_and_the_fix(lens, config, message):
    with pytest.raises(ConfigError, match=message):
        plan_step(lens, config, small_cost(num_layers=8))
    assert issubclass(ConfigError, BytescaleError)


def test_the_planners_errors_name_fields_that_a_caller_spells_as_its_flags():
    """The planner names ``PlannerConfig`` fields; ``renamed`` gives the same error with each
    field spelled as a command line's flag (the commands and the Megatron glue do so)."""
    with pytest.raises(FieldError) as caught:
        plan_step([100], PlannerConfig(4, 8, ranks_per_node=4, offload=False), small_cost(num_layers=8))
    flags = {"capacity": "--hdp-token-capacity", "offload": "--hdp-selective-offload"}
    renamed = caught.value.renamed(flags)
    assert type(renamed) is ConfigError
    assert str(renamed).endswith("raise --hdp-token-capacity, enable --hdp-selective-offload, or add GPUs (num_ranks)")
    with pytest.raises(FieldError) as caught:
        plan_step([3], PlannerConfig(4, 8, slack=1.5, balance="{odd}"), small_cost())
    assert str(caught.value.renamed({"balance": "--balance"})).startswith("unknown --balance mode '{odd}'")


def test_rescaled_target_when_rigid_rings_leave_no_room(llama, monkeypatch):
    # a 1.2M ring that fits the first target on all 96 ranks leaves no room for three long
    # single-rank sequences; a larger target gives the ring fewer ranks and them their own
    from megatron_bytescale.planner import search

    lens = [1_200_000, 60_000, 50_000, 40_000]
    config = PlannerConfig(num_ranks=96, capacity=8192)
    # the long ones fit one rank each at r ~ 1: no host budget, copies that hide
    llama = llama.with_overrides(host_memory_bytes=math.inf, bw_d2h=1e12, bw_h2d=1e12)
    tuned = plan_step(lens, config, llama).validate()
    monkeypatch.setattr(search, "RETARGET", (1.0,))
    first = plan_step(lens, config, llama).validate()
    assert first.ring_sizes()[0] == 96 and tuned.ring_sizes()[0] < 96
    assert tuned.meta["target_scale"] != 1.0
    assert tuned.meta["est_time_max_s"] < 0.85 * first.meta["est_time_max_s"]


def test_plan_step_leaves_the_garbage_collector_as_it_found_it():
    """Planning pauses the collector and moves what it made to the oldest generation (no
    walk of the young one on return); it must leave the collector on, nothing frozen, and
    leave it off (untouched) when the caller had turned it off or frozen objects."""
    import gc

    lengths = [300, 5000, 70, 1200, 40, 2500]
    config = PlannerConfig(num_ranks=4, capacity=1024, balance="dp")
    assert gc.isenabled()
    plan = plan_step(lengths, config, small_cost())
    assert gc.isenabled() and gc.get_freeze_count() == 0
    plan.validate()
    gc.disable()
    try:
        plan_step(lengths, config, small_cost())
        assert not gc.isenabled()
    finally:
        gc.enable()
    frozen = [object() for _ in range(3)]
    gc.freeze()
    try:
        before = gc.get_freeze_count()
        plan_step(lengths, config, small_cost())
        # untouched: an unfreeze would drop the count to 0, a freeze raise it (threads left by
        # earlier tests of the session may free frozen objects meanwhile: it may fall a little)
        assert 0 < gc.get_freeze_count() <= before and gc.isenabled()
    finally:
        gc.unfreeze()
    del frozen
