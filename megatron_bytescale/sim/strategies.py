"""The strategies the simulator compares. Each turns one global batch into a Plan, so one
costing engine (``timeline.py``) evaluates all of them with the same cost model.

* ``static``       Megatron's static DP x CP mesh (``static_cp.py``).
* ``megatron-dcp`` Megatron's hybrid / dynamic CP as released: megatron-core 0.16.1's own
                   BalancedCPScheduler (``megatron_dcp.py``).
* ``megatron-dcp-dev`` Megatron's dynamic CP on its development branch: its packing
                   DefaultDynamicCPScheduler, imported from a Megatron-LM tree given by path
                   (``megatron_dcp_dev.py``), with pipelines, virtual stages and EP.
* ``hdp-sharding`` HDP rings sized to memory without offloading, no balancing: what dynamic
                   communication alone buys (an ablation step, not one of the four headline rows).
* ``hdp-naive``    HDP from our planner with selective offloading, no balancing
                   (``balance="none"``): rings at the offload memory floor.
* ``hdp-balanced`` HDP from our planner with the balance scheduler (``"dp"``; ``"pp"`` when
                   PP > 1).
* ``hdp-latent``   ``hdp-balanced`` whose plain rings carry a multi-latent attention
                   model's latent instead of K and V (``Piece.transport``), each member
                   re-expanding what it receives: MLA models only.
* ``hdp-auto``     ``hdp-balanced`` with each plain ring carrying whichever of the two its
                   sequences run faster with (the planner's ``ring_transport="auto"``): MLA only.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..errors import ConfigError
from ..planner.contract import Plan
from ..planner.cost_model import CostModel
from .cluster import Cluster
from .megatron_dcp import megatron_dcp_plan
from .megatron_dcp_dev import DEV_TREE_ENV, dev_tree, megatron_dcp_dev_plan
from .static_cp import StrategyError, static_plan

# the planner's fields as ``bytescale simulate`` spells them (the planner's errors name fields)
FLAGS = {
    "capacity": "--capacity",
    "num_ranks": "--gpus",
    "ranks_per_node": "--gpus-per-node",
    "offload": "offloading",
    "host_memory_bytes": "--host-memory-per-gpu",
    "pipeline_stages": "--pp",
    "virtual_stages": "--vpp",
    "expert_parallel": "--ep",
    "pipeline_schedule": "--pipeline-schedule",
}


@dataclass(frozen=True)
class StrategyInput:
    seq_lens: Sequence[int]
    cluster: Cluster
    cost: CostModel
    capacity: int
    context: int
    pipeline_schedule: str = "1f1b"  # HDP plans with PP (PlannerConfig.pipeline_schedule)
    virtual_stages: int = 1  # model chunks per pipeline device (VPP), the same for every strategy
    megatron_dev: str | None = None  # the Megatron-LM dev tree megatron-dcp-dev imports its scheduler from


def _with_chunks(plan: Plan, x: StrategyInput) -> Plan:
    """A baseline's plan run with ``x``'s virtual stages: Megatron's interleaved 1F1B over its
    fixed micro-batches (``contract.interleaved_order``), so VPP is compared like for like."""
    plan.virtual_stages = x.virtual_stages
    return plan


def _static(x: StrategyInput) -> Plan:
    return _with_chunks(static_plan(x.seq_lens, x.cluster, x.capacity, x.context, x.cost.num_layers), x)


def _megatron_dcp(x: StrategyInput) -> Plan:
    return _with_chunks(megatron_dcp_plan(x.seq_lens, x.cluster, x.capacity, x.cost.num_layers), x)


def _megatron_dcp_dev(x: StrategyInput) -> Plan:
    tree = dev_tree(x.megatron_dev)
    if tree is None:
        raise StrategyError(
            f"megatron-dcp-dev: name a Megatron-LM dev tree with --megatron-dev PATH or ${DEV_TREE_ENV}"
        )
    plan = megatron_dcp_dev_plan(x.seq_lens, x.cluster, x.capacity, x.cost.num_layers, tree, x.virtual_stages)
    return _with_chunks(plan, x)


def _hdp(
    balance_if_dp: str, balance_if_pp: str, name: str, offload: bool = True, transport: str = "kv"
) -> Callable[[StrategyInput], Plan]:
    def make(x: StrategyInput) -> Plan:
        if transport != "kv" and len(x.cost.ring_transports) == 1:
            raise StrategyError(f"{name}: rings carrying the latent need a multi-latent attention model")
        try:
            from ..planner.fields import FieldMessage
            from ..planner.planner import PlannerConfig, plan_step
        except ImportError as exc:
            raise StrategyError(
                f"{name}: the HDP planner (megatron_bytescale.planner.planner) is not available: {exc}"
            ) from None
        config = PlannerConfig(
            num_ranks=x.cluster.d_hdp,
            capacity=x.capacity,
            ranks_per_node=x.cluster.hdp_per_node,
            balance=balance_if_pp if x.cluster.pp > 1 else balance_if_dp,
            pipeline_stages=x.cluster.pp,
            offload=offload,
            pipeline_schedule=x.pipeline_schedule,
            expert_parallel=x.cluster.ep,
            virtual_stages=x.virtual_stages,
            ring_transport=transport,
        )
        t0 = time.perf_counter()
        try:
            plan = plan_step(list(x.seq_lens), config, x.cost)
        except FieldMessage as exc:  # the planner names its fields: spelled as simulate's flags
            raise exc.renamed(FLAGS) from None
        wall = time.perf_counter() - t0
        plan.meta = {**plan.meta, "strategy": name}
        plan.meta.setdefault("plan_time_s", wall)
        return plan

    return make


STRATEGIES: dict[str, Callable[[StrategyInput], Plan]] = {
    "static": _static,
    "megatron-dcp": _megatron_dcp,
    "megatron-dcp-dev": _megatron_dcp_dev,
    "hdp-sharding": _hdp("none", "none", "hdp-sharding", offload=False),
    "hdp-naive": _hdp("none", "none", "hdp-naive"),
    "hdp-balanced": _hdp("dp", "pp", "hdp-balanced"),
    "hdp-latent": _hdp("dp", "pp", "hdp-latent", transport="latent"),
    "hdp-auto": _hdp("dp", "pp", "hdp-auto", transport="auto"),
}
LATENT_ONLY = ("hdp-latent", "hdp-auto")  # strategies of multi-latent attention models only
NEEDS_DEV_TREE = ("megatron-dcp-dev",)  # strategies that import a Megatron-LM dev tree


def parse_strategies(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in STRATEGIES]
    if unknown or not names:
        raise ConfigError(
            f"unknown strategy {', '.join(map(repr, unknown)) or '(none given)'}; choose from {', '.join(STRATEGIES)}"
        )
    return names


def make_plan(name: str, x: StrategyInput) -> Plan:
    """The strategy's Plan for one batch; StrategyError if the strategy cannot plan it."""
    if name not in STRATEGIES:
        parse_strategies(name)
    return STRATEGIES[name](x)


__all__ = ["STRATEGIES", "StrategyError", "StrategyInput", "make_plan", "parse_strategies"]
