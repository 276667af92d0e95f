"""The HDP ranks the planner places work on.

HDP ranks are numbered node by node: ``ranks_per_node`` consecutive ranks share a node's
NVLink, and under expert parallelism ``expert_parallel`` consecutive ranks form an EP group.
Where each ring goes is the balance scheduler's (``balance.kernel``'s placement rules).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from .contract.slots import check_expert_parallel


def check_shape(num_ranks: int, ranks_per_node: int) -> None:
    if ranks_per_node < 1:
        raise ConfigError(
            f"ranks_per_node must be at least 1, got {ranks_per_node}; pass the HDP ranks per node (GPUs per node / TP)"
        )
    if num_ranks > ranks_per_node and num_ranks % ranks_per_node:
        raise ConfigError(
            f"{num_ranks} HDP ranks do not fill whole nodes of {ranks_per_node} ranks; "
            f"use a rank count that is a multiple of ranks_per_node (or fewer ranks than one node)"
        )


@dataclass(frozen=True)
class Ranks:
    """How many HDP ranks, how many share a node (at most all of them), and the EP group size."""

    num_ranks: int
    ranks_per_node: int
    expert_parallel: int = 1

    @classmethod
    def of(cls, num_ranks: int, ranks_per_node: int, expert_parallel: int = 1) -> Ranks:
        check_shape(num_ranks, ranks_per_node)
        if expert_parallel > 1:
            check_expert_parallel(num_ranks, expert_parallel)
        return cls(num_ranks, min(ranks_per_node, num_ranks), expert_parallel)
