"""HDP step vs the static DP x CP mesh on CPU gloo processes: one mixed global batch, both
strategies run for real with the same attention code; step time (median of repeats; the
speedup is the ratio of total times) and P2P bytes, from one run.

The batch: Byted-like lengths (``data/workloads.py``, scaled down to a CPU-sized context),
tokens read from the real corpus of the demo (megatron-core's source files). Each strategy
runs the same step ``--repeats`` times (forward, backward, gradient reduction; no optimizer
step, so every repeat is the same work); the first repeat warms up and is not counted.

    python benchmarks/bench_step.py [--ranks 4] [--tokens 32K] [--context 8K] [--capacity 2K] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from megatron_bytescale.planner.ring_traffic import p2p_bytes_per_rank  # noqa: E402
from megatron_bytescale.units import format_size, parse_size  # noqa: E402


def corpus_reader(prefix: str, lengths: list[int], seed: int):
    """Sequence i's tokens: a slice of the corpus's token stream at a seeded offset."""
    from megatron_bytescale.data.indexed import DocumentDataset

    data = DocumentDataset(prefix, vocab_size=512)
    stream = np.concatenate([data.read(d, 0, int(n)) for d, n in enumerate(data.lengths)])
    rng = np.random.default_rng(seed)
    starts = [int(rng.integers(0, len(stream) - s)) for s in lengths]
    return lambda seq, a, b: stream[starts[seq] + a : starts[seq] + b]


def _rank(rank, world, plan_json, prefix, lengths, seed, repeats):
    import torch.distributed as dist

    from megatron_bytescale.megatron import local_run
    from megatron_bytescale.planner.contract import Plan
    from megatron_bytescale.runtime.batch import StepBatch, build_micro_batch_data

    model, group = local_run.setup_model("tiny", seed=seed)
    plan = Plan.from_json(plan_json)
    read = corpus_reader(prefix, lengths, seed)
    step = StepBatch(plan, rank, [build_micro_batch_data(mb, read) for mb in plan.micro_batches(rank)])
    times, sent, waits = [], 0, []
    for _ in range(repeats + 1):
        for p in model.parameters():
            p.grad = None
        dist.barrier(group)
        t0 = time.perf_counter()
        result = local_run.run_step(step, model, group)
        dist.barrier(group)
        times.append(time.perf_counter() - t0)
        sent, waits = result.stats.p2p_bytes, waits + [result.stats.p2p_wait_s]
    local_run.teardown()
    return {"times": times[1:], "p2p_bytes": sent, "p2p_wait_s": statistics.median(waits[1:]), "loss": result.loss}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--tokens", default="32K", help="global batch tokens")
    ap.add_argument("--context", default="8K")
    ap.add_argument("--capacity", default="2K")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data", help="indexed dataset prefix (default: the demo corpus, built if missing)")
    ap.add_argument("--json")
    args = ap.parse_args()

    from megatron_bytescale.cli import quiet_optional_backend_warnings
    from megatron_bytescale.data.workloads import sample_lengths
    from megatron_bytescale.demo import CPU_PROFILE, ensure_corpus
    from megatron_bytescale.local_world import preload, run_local_world
    from megatron_bytescale.planner.cost_model import CostModel
    from megatron_bytescale.planner.planner import PlannerConfig, plan_step
    from megatron_bytescale.sim.cluster import Cluster
    from megatron_bytescale.sim.static_cp import static_plan

    quiet_optional_backend_warnings()
    tokens, context, capacity = (parse_size(x) for x in (args.tokens, args.context, args.capacity))
    prefix = args.data or ensure_corpus(Path("runs/demo/data/megatron_core_sources"))
    lengths = sample_lengths("byted", tokens, context, rng=args.seed)
    cost = CostModel.from_profile(CPU_PROFILE)
    plans = {
        "hdp": plan_step(
            lengths, PlannerConfig(num_ranks=args.ranks, capacity=capacity, ranks_per_node=args.ranks), cost
        ),
        "static": static_plan(
            lengths, Cluster(args.ranks, gpus_per_node=args.ranks), capacity, context, cost.num_layers
        ),
    }
    preload(["megatron.core.models.gpt.gpt_model", "megatron_bytescale.megatron.local_run"])
    results = {}
    for name, plan in plans.items():
        plan.validate()
        outs = run_local_world(
            _rank, args.ranks, plan.to_json(), prefix, lengths, args.seed, args.repeats, timeout_s=1800
        )
        step_times = [max(ts) for ts in zip(*(o["times"] for o in outs))]
        results[name] = {
            "step_time_s_median": statistics.median(step_times),
            "step_time_s_total": sum(step_times),  # throughput: the speedup is static's total over HDP's
            "step_times_s": step_times,
            "p2p_bytes": sum(o["p2p_bytes"] for o in outs),
            "p2p_bytes_predicted": int(
                sum(p2p_bytes_per_rank(plan, cost.kv_bytes_per_token, cost.grad_bytes_per_token, cost.num_layers))
            ),
            "p2p_wait_s_max": max(o["p2p_wait_s"] for o in outs),
            "loss": outs[0]["loss"],
            "ranks_per_sequence": sorted(plan.ring_sizes().values(), reverse=True),
            "micro_batches": [len(m) for m in plan.ranks],
        }
    h, s = results["hdp"], results["static"]
    print(
        f"batch: {len(lengths)} sequences, {format_size(sum(lengths))} tokens "
        f"(Byted-like, context {format_size(context)}), "
        f"{args.ranks} gloo ranks, capacity {format_size(capacity)}; static CP = {plans['static'].meta['cp']}"
    )
    print(f"{'':8}{'step (median)':>15}{'P2P bytes':>14}{'P2P wait':>10}{'loss':>10}  ranks per long sequence")
    for name, r in results.items():
        rings = [n for n in r["ranks_per_sequence"] if n > 1]
        print(
            f"{name:8}{r['step_time_s_median']:>13.3f} s"
            f"{format_size(r['p2p_bytes']) + 'B':>14}{r['p2p_wait_s_max']:>8.3f} s"
            f"{r['loss']:>10.5f}  {rings}"
        )
    print(
        f"HDP vs static: {s['step_time_s_total'] / h['step_time_s_total']:.2f}x faster (total time of the "
        f"{len(h['step_times_s'])} timed repeats), "
        f"{s['p2p_bytes'] / max(h['p2p_bytes'], 1):.1f}x less P2P traffic"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"config": vars(args), "lengths": lengths, "results": results}, indent=2) + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
