"""The simulated cluster: how GPUs map to TP groups, pipeline stages, HDP ranks and nodes.

Rank order follows Megatron's default (``tp-cp-ep-dp-pp``): TP varies fastest, then the
flattened DP x CP (= HDP) dimension, then the pipeline stage. So GPU
``g = tp_rank + tp * (hdp_rank + d_hdp * stage)`` and its node is ``g // gpus_per_node``.
A TP group therefore sits inside one node, and ``gpus_per_node / tp`` consecutive HDP ranks
share a node — the same ones at every stage, because each stage's HDP ranks fill whole
nodes. Two HDP ranks ``a`` and ``b`` share a node iff ``a // hdp_per_node == b // hdp_per_node``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError


@dataclass(frozen=True)
class Cluster:
    gpus: int
    tp: int = 1
    pp: int = 1
    gpus_per_node: int = 8
    ep: int = 1  # expert-parallel size: EP groups are blocks of ``ep`` consecutive HDP ranks

    def __post_init__(self):
        for name in ("gpus", "tp", "pp", "gpus_per_node", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"cluster: {name} must be a positive whole number, got {value!r}")
        if self.gpus % (self.tp * self.pp):
            raise ConfigError(
                f"cluster: {self.gpus} GPUs do not divide by TP x PP = {self.tp} x {self.pp} = {self.tp * self.pp}; "
                "choose a GPU count that is a multiple of TP*PP"
            )
        if self.gpus_per_node % self.tp:
            raise ConfigError(
                f"cluster: TP={self.tp} does not divide {self.gpus_per_node} GPUs per node; a TP group must sit in "
                "one node (choose TP from the divisors of --gpus-per-node)"
            )
        if self.gpus > self.gpus_per_node and (self.d_hdp * self.tp) % self.gpus_per_node:
            raise ConfigError(
                f"cluster: each pipeline stage's {self.d_hdp} HDP ranks x TP={self.tp} = {self.d_hdp * self.tp} GPUs "
                f"do not fill whole {self.gpus_per_node}-GPU nodes; choose GPUs, TP and PP so that "
                "GPUs / PP is a multiple of --gpus-per-node"
            )
        if self.d_hdp % self.ep:
            raise ConfigError(
                f"cluster: EP={self.ep} does not divide the {self.d_hdp} HDP ranks; "
                "choose --ep dividing GPUs / (TP x PP)"
            )

    @property
    def d_hdp(self) -> int:
        """HDP ranks (DP x CP flattened): model replicas per TP/PP shard."""
        return self.gpus // (self.tp * self.pp)

    @property
    def hdp_per_node(self) -> int:
        """HDP ranks that share one node (the whole stage if the cluster is under one node)."""
        return min(self.d_hdp, self.gpus_per_node // self.tp)

    @property
    def pipelines(self) -> int:
        return self.d_hdp

    def node_of(self, hdp_rank: int) -> int:
        return hdp_rank // self.hdp_per_node

    def same_node(self, a: int, b: int) -> bool:
        return self.node_of(a) == self.node_of(b)

    def describe(self) -> str:
        return (
            f"{self.gpus} GPUs = TP {self.tp} x PP {self.pp} x HDP {self.d_hdp}"
            f"{f' (EP {self.ep})' if self.ep > 1 else ''}; "
            f"{self.gpus_per_node} GPUs/node, {self.hdp_per_node} HDP ranks/node"
        )
