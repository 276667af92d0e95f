"""Every strategy turns the same batch into a valid Plan that covers every token once."""

import math
from collections import Counter

import pytest

from megatron_bytescale.data.workloads import sample_lengths
from megatron_bytescale.errors import ConfigError
from megatron_bytescale.planner.cost_model import CostModel
from megatron_bytescale.planner.specs import HardwareSpec, ModelSpec
from megatron_bytescale.sim.cluster import Cluster
from megatron_bytescale.sim.megatron_dcp import megatron_dcp_plan, megatron_prebuilt_group
from megatron_bytescale.sim.static_cp import StrategyError, static_cp_degree
from megatron_bytescale.sim.strategies import LATENT_ONLY, STRATEGIES, StrategyInput, make_plan, parse_strategies
from megatron_bytescale.sim.timeline import evaluate

K = 1024

GQA_STRATEGIES = [n for n in STRATEGIES if n not in LATENT_ONLY]  # a GQA model: no latent ring


@pytest.fixture(scope="module")
def setup():
    cluster = Cluster(16, gpus_per_node=4)
    cost = CostModel.analytic(ModelSpec.load("llama-7b"), HardwareSpec.load("h100"))
    lengths = sample_lengths("byted", 768 * K, 64 * K, rng=1)
    assert max(lengths) > 16 * K  # some sequences need rings
    return StrategyInput(lengths, cluster, cost, capacity=8 * K, context=64 * K)


@pytest.fixture(scope="module")
def plans(setup):
    return {name: make_plan(name, setup) for name in GQA_STRATEGIES}


@pytest.mark.parametrize("name", GQA_STRATEGIES)
def test_strategy_plans_are_valid_and_cover_every_token_once(plans, setup, name):
    plan = plans[name]
    plan.validate()  # includes: every token of every sequence exactly once
    assert plan.seq_lens == tuple(setup.seq_lens)
    covered = Counter()
    for mbs in plan.ranks:
        for mb in mbs:
            for p in mb.pieces:
                covered[p.seq_id] += p.tokens
    assert covered == Counter(dict(enumerate(setup.seq_lens)))
    assert plan.meta["strategy"] == name
    assert plan.meta["plan_time_s"] >= 0
    result = evaluate(plan, setup.cluster, setup.cost)
    assert result.timeline.step_time >= result.lower_bound > 0
    assert result.timeline.step_time >= result.critical_path > 0
    t = result.timeline
    assert (t.idle >= -1e-9).all()  # busy + exposed comm + exposed offload fit in the step


def test_static_uses_the_smallest_cp_that_fits_and_balances_dp(plans, setup):
    plan = plans["static"]
    assert plan.meta["cp"] == 8 and plan.meta["dp"] == 2  # 64K / 8K = 8 divides 16
    tokens = plan.tokens_per_rank()
    groups = [sum(tokens[g * 8 : (g + 1) * 8]) for g in range(2)]
    assert abs(groups[0] - groups[1]) <= min(setup.seq_lens)  # equal tokens per DP group
    for r, mbs in enumerate(plan.ranks):  # every micro-batch spans its whole CP group
        for mb in mbs:
            assert mb.ring == tuple(range(r // 8 * 8, r // 8 * 8 + 8))


def test_static_cp_degree():
    assert static_cp_degree(3 * K, K, 12) == 3
    assert static_cp_degree(5 * K, K, 12) == 6  # 5 does not divide 12
    assert static_cp_degree(K, K, 12) == 1
    with pytest.raises(ConfigError, match="needs CP >= 13"):
        static_cp_degree(13 * K, K, 12)


def test_megatron_dcp_comes_from_balanced_cp_scheduler(setup, monkeypatch):
    from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler

    seen = {}
    original = BalancedCPScheduler.get_groups_and_subsamples

    def spy(self, sample_id_seqlens, config):
        seen["total_gpus"] = self.total_hdp_gpus
        seen["capacity"] = self.max_seq_len_per_rank
        seen["result"] = original(self, sample_id_seqlens, config)
        return seen["result"]

    monkeypatch.setattr(BalancedCPScheduler, "get_groups_and_subsamples", spy)
    plan = make_plan("megatron-dcp", setup)
    assert seen["total_gpus"] == 16 and seen["capacity"] == 8 * K
    _, sample_id_groups = seen["result"]
    # each rank runs exactly the scheduler's samples, group after group, one per micro-batch
    for r, mbs in enumerate(plan.ranks):
        expected = [int(sid) for group in sample_id_groups for sid in group[r]]
        assert [mb.pieces[0].seq_id for mb in mbs] == expected
        assert all(len(mb.pieces) == 1 for mb in mbs)
    # a barrier after every group but the last, at the cumulative micro-batch counts
    assert len(plan.barriers) == len(sample_id_groups) - 1
    assert len(sample_id_groups) > 1
    assert plan.barriers[0] == tuple(len(ids) for ids in sample_id_groups[0])
    # CP group sizes are powers of two and at least the samples' memory needs
    for mbs in plan.ranks:
        for mb in mbs:
            p = mb.pieces[0]
            n = p.ring_size
            assert n & (n - 1) == 0
            assert n >= math.ceil(p.seq_len / (8 * K))


def test_megatron_prebuilt_groups():
    assert megatron_prebuilt_group((4, 5, 6, 7), 16)
    assert not megatron_prebuilt_group((2, 3, 4, 5), 16)  # not aligned
    assert megatron_prebuilt_group(tuple(range(12)), 12)  # the whole DP x CP group
    assert not megatron_prebuilt_group(tuple(range(8)), 12)  # 8 is not built for 12 ranks


def test_megatron_dcp_failures_are_reported_not_hidden():
    # a 40-token sample needs 2^ceil(log2(40 / 8)) = 8 CP ranks; there are 4: the scheduler asserts
    with pytest.raises(StrategyError, match="BalancedCPScheduler failed"):
        megatron_dcp_plan([40, 8, 8], Cluster(4), 8, 4)
    with pytest.raises(StrategyError, match="PP=2 is not supported"):
        megatron_dcp_plan([40, 8, 8], Cluster(8, pp=2), 8, 4)


def test_unknown_strategy_names_the_choices():
    assert parse_strategies("static, hdp-balanced") == ["static", "hdp-balanced"]
    with pytest.raises(
        ConfigError,
        match="unknown strategy 'dp-only'; choose from static, megatron-dcp, megatron-dcp-dev, hdp-sharding, "
        "hdp-naive, hdp-balanced, hdp-latent, hdp-auto$",
    ):
        parse_strategies("static,dp-only")


@pytest.mark.parametrize("name", ["static", "hdp-sharding", "hdp-naive", "hdp-balanced"])
def test_strategies_with_pipeline_parallelism(name):
    cluster = Cluster(16, pp=2, gpus_per_node=4)
    cost = CostModel.analytic(ModelSpec.load("llama-7b"), HardwareSpec.load("h100"), pp=2)
    lengths = sample_lengths("github", 512 * K, 64 * K, rng=2)
    x = StrategyInput(lengths, cluster, cost, capacity=8 * K, context=64 * K)
    plan = make_plan(name, x).validate()
    assert plan.num_layers == 16
    result = evaluate(plan, cluster, cost)  # raises if ring micro-batches deadlock under 1F1B
    assert len(result.timeline.ops) == 2 * cluster.d_hdp
    assert result.timeline.step_time >= result.lower_bound
