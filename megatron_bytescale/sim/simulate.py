"""``bytescale simulate``: compare strategies on a simulated cluster, step by step.

Every step draws one global batch of sequence lengths (a synthetic workload, a lengths
file, or the user's own Megatron dataset), each strategy plans it, and the timeline engine
costs every plan with the same cost model on the same cluster. Speedups and "x lower bound"
are ratios of totals over the steps (``sim/throughput.py``: what a training run measures),
other figures means over the steps; ``--json`` keeps every step's figures. The Gantt chart
shows the first step.

With ``--data-path PREFIX`` (a Megatron indexed dataset, read through megatron-core) the
batches are the ones training would see: ``GlobalBatchSampler`` over the dataset's document
lengths, documents cut at ``--context``, ``--global-batch-tokens`` per step, the same
``--seed`` (a shadow run of the training's first steps: "what would HDP save on my data?").
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from ..data.workloads import lengths_from_file, read_lengths_file, sample_lengths, training_batches
from ..errors import ConfigError
from ..planner.cost_model import CostModel
from ..planner.plan_cli import check_vpp, with_host_memory
from ..planner.specs import HardwareSpec, ModelSpec
from ..units import format_size, parse_size, seed
from .cluster import Cluster
from .static_cp import StrategyError
from .strategies import STRATEGIES, StrategyInput, make_plan, parse_strategies
from .throughput import means, totals
from .timeline import Timeline, evaluate


@dataclass(frozen=True)
class SimConfig:
    gpus: int
    context: int
    capacity: int
    global_batch_tokens: int
    model: str = "llama-7b"
    hardware: str = "h100"
    tp: int = 1
    pp: int = 1
    ep: int = 1  # expert parallelism (MoE models): aligned micro-batch slots per EP group
    gpus_per_node: int | None = None  # default: the hardware's
    dataset: str = "byted"
    lengths_file: str | None = None
    strategies: tuple[str, ...] = tuple(STRATEGIES)
    steps: int = 5
    seed: int = 0
    validate: str = "first"  # "first" | "all" | "none": which steps' plans to check with Plan.validate
    dkv_bf16: bool = False  # ring attention sends the backward's dK/dV accumulators in bf16
    host_memory_per_gpu: int | None = None  # bytes; default: the hardware spec's host_memory_bytes
    # a Megatron indexed dataset, or a blend (W1 P1 W2 P2 ...): draw the batches training would see
    data_path: str | list[str] | None = None
    pipeline_schedule: str = "1f1b"  # HDP plans with PP: "1f1b", or "search" for per-stage orders
    vpp: int = 1  # model chunks per pipeline device (virtual pipeline stages), every strategy


@dataclass
class SimReport:
    config: SimConfig
    cluster: Cluster
    cost: CostModel
    steps: dict[str, list[dict]] = field(default_factory=dict)  # strategy -> metrics per step
    errors: dict[str, str] = field(default_factory=dict)  # strategy -> why it produced no result
    notes: dict[str, list[str]] = field(default_factory=dict)
    timelines: dict[str, Timeline] = field(default_factory=dict)  # first step
    batch_stats: list[tuple[int, int, int]] = field(default_factory=list)  # per step: sequences, longest, tokens
    dataset: dict = field(default_factory=dict)  # --data-path: documents, tokens, longest document
    lower_bound_first: float = 0.0

    def results(self) -> dict[str, dict]:
        """Per strategy: its means over the steps, overwritten by the totals and ratios of totals
        (``speedup_vs_static``: static's total step time over this one's, on the same batches;
        ``x_lower_bound``, ``x_bound``: total step time over the sum of the steps' bounds), the
        per-step medians of those ratios beside them (``..._per_batch_median``), and every
        step's own figures (``per_batch``)."""
        out = {}
        base = self.steps.get("static") if "static" not in self.errors else None
        for name in self.config.strategies:
            if name in self.errors:
                out[name] = {"error": self.errors[name]}
                continue
            rows = self.steps.get(name, [])
            if not rows:
                continue
            res = means(rows)
            tot = totals(rows, base if base and len(base) == len(rows) else None)
            if "speedup" in tot:
                tot["speedup_vs_static"] = tot.pop("speedup")
                tot["speedup_vs_static_per_batch_median"] = tot.pop("speedup_per_batch_median")
            res.update(tot)
            res["per_batch"] = rows
            if self.notes.get(name):
                res["notes"] = self.notes[name]
            out[name] = res
        return out

    def to_json(self) -> dict:
        cfg = asdict(self.config)
        cfg["strategies"] = list(self.config.strategies)
        cfg["d_hdp"] = self.cluster.d_hdp
        cfg["gpus_per_node"] = self.cluster.gpus_per_node
        cfg["cost_model"] = asdict(self.cost)
        out = {"config": cfg, "results": self.results()}
        if self.dataset:
            out["dataset"] = self.dataset
        out["batches"] = [{"sequences": n, "longest": m, "tokens": t} for n, m, t in self.batch_stats]
        return out


NO_EXPERT_SLOTS = "megatron-dcp"  # its plans carry barriers, which EP slot alignment does not handle


def check_config(cfg: SimConfig) -> tuple[Cluster, CostModel]:
    model = ModelSpec.load(cfg.model)
    hw = HardwareSpec.load(cfg.hardware)
    cluster = Cluster(
        cfg.gpus, cfg.tp, cfg.pp, hw.gpus_per_node if cfg.gpus_per_node is None else cfg.gpus_per_node, cfg.ep
    )
    if cfg.ep > 1 and not model.num_experts:
        raise ConfigError(
            f"--ep {cfg.ep}: model {model.name!r} has no experts; "
            "expert parallelism needs a MoE model (e.g. mistral-8x7b)"
        )
    cost = with_host_memory(
        CostModel.analytic(model, hw, tp=cfg.tp, pp=cfg.pp, dkv_bf16=cfg.dkv_bf16), cfg.host_memory_per_gpu
    )
    if cfg.capacity <= 0 or cfg.context <= 0 or cfg.global_batch_tokens <= 0:
        raise ConfigError("capacity, context and global batch tokens must be positive")
    if cfg.context < cfg.capacity:
        raise ConfigError(
            f"context {cfg.context} is smaller than the capacity {cfg.capacity}; the capacity is what one rank "
            "holds of a longer sequence, so give a context >= capacity"
        )
    if cfg.context > cfg.capacity * cluster.d_hdp:
        raise ConfigError(
            f"a {cfg.context}-token sequence does not fit on {cluster.d_hdp} HDP ranks of capacity {cfg.capacity}; "
            "raise the capacity or the GPU count, or lower the context"
        )
    if cfg.global_batch_tokens < cfg.context:
        raise ConfigError(
            f"--global-batch-tokens {format_size(cfg.global_batch_tokens)} "
            f"is smaller than --context {format_size(cfg.context)}: "
            "a context-long sequence could never be in a batch; raise --global-batch-tokens or lower --context"
        )
    if cfg.steps <= 0:
        raise ConfigError(f"--steps must be positive, got {cfg.steps}")
    if cfg.validate not in ("first", "all", "none"):
        raise ConfigError(f"--validate must be first, all or none, got {cfg.validate!r}")
    check_vpp(cfg.vpp, cfg.pp, cost.num_layers)
    parse_strategies(",".join(cfg.strategies))
    if cfg.ep > 1 and NO_EXPERT_SLOTS in cfg.strategies:
        raise ConfigError(
            f"--ep {cfg.ep}: {NO_EXPERT_SLOTS} is not simulated with expert parallelism (its barrier-separated "
            "groups are not aligned into EP slots); drop it from --strategies"
        )
    return cluster, cost


def default_strategies(ep: int) -> tuple[str, ...]:
    """Every strategy the simulator can cost at this EP size."""
    return tuple(n for n in STRATEGIES if not (ep > 1 and n == NO_EXPERT_SLOTS))


def run(cfg: SimConfig, progress: bool = True) -> SimReport:
    cluster, cost = check_config(cfg)
    rng = np.random.default_rng(cfg.seed)
    pool = read_lengths_file(cfg.lengths_file) if cfg.lengths_file else None
    report = SimReport(config=cfg, cluster=cluster, cost=cost)
    batches = None
    if cfg.data_path:
        batches, report.dataset = training_batches(cfg.data_path, cfg.global_batch_tokens, cfg.context, cfg.seed)
    bar = tqdm(
        total=cfg.steps * len(cfg.strategies), disable=not progress or cfg.steps == 1, file=sys.stderr, unit="plan"
    )
    for step in range(cfg.steps):
        if batches is not None:
            lengths = next(batches)
        elif pool is not None:
            lengths = lengths_from_file(pool, cfg.global_batch_tokens, cfg.context, rng)
        else:
            lengths = sample_lengths(cfg.dataset, cfg.global_batch_tokens, cfg.context, rng)
        report.batch_stats.append((len(lengths), max(lengths), sum(lengths)))
        x = StrategyInput(lengths, cluster, cost, cfg.capacity, cfg.context, cfg.pipeline_schedule, cfg.vpp)
        this_step: dict[str, dict] = {}
        for name in cfg.strategies:
            bar.set_description(f"step {step + 1}/{cfg.steps} {name}")
            if name not in report.errors:
                try:
                    plan = make_plan(name, x)
                    if cfg.validate == "all" or (cfg.validate == "first" and step == 0):
                        plan.validate()
                    result = evaluate(plan, cluster, cost)
                except StrategyError as exc:
                    report.errors[name] = str(exc)
                else:
                    this_step[name] = result.metrics()
                    if "est_time_max_s" in plan.meta:  # the planner's own estimate of the step
                        this_step[name]["planner_estimate_s"] = float(plan.meta["est_time_max_s"])
                    report.steps.setdefault(name, []).append(this_step[name])
                    for note in result.notes:
                        report.notes.setdefault(name, [])
                        if note not in report.notes[name]:
                            report.notes[name].append(note)
                    if step == 0:
                        report.timelines[name] = result.timeline
                        report.lower_bound_first = result.lower_bound
            bar.update(1)
    bar.close()
    return report


def format_table(report: SimReport) -> str:
    """Step: the mean over the steps (their total / the count); speedup and x LB, x bound:
    ratios of totals; "per batch": the median of the per-step ratios, beside them; the other
    columns are means over the steps."""
    med = report.results()
    many = report.config.steps > 1
    head = (
        f"{'strategy':<14}{'step s':>9}{'speedup':>9}"
        + (f"{'(batch)':>9}" if many else "")
        + f"{'x LB':>7}"
        + (f"{'(batch)':>8}" if many else "")
        + f"{'x bound':>8}{'busy max':>9}{'busy avg':>9}"
        f"{'exp.comm':>9}{'P2P TB':>8}{'offl TB':>8}{'host GB':>8}{'mb max':>7}{'plan s':>8}"
    )
    lines = [head, "-" * len(head)]
    for name, m in med.items():
        if "error" in m:
            lines.append(f"{name:<14}n/a: {m['error']}")
            continue
        speedup = f"{m['speedup_vs_static']:.2f}x" if "speedup_vs_static" in m else "-"
        per_batch = f"{m['speedup_vs_static_per_batch_median']:.2f}x" if "speedup_vs_static" in m else "-"
        lines.append(
            f"{name:<14}{m['mean_step_time_s']:>9.2f}{speedup:>9}"
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
    hdp = report.steps.get("hdp-balanced", [])
    if not hdp or "hdp-balanced" in report.errors:
        return ""
    parts = []
    for name, label in (("static", "static DP x CP"), ("megatron-dcp", "Megatron's dynamic CP")):
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
    parser.add_argument("--gpus", type=int, required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE models; PP 1)")
    parser.add_argument("--gpus-per-node", type=int, default=None, help="default: the hardware spec's")
    parser.add_argument("--hardware", default="h100", help="a configs/hardware name or a YAML file")
    parser.add_argument("--context", required=True, help="longest sequence, e.g. 2M")
    parser.add_argument("--capacity", required=True, help="tokens per rank per micro-batch, e.g. 8K")
    parser.add_argument("--global-batch-tokens", required=True, help="tokens per step, e.g. 32M")
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
        help=f"comma-separated from {', '.join(STRATEGIES)} (default: all; with --ep > 1 all but "
        f"{NO_EXPERT_SLOTS}, whose barriers the simulator does not align for expert all-to-alls)",
    )
    parser.add_argument("--steps", type=int, default=5)
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
        "simulating all pipelines together, kept when shorter (planner/stage_schedule.py)",
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
    parser.add_argument("--plot", default=None, metavar="OUT.png", help="Gantt chart of the first step")


def config_from_args(args: argparse.Namespace) -> SimConfig:
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
        strategies=tuple(parse_strategies(args.strategies)) if args.strategies else default_strategies(args.ep),
        steps=args.steps,
        seed=args.seed,
        validate=args.validate,
        dkv_bf16=args.dkv_bf16,
        data_path=args.data_path,
        pipeline_schedule=args.pipeline_schedule,
        vpp=args.vpp,
        host_memory_per_gpu=(
            parse_size(args.host_memory_per_gpu, "--host-memory-per-gpu") if args.host_memory_per_gpu else None
        ),
    )


def main(args: argparse.Namespace) -> int:
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
            from .plot import plot_timelines

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
