"""Pure-Python planning: cost model, sharding, offload policy, balance scheduler, the Plan."""

from .cost_model import CostModel
from .plan import MicroBatch, Piece, Plan, resident_fraction
from .planner import PlannerConfig, plan_step
from .specs import HardwareSpec, ModelSpec
from .zigzag import zigzag_ranges

__all__ = [
    "CostModel",
    "HardwareSpec",
    "MicroBatch",
    "ModelSpec",
    "Piece",
    "Plan",
    "PlannerConfig",
    "plan_step",
    "resident_fraction",
    "zigzag_ranges",
]
