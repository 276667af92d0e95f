"""sim/elastic.py: what a restart after losing nodes keeps, for HDP and for the static mesh."""

import numpy as np
import pytest

from megatron_bytescale.data.workloads import sample_lengths
from megatron_bytescale.planner.cost_model import CostModel
from megatron_bytescale.planner.specs import HardwareSpec, ModelSpec
from megatron_bytescale.sim.elastic import compare, hdp_restart_gpus, static_restart_gpus


@pytest.mark.parametrize("lost, hdp, static", [(0, 1024, 1024), (1, 1016, 768), (2, 1008, 768), (8, 960, 768)])
def test_llama_7b_on_1024_gpus(lost, hdp, static):
    # TP 1, PP 1: HDP keeps every survivor; static keeps whole DP groups of CP = 256
    assert hdp_restart_gpus(1024, 1, 1, 8, lost) == hdp
    assert static_restart_gpus(1024, 1, 1, 8, lost, cp=256) == static


@pytest.mark.parametrize("lost, hdp", [(0, 8192), (1, 8160), (2, 8160), (8, 8128)])
def test_llama_70b_tp8_pp4_on_8192_gpus(lost, hdp):
    # a pipeline is 4 nodes (TP 8 x PP 4 = 32 GPUs): HDP rounds the survivors down to whole
    # pipelines; static's one DP group of CP = 256 pipelines is all 8,192 GPUs, so any loss stops it
    assert hdp_restart_gpus(8192, 8, 4, 8, lost) == hdp
    assert static_restart_gpus(8192, 8, 4, 8, lost, cp=256) == (8192 if lost == 0 else 0)


def test_compare_costs_the_same_batches_on_every_restart():
    hw = HardwareSpec.load("h100")
    cost = CostModel.analytic(ModelSpec.load("llama-7b"), hw)
    rng = np.random.default_rng(0)
    batches = [sample_lengths("byted", 1 << 20, 128 << 10, rng) for _ in range(2)]
    rows = compare(
        batches, gpus=64, tp=1, pp=1, gpus_per_node=8, cost=cost, capacity=8 << 10, context=128 << 10, lost=[1, 7]
    )
    assert [r["lost_nodes"] for r in rows] == [0, 1, 7]
    assert [r["hdp"].gpus for r in rows] == [64, 56, 8] and [r["static"].gpus for r in rows] == [64, 48, 0]
    assert rows[0]["cp"] == 16
    for r in rows:
        assert r["hdp"].tokens == [sum(b) for b in batches] and len(r["hdp"].step_times) == 2
    assert rows[2]["static"].throughput == 0.0 and "survivors hold none" in rows[2]["static"].error
    # fewer GPUs, less throughput; HDP on 56 GPUs beats static on 48 (and on all 64)
    assert rows[0]["hdp"].throughput > rows[1]["hdp"].throughput > rows[2]["hdp"].throughput > 0
    assert rows[1]["hdp"].throughput > rows[1]["static"].throughput > 0
