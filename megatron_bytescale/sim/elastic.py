"""What a restart after losing nodes keeps, for HDP and for the static DP x CP mesh.

A job that loses ``k`` nodes restarts on what is left (TP and PP unchanged):

* **HDP** needs only whole pipelines: a multiple of TP x PP GPUs whose stages fill whole nodes
  (``Cluster``'s rule), so it restarts on every survivor up to that rounding; the planner
  forms its rings over however many HDP ranks there are.
* **Static DP x CP** keeps its CP degree (the smallest one that fits the context at the
  capacity, ``static_cp_degree``; a smaller CP would not fit the longest sequence), so it
  restarts on the largest multiple of TP x PP x CP GPUs that the survivors hold: whole DP
  groups of CP ranks, or nothing when fewer than one group is left.

``restart_gpus`` gives both; ``compare`` costs the same global batches on the healthy cluster
and on each restart with the simulator's strategies and reports throughput as total tokens
over total time (``benchmarks/bench_elastic.py`` prints it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..errors import ConfigError
from ..planner.cost_model import CostModel
from .cluster import Cluster
from .static_cp import StrategyError, static_cp_degree
from .strategies import StrategyInput, make_plan
from .timeline import evaluate


def _largest_cluster(survivors: int, unit: int, tp: int, pp: int, gpus_per_node: int) -> int:
    """The most GPUs, a multiple of ``unit`` and at most ``survivors``, that form a valid
    ``Cluster`` (its rules: whole TP x PP, each stage's GPUs in whole nodes); 0 if none."""
    for n in range((survivors // unit) * unit, 0, -unit):
        try:
            Cluster(n, tp, pp, gpus_per_node)
        except ConfigError:
            continue
        return n
    return 0


def hdp_restart_gpus(gpus: int, tp: int, pp: int, gpus_per_node: int, lost_nodes: int) -> int:
    """GPUs an HDP job restarts on after losing ``lost_nodes`` nodes: the survivors rounded down
    to whole pipelines whose stages fill whole nodes (0 if not even one pipeline is left)."""
    return _largest_cluster(gpus - lost_nodes * gpus_per_node, tp * pp, tp, pp, gpus_per_node)


def static_restart_gpus(gpus: int, tp: int, pp: int, gpus_per_node: int, lost_nodes: int, cp: int) -> int:
    """GPUs the static mesh restarts on with the same CP: whole DP groups of TP x PP x CP GPUs
    (stages in whole nodes); 0 when the survivors do not hold one."""
    return _largest_cluster(gpus - lost_nodes * gpus_per_node, tp * pp * cp, tp, pp, gpus_per_node)


@dataclass
class Restart:
    """One strategy on one cluster over the batches: step times and tokens per batch."""

    strategy: str
    gpus: int
    step_times: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    error: str = ""  # why it cannot run (no mesh left, or the plan failed)

    @property
    def throughput(self) -> float:
        """Tokens per second over all batches (total tokens / total time); 0 if it cannot run."""
        return sum(self.tokens) / sum(self.step_times) if self.step_times and not self.error else 0.0

    def to_json(self) -> dict:
        return {
            "strategy": self.strategy,
            "gpus": self.gpus,
            "step_times_s": self.step_times,
            "tokens": self.tokens,
            "throughput_tokens_per_s": self.throughput,
            "error": self.error,
        }


def run_batches(
    strategy: str,
    gpus: int,
    batches: Sequence[Sequence[int]],
    *,
    tp: int,
    pp: int,
    gpus_per_node: int,
    cost: CostModel,
    capacity: int,
    context: int,
) -> Restart:
    """``strategy`` on ``gpus`` GPUs over ``batches`` (one simulated step each)."""
    out = Restart(strategy, gpus)
    if gpus <= 0:
        out.error = "not even one pipeline is left"
        return out
    cluster = Cluster(gpus, tp, pp, gpus_per_node)
    for lengths in batches:
        try:
            plan = make_plan(strategy, StrategyInput(list(lengths), cluster, cost, capacity, context))
        except (StrategyError, ConfigError) as exc:
            out.error = str(exc)
            return out
        out.step_times.append(float(evaluate(plan, cluster, cost).timeline.step_time))
        out.tokens.append(int(sum(lengths)))
    return out


def compare(
    batches: Sequence[Sequence[int]],
    *,
    gpus: int,
    tp: int,
    pp: int,
    gpus_per_node: int,
    cost: CostModel,
    capacity: int,
    context: int,
    lost: Sequence[int],
    progress=None,
) -> list[dict]:
    """Per number of lost nodes (0 first: the healthy cluster): HDP (hdp-balanced) on every
    survivor it can use against static DP x CP on the largest mesh it can restart on, the same
    batches for both. Runs of the same strategy on the same GPU count are shared."""
    cp = static_cp_degree(context, capacity, gpus // (tp * pp))
    cache: dict[tuple[str, int], Restart] = {}

    def cached(strategy: str, n: int) -> Restart:
        if (strategy, n) not in cache:
            if progress:
                progress(f"{strategy} on {n} GPUs")
            cache[strategy, n] = run_batches(
                strategy,
                n,
                batches,
                tp=tp,
                pp=pp,
                gpus_per_node=gpus_per_node,
                cost=cost,
                capacity=capacity,
                context=context,
            )
        return cache[strategy, n]

    rows = []
    for k in [0, *[k for k in lost if k]]:
        survivors = gpus - k * gpus_per_node
        hdp = cached("hdp-balanced", hdp_restart_gpus(gpus, tp, pp, gpus_per_node, k))
        static_gpus = static_restart_gpus(gpus, tp, pp, gpus_per_node, k, cp)
        static = (
            cached("static", static_gpus)
            if static_gpus
            else Restart(
                "static",
                0,
                error=(
                    f"CP {cp} x TP {tp} x PP {pp} = {cp * tp * pp} GPUs per DP group; {survivors} survivors hold none"
                ),
            )
        )
        rows.append({"lost_nodes": k, "survivors": survivors, "cp": cp, "hdp": hdp, "static": static})
    return rows


__all__ = ["Restart", "compare", "hdp_restart_gpus", "run_batches", "static_restart_gpus"]
