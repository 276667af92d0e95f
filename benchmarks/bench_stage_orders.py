"""What per-stage orders other than 1F1B buy on PP-balance plans, and what bounds them.

    PYTHONPATH=. python benchmarks/bench_stage_orders.py [--dataset byted|github] [--steps 2] [--json OUT]
        [any other `bytescale simulate` flag; default LLaMA-70B, 8,192 GPUs, TP 8, PP 4, 2M, 8K, 32M]

For each step's batch (the batches `bytescale simulate` draws with the same flags and seed),
the hdp-balanced plan, simulated (``sim.timeline``) with:

* ``1f1b``: the plan as the planner makes it;
* ``search``: the planner's stage-order search (``planner/order/stage_schedule.py``) at the memory
  budget of 1F1B (``p`` micro-batches in flight per stage), and at twice it (``search 2p``,
  a what-if: the device and host budgets are sized for ``p``);
* ``deep warm-up``: 1F1B with ``2 (p - k - 1)`` warm-up forwards on stage ``k`` (up to
  ``2p - 1`` micro-batches in flight: also a what-if on memory);

beside the lower bound (all FLOPs spread over all GPUs) and the floor of the rings that span
every pipeline (``sim.timeline.pipeline_ring_floor``: what no stage order beats). Search
results are simulated through ``Plan.stage_orders``; a search that finds nothing shorter
than 1F1B reports 1F1B's step.

With ``--vpp V`` (> 1) the rows are the hdp-balanced plan with V model chunks per device as
the planner makes it (``planned``) and the list schedule over chunk operations alone at three
memory caps: ``p V`` chunk forwards (1F1B's activations), ``p V + p - 1`` (Megatron's
interleaved warm-up) and none (a what-if): what memory leaves to any order.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_bytescale.commands.simulate import add_arguments, config_from_args  # noqa: E402
from megatron_bytescale.data.workloads import sample_lengths  # noqa: E402
from megatron_bytescale.errors import PlanError  # noqa: E402
from megatron_bytescale.planner.contract import BACKWARD, FORWARD, PipelineGraph, encode_stage_orders  # noqa: E402
from megatron_bytescale.planner.estimate import crosses_nodes, micro_batch_time  # noqa: E402
from megatron_bytescale.planner.order.stage_schedule import _list_schedule, stage_schedule  # noqa: E402
from megatron_bytescale.sim.simulate import check_config  # noqa: E402
from megatron_bytescale.sim.strategies import StrategyInput, make_plan  # noqa: E402
from megatron_bytescale.sim.timeline import lower_bound, pipeline_ring_floor, simulate  # noqa: E402

DEFAULTS = [
    "--model",
    "llama-70b",
    "--gpus",
    "8192",
    "--tp",
    "8",
    "--pp",
    "4",
    "--context",
    "2M",
    "--capacity",
    "8K",
    "--global-batch-tokens",
    "32M",
    "--steps",
    "2",
]


def deep_warm_up(count: int, stages: int, stage: int) -> list[tuple[int, int]]:
    """1F1B with ``2 (p - k - 1)`` warm-up forwards on stage ``k`` (forwards and backwards in index order)."""
    warm = min(2 * (stages - stage - 1), count)
    order = [(FORWARD, m) for m in range(warm)]
    for i in range(count - warm):
        order += [(FORWARD, warm + i), (BACKWARD, i)]
    return order + [(BACKWARD, m) for m in range(count - warm, count)]


def planned_batch(cfg, cluster, cost, rng, virtual_stages: int = 1):
    """One batch's lengths, its hdp-balanced plan, and per rank its micro-batches' ring keys and
    stage times (what the stage-order searches take)."""
    lens = sample_lengths(cfg.dataset, cfg.global_batch_tokens, cfg.context, rng)
    plan = make_plan(
        "hdp-balanced", StrategyInput(lens, cluster, cost, cfg.capacity, cfg.context, virtual_stages=virtual_stages)
    )
    rpn = plan.meta["ranks_per_node"]
    times = [
        [micro_batch_time(cost, mb, mb.ring is not None and crosses_nodes(mb.ring, rpn)) for mb in mbs]
        for mbs in plan.ranks
    ]
    return lens, plan, plan.ring_keys(), times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(ap)
    args = ap.parse_args(DEFAULTS + sys.argv[1:])
    cfg = config_from_args(args)
    cluster, cost = check_config(cfg)
    p = cluster.pp
    rng = np.random.default_rng(cfg.seed)
    rows = []
    if cfg.vpp > 1:
        return chunk_rows(cfg, cluster, cost, rng, args.json)
    for step in range(cfg.steps):
        lens, plan, keys, times = planned_batch(cfg, cluster, cost, rng)

        def simulated(orders) -> float:
            if orders is None:
                return simulate(plan, cluster, cost).step_time
            return simulate(
                dataclasses.replace(plan, stage_orders=encode_stage_orders(orders)), cluster, cost
            ).step_time

        row = {"step": step, "1f1b_s": simulated(None)}
        for name, cap in (("search_s", p), ("search_2p_s", 2 * p)):
            found = stage_schedule(keys, times, p, cost.forward_share, cap=cap)
            row[name] = simulated(found.orders) if found is not None else row["1f1b_s"]
        try:
            row["deep_warm_up_s"] = simulated([[deep_warm_up(len(mbs), p, k) for k in range(p)] for mbs in plan.ranks])
        except PlanError:  # the deeper warm-up deadlocks on this plan's ring order
            row["deep_warm_up_s"] = float("nan")
        row["lower_bound_s"] = lower_bound(lens, cluster, cost)
        row["ring_floor_s"] = pipeline_ring_floor(plan, cluster, cost)
        rows.append(row)
        print(
            f"step {step + 1}: 1F1B {row['1f1b_s']:.2f} s, search {row['search_s']:.2f} s, "
            f"search 2p {row['search_2p_s']:.2f} s, "
            f"deep warm-up {row['deep_warm_up_s']:.2f} s; lower bound {row['lower_bound_s']:.2f} s, "
            f"floor of the rings on every pipeline {row['ring_floor_s']:.2f} s "
            f"({row['ring_floor_s'] / row['lower_bound_s']:.2f}x the lower bound)",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"dataset": cfg.dataset, "model": cfg.model, "pp": p, "rows": rows}, indent=2) + "\n"
        )
        print(f"wrote {args.json}")
    return 0


def chunk_rows(cfg, cluster, cost, rng, out) -> int:
    """``--vpp V``: the planned chunk orders against the list schedule at three memory caps."""
    p, v = cluster.pp, cfg.vpp
    rows = []
    for step in range(cfg.steps):
        lens, plan, keys, times = planned_batch(cfg, cluster, cost, rng, v)
        row = {"step": step, "vpp": v, "planned_s": simulate(plan, cluster, cost).step_time}
        ops = PipelineGraph.of_times(keys, times, p, cost.forward_share, v)
        for name, cap in (("list_pv_s", p * v), ("list_megatron_s", p * v + p - 1), ("list_unlimited_s", ops.total)):
            seqs = _list_schedule(ops, cap)
            orders = None if seqs is None else encode_stage_orders(ops.orders(seqs), v)
            row[name] = (
                float("nan")
                if orders is None
                else simulate(dataclasses.replace(plan, stage_orders=orders), cluster, cost).step_time
            )
        row["lower_bound_s"] = lower_bound(lens, cluster, cost)
        row["ring_floor_s"] = pipeline_ring_floor(plan, cluster, cost)
        rows.append(row)
        print(
            f"step {step + 1}, VPP {v}: planned {row['planned_s']:.2f} s; "
            f"list schedule at p V {row['list_pv_s']:.2f} s, "
            f"at p V + p - 1 {row['list_megatron_s']:.2f} s, unlimited {row['list_unlimited_s']:.2f} s; lower bound "
            f"{row['lower_bound_s']:.2f} s, floor of the rings on every pipeline {row['ring_floor_s']:.2f} s",
            flush=True,
        )
    if out:
        Path(out).write_text(
            json.dumps({"dataset": cfg.dataset, "model": cfg.model, "pp": p, "vpp": v, "rows": rows}, indent=2) + "\n"
        )
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
