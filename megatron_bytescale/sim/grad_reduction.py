"""The data-parallel gradient reduction that ends a step: how much of it is exposed.

The timeline engine leaves the reduction out (every strategy reduces the same gradients over
the same ranks); this adds it, to show what ``--overlap-grad-reduce`` saves under HDP. Each
GPU all-reduces its ``CostModel.grad_bytes_per_gpu`` over the HDP ranks of its TP shard and
stage, a ring all-reduce: ``2 (n-1)/n * bytes / bandwidth`` (network bandwidth once the HDP
group spans nodes, NVLink otherwise).

* Without overlap every rank starts the reduction after its last micro-batch; the collective
  runs once the last rank arrives, so all of it is exposed.
* With overlap (``runtime.grad_sync``) a rank whose last micro-batch is local launches its
  buckets during that micro-batch's backward; a rank whose last micro-batch is a ring one, and
  a rank with none, launches after its last backward (at once, for the idle one); so does every
  rank of a plan with expert-parallel slots (its backwards run MoE all-to-alls). Buckets go
  in one order on every rank, so the reduction streams from the moment the last rank
  launches, ``L``, and ends at ``max(L + T, F + T / buckets)`` (``F``: when the last rank's
  compute ends; its final bucket cannot go before). Exposed: that end minus ``F``.
* Static CP and Megatron's dynamic CP run their rings on the CP group, apart from the
  data-parallel reduction, so there (``hdp_rule=False``) every rank launches during its last
  backward, ring or not.
"""

from __future__ import annotations

from ..planner.contract import Plan
from ..planner.cost_model import CostModel
from .cluster import Cluster

DEFAULT_BUCKETS = 8  # buckets per GPU's gradients (Megatron: 40M-parameter buckets)


def allreduce_time(cost: CostModel, cluster: Cluster) -> float:
    """Seconds of one GPU's gradient all-reduce over its HDP group."""
    n = cluster.d_hdp
    if n <= 1 or cost.grad_bytes_per_gpu <= 0:
        return 0.0
    bw = cost.bw_inter_node if cluster.d_hdp > cluster.hdp_per_node else cost.bw_intra_node
    return cost.p2p_latency_s * 2 * (n - 1) + 2 * (n - 1) / n * cost.grad_bytes_per_gpu / bw


def exposed_reduction(
    plan: Plan,
    timeline,
    cost: CostModel,
    cluster: Cluster,
    overlap: bool,
    buckets: int = DEFAULT_BUCKETS,
    hdp_rule: bool = True,
) -> float:
    """Seconds of gradient reduction after the slowest rank's compute, per stage, worst stage, of
    ``timeline`` (the step's ``sim.timeline.Timeline``, not imported: timeline imports this module)."""
    total = allreduce_time(cost, cluster)
    if total == 0.0:
        return 0.0
    worst = 0.0
    for stage in range(timeline.stages):
        finish, launch = [], []
        for rank in range(plan.num_ranks):
            ops = timeline.row(rank, stage)
            if not len(ops):
                finish.append(0.0)
                launch.append(0.0)
                continue
            last = ops[ops[:, 1].argmax()]  # the op that ends last: the last micro-batch's backward
            finish.append(float(last[1]))
            mbs = plan.ranks[rank]  # none where the timeline ran only empty EP slots for it
            aligned = plan.expert_parallel > 1 or cluster.ep > 1
            early = (bool(mbs) and mbs[-1].ring is None and not aligned) or not hdp_rule
            launch.append(float(last[0]) if overlap and early else float(last[1]))
        f = max(finish)
        end = max(max(launch) + total, f + total / buckets) if overlap else f + total
        worst = max(worst, end - f)
    return worst
