"""Throughput after losing nodes: HDP on every survivor against the static DP x CP mesh.

    PYTHONPATH=. python benchmarks/bench_elastic.py [--steps 6] [--lose 1,2,8] [--dataset byted] [--json OUT]

Two setups (analytic cost model, H100 nodes of 8, 2M context, 8K capacity, 32M-token
batches): LLaMA-7B on 1,024 GPUs (TP 1, PP 1) and LLaMA-70B on 8,192 GPUs (TP 8, PP 4). For
0 (healthy), 1, 2 and 8 lost nodes, each strategy restarts on what is left with TP and PP
unchanged (``sim/elastic.py``): HDP (hdp-balanced) on every survivor that forms whole
pipelines, static on the largest whole number of DP groups of its CP degree. Both run the same
``--steps`` global batches (seed ``--seed``); throughput is total tokens over total simulated
time. ``--json`` keeps every batch's step time.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_bytescale.data.workloads import sample_lengths  # noqa: E402
from megatron_bytescale.planner.cost_model import CostModel  # noqa: E402
from megatron_bytescale.planner.specs import HardwareSpec, ModelSpec  # noqa: E402
from megatron_bytescale.sim.elastic import compare  # noqa: E402
from megatron_bytescale.units import parse_size  # noqa: E402

SETUPS = (("llama-7b", 1024, 1, 1), ("llama-70b", 8192, 8, 4))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="global batches per configuration (>= 6 for the README)")
    parser.add_argument("--lose", default="1,2,8", help="comma-separated numbers of lost nodes")
    parser.add_argument("--dataset", default="byted")
    parser.add_argument("--context", default="2M")
    parser.add_argument("--capacity", default="8K")
    parser.add_argument("--global-batch-tokens", default="32M")
    parser.add_argument("--hardware", default="h100")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", default=None, help="run one setup: llama-7b or llama-70b")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    lost = [int(x) for x in args.lose.split(",") if x.strip()]
    context, capacity = parse_size(args.context, "context"), parse_size(args.capacity, "capacity")
    tokens = parse_size(args.global_batch_tokens, "global batch tokens")
    hw = HardwareSpec.load(args.hardware)
    rng = np.random.default_rng(args.seed)
    batches = [sample_lengths(args.dataset, tokens, context, rng) for _ in range(args.steps)]
    out = {"config": {**vars(args), "lost_nodes": lost, "gpus_per_node": hw.gpus_per_node}, "setups": []}
    table = [
        "| model | GPUs (TP x PP) | lost nodes | HDP GPUs | HDP tokens/s | HDP vs healthy | static GPUs (CP) "
        "| static tokens/s | static vs healthy | HDP / static |",
        "|---" * 10 + "|",
    ]
    for model, gpus, tp, pp in SETUPS:
        if args.only and args.only != model:
            continue
        cost = CostModel.analytic(ModelSpec.load(model), hw, tp=tp, pp=pp)
        t0 = time.perf_counter()
        rows = compare(
            batches,
            gpus=gpus,
            tp=tp,
            pp=pp,
            gpus_per_node=hw.gpus_per_node,
            cost=cost,
            capacity=capacity,
            context=context,
            lost=lost,
            progress=lambda what: print(f"  {model}: {what}", file=sys.stderr, flush=True),
        )
        healthy = rows[0]
        for row in rows:
            hdp, static = row["hdp"], row["static"]
            ratio = f"{hdp.throughput / static.throughput:.2f}x" if static.throughput else "static cannot restart"
            table.append(
                f"| {model} | {gpus} ({tp} x {pp}) | {row['lost_nodes']} | {hdp.gpus} | {hdp.throughput:,.0f} "
                f"| {hdp.throughput / healthy['hdp'].throughput:.1%} | {static.gpus} ({row['cp']}) "
                f"| {static.throughput:,.0f} "
                f"| {static.throughput / healthy['static'].throughput:.1%} | {ratio} |"
            )
            if static.error:
                print(f"  {model}, {row['lost_nodes']} lost: static: {static.error}", file=sys.stderr)
        out["setups"].append(
            {
                "model": model,
                "gpus": gpus,
                "tp": tp,
                "pp": pp,
                "wall_s": time.perf_counter() - t0,
                "rows": [{**r, "hdp": r["hdp"].to_json(), "static": r["static"].to_json()} for r in rows],
            }
        )
    print(
        f"{args.dataset}-like batches, {args.context} context, {args.capacity} capacity, {args.global_batch_tokens} "
        f"tokens/batch, {args.steps} batches (seed {args.seed}); throughput = total tokens / total simulated time"
    )
    print("\n".join(table))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
