"""Cluster simulator: turn one global batch into each strategy's Plan and cost every plan
with the same cost model on a simulated cluster (``bytescale simulate``)."""

from .cluster import Cluster
from .strategies import STRATEGIES, StrategyError, StrategyInput, make_plan
from .timeline import Timeline, evaluate, lower_bound, simulate

__all__ = [
    "STRATEGIES",
    "Cluster",
    "StrategyError",
    "StrategyInput",
    "Timeline",
    "evaluate",
    "lower_bound",
    "make_plan",
    "simulate",
]
