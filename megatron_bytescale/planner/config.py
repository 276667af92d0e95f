"""The planner's configuration: the cluster's HDP ranks and the planning choices."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .balance import BALANCE_MODES
from .contract.slots import check_expert_parallel
from .fields import FieldError, literal
from .placement import check_shape

PIPELINE_SCHEDULES = ("1f1b", "search")


@dataclass(frozen=True)
class PlannerConfig:
    num_ranks: int  # d_hdp: HDP ranks (DP x CP flattened)
    capacity: int  # C: tokens per micro-batch per rank without offloading
    ranks_per_node: int = 8  # HDP ranks sharing a node's NVLink (GPUs per node / TP)
    balance: str = "dp"  # "none" (hdp-naive) | "dp" | "pp"
    slack: float = 0.05  # delta, a fraction of the max estimated time (PP runs; DP gives one unit at a time)
    offload: bool = True
    pipeline_stages: int = 1
    # "1f1b": every stage runs 1F1B; "search": per-stage orders from stage_schedule when shorter
    pipeline_schedule: str = "1f1b"
    expert_parallel: int = 1  # EP size: members of an EP group get aligned slots (expert/slots.py)
    # model chunks per pipeline device (virtual pipeline stages; Plan.virtual_stages); > 1
    # needs pipeline_stages > 1
    virtual_stages: int = 1
    # what plain rings carry (Piece.transport): K and V, an MLA model's "latent", or "auto": per
    # ring, whichever the cost model runs faster (CostModel.cheaper_transport)
    ring_transport: str = "kv"

    def check(self) -> None:
        """A ``FieldError`` naming the field to change unless every field is valid."""

        def whole(field: str, value, low: int, fix: str = "") -> None:
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
                raise FieldError(f"{{{field}}} must be a whole number >= {low}, got {literal(repr(value))}{fix}")

        whole("num_ranks", self.num_ranks, 1, ": the HDP ranks (GPUs / (TP x PP))")
        whole("capacity", self.capacity, 1, ": the tokens one rank holds per micro-batch (e.g. 8K)")
        whole("ranks_per_node", self.ranks_per_node, 1, ": the HDP ranks per node (GPUs per node / TP)")
        whole("pipeline_stages", self.pipeline_stages, 1)
        whole("expert_parallel", self.expert_parallel, 1, ": the expert-parallel size")
        whole("virtual_stages", self.virtual_stages, 1, ": the model chunks per pipeline stage (1 without VPP)")
        if self.virtual_stages > 1 and self.pipeline_stages == 1:
            raise FieldError(
                f"{{virtual_stages}} {self.virtual_stages} needs pipeline stages: virtual pipeline stages interleave "
                "the chunks of a pipeline; set {pipeline_stages} above 1 or {virtual_stages} to 1"
            )
        check_expert_parallel(self.num_ranks, self.expert_parallel)
        if self.expert_parallel > 1 and self.pipeline_stages > 1 and self.pipeline_schedule != "1f1b":
            raise FieldError(
                f"{{pipeline_schedule}} {literal(repr(self.pipeline_schedule))} with expert parallelism "
                f"({{expert_parallel}} {self.expert_parallel}) and pipelines: an EP group's pipelines must run the "
                "same order at every stage, the default one; set {pipeline_schedule} to '1f1b'"
            )
        check_shape(self.num_ranks, self.ranks_per_node)
        if self.balance not in BALANCE_MODES:
            raise FieldError(
                f"unknown {{balance}} mode {literal(repr(self.balance))}; choose one of {', '.join(BALANCE_MODES)}"
            )
        if self.pipeline_schedule not in PIPELINE_SCHEDULES:
            raise FieldError(
                f"unknown {{pipeline_schedule}} {literal(repr(self.pipeline_schedule))}; choose one of "
                f"{', '.join(PIPELINE_SCHEDULES)}"
            )
        if not 0.0 <= self.slack < 1.0:
            raise FieldError(f"{{slack}} must be in [0, 1) (a fraction of the maximum time), got {self.slack}")
