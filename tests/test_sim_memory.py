"""No plan the simulator costs needs more device or host memory than the cluster has: random
batches and cluster shapes, every HDP strategy, checked on the simulator's own byte counts."""

import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_bytescale.planner.contract import resident_fraction
from megatron_bytescale.sim.cluster import Cluster
from megatron_bytescale.sim.strategies import StrategyInput, make_plan
from megatron_bytescale.sim.timeline import evaluate

from planner_cases import small_cost


@st.composite
def shapes(draw):
    per_node = draw(st.sampled_from([2, 4, 8]))
    pp = draw(st.sampled_from([1, 1, 2]))
    gpus = per_node * pp * draw(st.integers(1, 3))  # each stage's ranks fill whole nodes
    capacity = draw(st.integers(32, 256))
    ranks = gpus // pp
    lens = draw(st.lists(st.integers(1, capacity), min_size=1, max_size=30))
    lens += draw(st.lists(st.integers(capacity + 1, capacity * ranks), min_size=1, max_size=3)) if ranks > 1 else []
    layers = draw(st.sampled_from([4, 8]))
    # bytes per GPU; a2 = 1000 B per token and layer, so 2e5-1e6 binds at these capacities
    host = draw(st.sampled_from([math.inf, 0.0, 2e5, 1e6]))
    cost = small_cost(bw_offload=draw(st.sampled_from([1e6, 1e12, 1e12])), num_layers=layers, host_memory_bytes=host)
    return Cluster(gpus, 1, pp, per_node), lens, capacity, cost


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shapes(), st.sampled_from(["hdp-naive", "hdp-balanced"]))
def test_no_simulated_plan_exceeds_device_or_host_memory(shape, strategy):
    cluster, lens, capacity, cost = shape
    plan = make_plan(strategy, StrategyInput(lens, cluster, cost, capacity, max(lens))).validate()
    result = evaluate(plan, cluster, cost)
    assert result.host_bytes_max_gpu <= cost.host_memory_bytes * (1 + 1e-9)
    if cost.host_memory_bytes == 0:
        assert result.offload_bytes == 0
    for mbs in plan.ranks:
        for mb in mbs:
            device = cost.act_bytes(mb.tokens) * cost.num_layers * resident_fraction(mb.offload_ratio, cost.num_layers)
            assert device <= cost.act_bytes(capacity) * cost.num_layers * (1 + 1e-9)
