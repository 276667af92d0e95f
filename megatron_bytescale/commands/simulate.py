"""``bytescale simulate``: compare strategies on a simulated cluster, step by step, and print
the table (the simulator itself is ``sim/simulate.py``).

Bare, it simulates the README's headline: LLaMA-7B on 1,024 H100s, 2M context, capacity 8K,
six 32M-token Byted-like batches.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ..units import format_size, parse_size, seed

if TYPE_CHECKING:
    from ..sim.simulate import SimConfig, SimReport

# every strategy sim/strategies.py compares (checked in main, not imported for --help)
STRATEGY_NAMES = "static, megatron-dcp, megatron-dcp-dev, hdp-sharding, hdp-naive, hdp-balanced, hdp-latent, hdp-auto"
NO_EXPERT_SLOTS = "megatron-dcp"  # sim.simulate.NO_EXPERT_SLOTS
# the README's headline: bare `bytescale simulate` runs it
HEADLINE = {"gpus": 1024, "context": "2M", "capacity": "8K", "global_batch_tokens": "32M", "steps": 6}


def format_table(report: SimReport) -> str:
    """Step: the mean over the steps (their total / the count); speedup and x LB, x bound:
    ratios of totals; "per batch": the median of the per-step ratios, beside them; the other
    columns are means over the steps."""
    med = report.results()
    many = report.config.steps > 1
    head = (
        f"{'strategy':<17}{'step s':>9}{'speedup':>9}"
        + (f"{'(batch)':>9}" if many else "")
        + f"{'x LB':>7}"
        + (f"{'(batch)':>8}" if many else "")
        + f"{'x bound':>8}{'busy max':>9}{'busy avg':>9}"
        f"{'exp.comm':>9}{'P2P TB':>8}{'offl TB':>8}{'host GB':>8}{'mb max':>7}{'plan s':>8}"
    )
    lines = [head, "-" * len(head)]
    for name, m in med.items():
        if "error" in m:
            lines.append(f"{name:<17}n/a: {m['error']}")
            continue
        speedup = f"{m['speedup_vs_static']:.2f}x" if "speedup_vs_static" in m else "-"
        per_batch = f"{m['speedup_vs_static_per_batch_median']:.2f}x" if "speedup_vs_static" in m else "-"
        lines.append(
            f"{name:<17}{m['mean_step_time_s']:>9.2f}{speedup:>9}"
            + (f"{per_batch:>9}" if many else "")
            + f"{m['x_lower_bound']:>7.2f}"
            + (f"{m['x_lower_bound_per_batch_median']:>8.2f}" if many else "")
            + f"{m['x_bound']:>8.2f}"
            f"{m['busy_max_s']:>9.2f}{m['busy_mean_s']:>9.2f}{m['exposed_comm_s']:>9.2f}"
            f"{m['p2p_bytes'] / 1e12:>8.1f}{m['offload_bytes'] / 1e12:>8.1f}{m['host_bytes_max_gpu'] / 1e9:>8.1f}"
            f"{m['microbatches_max']:>7.0f}{m['plan_time_s']:>8.2f}"
        )
    ok = [m for m in med.values() if "lower_bound_s" in m]
    if ok:
        lines.append(
            f"lower bound LB (all FLOPs spread over all GPUs): {ok[0]['lower_bound_s']:.2f} s; critical path (longest "
            f"sequence alone, best ring): {ok[0]['critical_path_s']:.2f} s; "
            "bound = max of the two (means over the steps); "
            f"the bounds total {ok[0]['bound_x_lower_bound']:.2f}x the lower bounds' total: "
            "no plan gets under that x LB"
        )
    lines.append(
        "step: mean over the steps; speedup: static's total step time / this total, x LB / x bound: total step time / "
        "sum of the steps' bounds (ratios of totals: throughput)"
        + ("; (batch): median of the per-step ratios" if many else "")
        + "; other columns: means over the steps"
    )
    lines.append(
        "busy, exposed comm: per GPU (max / mean); P2P, offload: all GPUs; exp.comm: mean; "
        f"host: pinned host memory the busiest GPU needs for offloaded activations (budget "
        f"{report.cost.host_memory_bytes / 1e9:.0f} GB per GPU)"
    )
    floors = [
        f"{n} " + ", ".join(f"{r['pipeline_ring_floor_s']:.2f}" for r in rows)
        for n, rows in report.steps.items()
        if any(r.get("pipeline_ring_floor_s", 0.0) > 0 for r in rows)
    ]
    if floors:
        lines.append(
            "ring micro-batches spanning every pipeline alone, in any stage order (a floor of the step, s per step; "
            "0: no such ring): " + "; ".join(floors)
        )
    ep_floors = [
        f"{n} {sum(r['ep_slot_floor_s'] for r in rows) / sum(r['lower_bound_s'] for r in rows):.2f}"
        for n, rows in report.steps.items()
        if rows and any(r.get("ep_slot_floor_s", 0.0) > 0 for r in rows)
    ]
    if ep_floors:
        lines.append(
            "EP slots (every device runs its group's slots in turn, each as long as the group's slowest member "
            "with its all-to-alls): the busiest device's sum, a floor of the step, x LB (ratio of totals): "
            + "; ".join(ep_floors)
        )
    if report.config.vpp > 1:
        p, v = report.config.pp, report.config.vpp
        held = [f"{n} {max(r['chunks_in_flight_max'] for r in rows):.0f}" for n, rows in report.steps.items() if rows]
        lines.append(
            f"chunk forwards a device holds at most (1F1B's memory: {p * v}; Megatron's interleaved warm-up: "
            f"{p * v + p - 1}): " + "; ".join(held)
        )
    reduce = [
        f"{n} {m['exposed_grad_reduce_s']:.2f} -> {m['exposed_grad_reduce_overlap_s']:.2f}"
        for n, m in med.items()
        if "exposed_grad_reduce_s" in m
    ]
    if reduce:
        lines.append(
            "exposed gradient reduction after the step, s (without -> with --overlap-grad-reduce): " + "; ".join(reduce)
        )
    for name, notes in report.notes.items():
        for note in notes:
            lines.append(f"note [{name}]: {note}")
    return "\n".join(lines)


def shadow_verdict(report: SimReport) -> str:
    """One line answering "would HDP help here?": HDP's total step time over these batches
    against static DP x CP's and Megatron's dynamic CP's on this cluster (ratios of totals)."""
    from ..sim.throughput import totals

    hdp = report.steps.get("hdp-balanced", [])
    if not hdp or "hdp-balanced" in report.errors:
        return ""
    parts = []
    for name, label in (
        ("static", "static DP x CP"),
        ("megatron-dcp", "Megatron's dynamic CP (0.16.1)"),
        ("megatron-dcp-dev", "Megatron's dynamic CP (dev branch)"),
    ):
        other = report.steps.get(name, [])
        if len(other) == len(hdp) and name not in report.errors:
            t = totals(hdp, other)
            parts.append(
                f"{t['speedup']:.2f}x faster than {label} ({t['total_baseline_step_time_s'] / len(hdp):.2f} s)"
            )
    if not parts:
        return ""
    return (
        f"HDP (hdp-balanced) {totals(hdp)['mean_step_time_s']:.2f} s per step: "
        + "; ".join(parts)
        + f" (ratios of the total time over the {len(hdp)} step(s); seconds: mean per step)"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="llama-7b", help="a configs/models name or a Megatron .args file")
    parser.add_argument("--gpus", type=int, default=HEADLINE["gpus"], help="GPUs in the job (default 1024)")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE models; PP 1)")
    parser.add_argument("--gpus-per-node", type=int, default=None, help="default: the hardware spec's")
    parser.add_argument("--hardware", default="h100", help="a configs/hardware name or a YAML file")
    parser.add_argument("--context", default=HEADLINE["context"], help="longest sequence (default 2M)")
    parser.add_argument("--capacity", default=HEADLINE["capacity"], help="tokens per rank per micro-batch (default 8K)")
    parser.add_argument(
        "--global-batch-tokens", default=HEADLINE["global_batch_tokens"], help="tokens per step (default 32M)"
    )
    src = parser.add_mutually_exclusive_group()
    src.add_argument(
        "--dataset",
        default="byted",
        help="byted | github | a workload YAML | lognormal[:mean=..,sigma=..,min=..,max=..] (an SFT-like mix, as "
        "Megatron's mock variable-length data draw it) (default byted)",
    )
    src.add_argument(
        "--lengths-file", default=None, help="one token length per line, resampled until the batch is full"
    )
    src.add_argument(
        "--data-path",
        default=None,
        nargs="+",
        metavar="[WEIGHT] PREFIX",
        help="a Megatron indexed dataset (PREFIX.bin/.idx), or a blend in Megatron's syntax (W1 P1 W2 P2 ...): "
        "simulate the global batches training on it would see (documents cut at --context, "
        "--global-batch-tokens per step, the same --seed, a blend's tokens by weight)",
    )
    parser.add_argument(
        "--host-memory-per-gpu",
        default=None,
        metavar="BYTES",
        help="pinned host memory per GPU for offloaded activations, e.g. 64G (default: the hardware spec's)",
    )
    parser.add_argument(
        "--strategies",
        default=None,
        help=f"comma-separated from {STRATEGY_NAMES} (default: all; with --ep > 1 all but "
        f"{NO_EXPERT_SLOTS}, whose barriers the simulator does not align for expert all-to-alls; "
        "hdp-latent and hdp-auto, hdp-balanced with rings carrying the latent or each ring the faster "
        "of K/V and the latent, for multi-latent attention models only; "
        "megatron-dcp-dev where a dev tree is named)",
    )
    parser.add_argument("--steps", type=int, default=HEADLINE["steps"], help="global batches, one per step (default 6)")
    parser.add_argument("--seed", type=seed, default=0)
    parser.add_argument(
        "--validate", default="first", choices=["first", "all", "none"], help="which steps' plans to validate"
    )
    parser.add_argument(
        "--dkv-bf16",
        action="store_true",
        help="cost ring attention with the backward's dK/dV accumulators sent in bf16 (fp32 by default)",
    )
    parser.add_argument(
        "--pipeline-schedule",
        default="1f1b",
        choices=["1f1b", "search"],
        help="with --pp > 1, the HDP plans' stage orders: 1F1B, or per-stage orders searched by "
        "simulating all pipelines together, kept when shorter (planner/order/stage_schedule.py)",
    )
    parser.add_argument(
        "--vpp",
        type=int,
        default=1,
        metavar="V",
        help="model chunks per pipeline device (virtual pipeline stages, interleaved 1F1B); every "
        "strategy runs with them, the static baseline Megatron's interleaved order [1]",
    )
    parser.add_argument(
        "--json",
        default=None,
        metavar="OUT",
        help="write the config, every step's figures per strategy and the totals as JSON",
    )
    parser.add_argument(
        "--megatron-dev",
        default=None,
        metavar="PATH",
        help="a Megatron-LM tree of the dev branch: megatron-dcp-dev runs its DefaultDynamicCPScheduler "
        "(imported from there in a worker process, never copied) (default: $BYTESCALE_MEGATRON_DEV)",
    )
    parser.add_argument("--plot", default=None, metavar="OUT.png", help="Gantt chart of the first step")


def config_from_args(args: argparse.Namespace) -> SimConfig:
    from ..sim.simulate import SimConfig, default_strategies
    from ..sim.strategies import parse_strategies

    return SimConfig(
        gpus=args.gpus,
        context=parse_size(args.context, "context"),
        capacity=parse_size(args.capacity, "capacity"),
        global_batch_tokens=parse_size(args.global_batch_tokens, "global batch tokens"),
        model=args.model,
        hardware=args.hardware,
        tp=args.tp,
        pp=args.pp,
        ep=args.ep,
        gpus_per_node=args.gpus_per_node,
        dataset=args.dataset,
        lengths_file=args.lengths_file,
        strategies=(
            tuple(parse_strategies(args.strategies))
            if args.strategies
            else default_strategies(args.ep, args.model, args.megatron_dev)
        ),
        steps=args.steps,
        seed=args.seed,
        validate=args.validate,
        dkv_bf16=args.dkv_bf16,
        data_path=args.data_path,
        pipeline_schedule=args.pipeline_schedule,
        vpp=args.vpp,
        megatron_dev=args.megatron_dev,
        host_memory_per_gpu=(
            parse_size(args.host_memory_per_gpu, "--host-memory-per-gpu") if args.host_memory_per_gpu else None
        ),
    )


def main(args: argparse.Namespace) -> int:
    from ..sim.simulate import run

    cfg = config_from_args(args)
    report = run(cfg)
    if cfg.data_path:
        d = report.dataset
        source = f"dataset {d['prefix']} (training's batches, seed {cfg.seed})"
        print(
            f"shadow run on {d['prefix']}: {d['documents']:,} documents, {d['tokens']:,} tokens, longest "
            f"{format_size(d['longest_document'])} ({d['documents_over_context']} cut at the context); steps "
            + ", ".join(f"{n} seqs/{format_size(m)} longest" for n, m, _ in report.batch_stats)
        )
    elif cfg.lengths_file:
        source = f"lengths file {cfg.lengths_file}"
    else:
        source = f"{cfg.dataset}-like batches"
    print(
        f"{cfg.model} on {report.cluster.describe()}; context {format_size(cfg.context)}, capacity "
        f"{format_size(cfg.capacity)}, {format_size(cfg.global_batch_tokens)} tokens/step of {source}; "
        f"{cfg.steps} step(s), ratios of totals"
        + (
            f"; VPP {cfg.vpp}: {cfg.vpp} model chunks per pipeline device for every strategy (static and "
            "megatron-dcp run Megatron's interleaved 1F1B over their micro-batches)"
            if cfg.vpp > 1
            else ""
        )
    )
    print(format_table(report))
    verdict = shadow_verdict(report)
    if verdict:
        print(verdict)
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_json(), indent=2) + "\n")
        print(f"wrote {args.json}")
    if args.plot:
        if report.timelines:
            from ..sim.plot import plot_timelines

            plot_timelines(
                report.timelines,
                args.plot,
                lower_bound=report.lower_bound_first,
                title=f"{cfg.model}, {report.cluster.describe()}, {format_size(cfg.context)} context, first step",
            )
            print(f"wrote {args.plot}")
        else:
            print("no strategy produced a timeline; nothing to plot", file=sys.stderr)
    return 0 if report.steps else 2
