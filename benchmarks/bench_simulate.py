"""Step time of the strategies on the headline setup (docs/design.md), against the project's goals.

    PYTHONPATH=. python benchmarks/bench_simulate.py [--dataset byted|github] [--steps 5]
        [any other `bytescale simulate` flag, e.g. --gpus 2048] [--json OUT] [--plot OUT.png]

LLaMA-7B (analytic cost model, H100 nodes of 8), 1024 GPUs (TP 1, PP 1), 2M context, 8K
capacity, 32M-token Byted-like batches: every step, each strategy plans the same batch and
the simulator costs every plan with the same cost model (``megatron_bytescale/sim``). Prints
the mean step time over the steps, the speedup over static and the ratio to the lower bound
(all FLOPs spread perfectly over all GPUs) as ratios of totals over the steps (throughput:
``sim/throughput.py``; the medians of the per-step ratios beside them), the planner's wall
time, and the goals:

* hdp-balanced at least 3x faster than static,
* hdp-balanced ahead of megatron-dcp,
* hdp-balanced within 1.15x of the lower bound,

each checked on the totals and on every step alone (batches differ from step to step), plus a per-step table with
the batch's lower bound (LB) and the critical path of its longest sequence (CP: that
sequence alone on its best ring; no plan can beat max(LB, CP)).

Static's plans are large (every sequence split over CP=256 ranks: ~10^6 pieces), so a step
takes ~1 minute of CPU here; only the first step's plans are validated.

Pipeline parallelism (``--pipeline-grid``): the same batches on 8,192 GPUs with TP 8 and
PP 2 or 4, for LLaMA-70B and Mistral-8x22B (static, hdp-naive, hdp-balanced = PP-balance),
one row per model and PP size: mean step times, hdp-balanced's ratio to static and to the
lower bound (and to max(lower bound, critical path)) as ratios of totals, and the planner's
own total estimate against the total simulated step. The JSON keeps every batch.

    PYTHONPATH=. python benchmarks/bench_simulate.py --pipeline-grid [--dataset github] [--steps 2] [--json OUT]

Virtual pipeline stages (``--vpp-grid``): LLaMA-70B on 8,192 GPUs, TP 8, PP 4, with 1, 2,
4 and 5 model chunks per device for every strategy (static runs Megatron's interleaved 1F1B
over its micro-batches): static's and hdp-balanced's mean step, hdp-balanced's ratios of
totals to static, to the lower bound and to max(lower bound, critical path), the planner's
total estimate against the total simulated step, the mean floor of rings spanning every
pipeline, and the most chunk forwards a device holds.

    PYTHONPATH=. python benchmarks/bench_simulate.py --vpp-grid [--vpp-values 1,5] [--dataset github]
        [--steps 2] [--json OUT]

Expert parallelism (``--ep-grid``): the MoE models on 1,024 GPUs without pipelines (EP needs
PP 1 under HDP), Mistral-8x7B at TP 2 with EP 1 and 4 (an EP group in one node) and
Mistral-8x22B at TP 4 with EP 1, 2 and 8 (across four nodes): static's and hdp-balanced's
mean step, hdp-balanced's mean exposed MoE all-to-alls and idle time (empty and waiting
slots), and its ratios of totals to static and to the lower bound.

    PYTHONPATH=. python benchmarks/bench_simulate.py --ep-grid [--dataset github] [--steps 1] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_bytescale.commands.simulate import add_arguments, config_from_args, format_table  # noqa: E402
from megatron_bytescale.planner.expert.timing import ep_all_to_all_time  # noqa: E402
from megatron_bytescale.sim.simulate import run  # noqa: E402
from megatron_bytescale.sim.throughput import totals  # noqa: E402
from megatron_bytescale.units import format_size  # noqa: E402

# the headline setup; flags given on the command line come later and win
HEADLINE = [
    "--model",
    "llama-7b",
    "--hardware",
    "h100",
    "--gpus",
    "1024",
    "--context",
    "2M",
    "--capacity",
    "8K",
    "--global-batch-tokens",
    "32M",
]

GOALS = (
    (
        "hdp-balanced >= 3x faster than static",
        lambda r: r["static"]["step_time_s"] / r["hdp-balanced"]["step_time_s"] >= 3.0,
    ),
    (
        "hdp-balanced ahead of megatron-dcp",
        lambda r: r["hdp-balanced"]["step_time_s"] < r["megatron-dcp"]["step_time_s"],
    ),
    ("hdp-balanced within 1.15x of the lower bound", lambda r: r["hdp-balanced"]["x_lower_bound"] <= 1.15),
)


def goal_verdicts(steps: list[dict[str, dict]]) -> dict[str, dict]:
    """Each goal checked on the run's totals (throughput) and on every step's figures (the
    batches differ from step to step)."""
    out = {}
    names = list(steps[0]) if steps else []
    run_total = {
        n: {
            "step_time_s": totals([s[n] for s in steps])["total_step_time_s"],
            "x_lower_bound": totals([s[n] for s in steps])["x_lower_bound"],
        }
        for n in names
    }
    for text, check in GOALS:
        try:
            met = [bool(check(step)) for step in steps]
            on_totals = bool(check(run_total))
        except KeyError:  # a strategy it needs did not run
            out[text] = {"met_steps": None, "steps": len(steps)}
            continue
        out[text] = {"met_on_totals": on_totals, "met_steps": sum(met), "steps": len(steps), "per_step": met}
    return out


# the pipeline rows: (model, PP) on 8,192 GPUs with TP 8
PIPELINE_GRID = (("llama-70b", 2), ("llama-70b", 4), ("mistral-8x22b", 2), ("mistral-8x22b", 4))
PIPELINE_FLAGS = ["--gpus", "8192", "--tp", "8", "--strategies", "static,hdp-naive,hdp-balanced"]


# the expert-parallel rows: (model, TP, EP) on 1,024 GPUs, PP 1
EP_GRID = (
    ("mistral-8x7b", 2, 1),
    ("mistral-8x7b", 2, 4),
    ("mistral-8x22b", 4, 1),
    ("mistral-8x22b", 4, 2),
    ("mistral-8x22b", 4, 8),
)
EP_FLAGS = ["--strategies", "static,hdp-balanced"]


def grid_row(report, others: dict[str, str]) -> dict:
    """hdp-balanced's figures over the row's batches against static: mean steps, ratios of
    totals (the per-batch medians beside them, labelled so), the planner's total estimate
    over the total simulated step, and every batch's step times and bounds.
    ``others``: label -> strategy whose mean step the row also shows."""
    bal, base = report.steps["hdp-balanced"], report.steps["static"]
    t = totals(bal, base)
    row = {
        "steps": t["batches"],
        "balanced_s": t["mean_step_time_s"],
        "balanced_vs_static": t["speedup"],
        "balanced_vs_static_per_batch_median": t["speedup_per_batch_median"],
        "balanced_x_lb": t["x_lower_bound"],
        "balanced_x_lb_per_batch_median": t["x_lower_bound_per_batch_median"],
        "balanced_x_bound": t["x_bound"],
        "estimate_vs_sim": sum(b["planner_estimate_s"] for b in bal) / t["total_step_time_s"],
        "plan_s": sum(b["plan_time_s"] for b in bal) / len(bal),
    }
    for label, name in others.items():
        row[label] = totals(report.steps[name])["mean_step_time_s"]
    row["per_batch"] = [
        {
            "lower_bound_s": b["lower_bound_s"],
            "critical_path_s": b["critical_path_s"],
            **{f"{name}_step_s": report.steps[name][i]["step_time_s"] for name in ("hdp-balanced", *others.values())},
        }
        for i, b in enumerate(bal)
    ]
    return row


def pipeline_grid(argv: list[str]) -> int:
    """One row per (model, PP): each strategy's mean step, hdp-balanced's ratios of totals."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(ap)
    ap.add_argument("--pipeline-grid", action="store_true")
    rows = []
    for model, pp in PIPELINE_GRID:
        args = ap.parse_args(HEADLINE + PIPELINE_FLAGS + argv + ["--model", model, "--pp", str(pp)])
        cfg = config_from_args(args)
        report = run(cfg)
        rows.append(
            {
                "model": model,
                "pp": pp,
                "dataset": cfg.dataset,
                "gpus": cfg.gpus,
                "tp": cfg.tp,
                "seed": cfg.seed,
                **grid_row(report, {"static_s": "static", "naive_s": "hdp-naive"}),
            }
        )
        r = rows[-1]
        print(
            f"{model:<14} PP {pp}  static {r['static_s']:7.2f}  naive {r['naive_s']:7.2f}"
            f"  balanced {r['balanced_s']:7.2f}"
            f"  vs static {r['balanced_vs_static']:5.2f}x ({r['balanced_vs_static_per_batch_median']:5.2f}x)"
            f"  x LB {r['balanced_x_lb']:5.2f} ({r['balanced_x_lb_per_batch_median']:5.2f})"
            f"  x bound {r['balanced_x_bound']:5.2f}"
            f"  estimate/sim {r['estimate_vs_sim']:5.3f}  plan {r['plan_s']:5.2f} s",
            flush=True,
        )
    print(GRID_LEGEND)
    return _write_rows(args.json, rows)


GRID_LEGEND = (
    "steps: means over the batches; vs static, x LB, x bound: ratios of totals over the batches "
    "(in brackets: median of the per-batch ratios); estimate/sim: total estimate / total simulated step"
)

# the virtual-stage rows: LLaMA-70B, TP 8, PP 4, V chunks per device
VPP_GRID = (1, 2, 4, 5)  # V divides the 20 layers a device holds
VPP_FLAGS = ["--gpus", "8192", "--tp", "8", "--pp", "4", "--model", "llama-70b", "--strategies", "static,hdp-balanced"]


def vpp_grid(argv: list[str]) -> int:
    """One row per V: mean steps, hdp-balanced's ratios of totals."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(ap)
    ap.add_argument("--vpp-grid", action="store_true")
    ap.add_argument("--vpp-values", default=",".join(map(str, VPP_GRID)), help="the rows' V (default 1,2,4,5)")
    rows = []
    for v in [int(x) for x in ap.parse_known_args(HEADLINE + VPP_FLAGS + argv)[0].vpp_values.split(",")]:
        args = ap.parse_args(HEADLINE + VPP_FLAGS + argv + ["--vpp", str(v)])
        cfg = config_from_args(args)
        report = run(cfg)
        bal = report.steps["hdp-balanced"]
        rows.append(
            {
                "model": cfg.model,
                "pp": cfg.pp,
                "vpp": v,
                "dataset": cfg.dataset,
                "gpus": cfg.gpus,
                "seed": cfg.seed,
                **grid_row(report, {"static_s": "static"}),
                "lower_bound_s": sum(b["lower_bound_s"] for b in bal) / len(bal),
                "ring_floor_s": sum(b["pipeline_ring_floor_s"] for b in bal) / len(bal),
                "chunks_in_flight_max": max(b["chunks_in_flight_max"] for b in bal),
                "host_gb_max_gpu": max(b["host_bytes_max_gpu"] for b in bal) / 1e9,
            }
        )
        r = rows[-1]
        print(
            f"{cfg.model} PP {cfg.pp} VPP {v}  static {r['static_s']:7.2f}  balanced {r['balanced_s']:7.2f}"
            f"  vs static {r['balanced_vs_static']:5.2f}x ({r['balanced_vs_static_per_batch_median']:5.2f}x)"
            f"  x LB {r['balanced_x_lb']:5.2f} ({r['balanced_x_lb_per_batch_median']:5.2f})"
            f"  x bound {r['balanced_x_bound']:5.2f}"
            f"  LB {r['lower_bound_s']:6.2f}  ring floor {r['ring_floor_s']:6.2f}"
            f"  estimate/sim {r['estimate_vs_sim']:5.3f}  chunks in flight {r['chunks_in_flight_max']}"
            f"  host {r['host_gb_max_gpu']:5.1f} GB  plan {r['plan_s']:5.2f} s",
            flush=True,
        )
    print(GRID_LEGEND + "; LB, ring floor: means over the batches")
    return _write_rows(args.json, rows)


def _write_rows(path: str | None, rows: list[dict]) -> int:
    if path:
        Path(path).write_text(json.dumps(rows, indent=2) + "\n")
        print(f"wrote {path}")
    return 0


def all_to_all_floor_s(report, tokens: int) -> float:
    """Seconds of MoE all-to-alls an average rank cannot avoid: its share of the batch's
    tokens in one micro-batch (each further micro-batch adds latency). The simulator does not
    overlap them with compute, so a step takes at least its lower bound plus this."""
    cluster = report.cluster
    return ep_all_to_all_time(report.cost, tokens // cluster.d_hdp, cluster.ep, cluster.hdp_per_node)


def ep_grid(argv: list[str]) -> int:
    """One row per (model, TP, EP): mean steps, hdp-balanced's ratios of totals."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(ap)
    ap.add_argument("--ep-grid", action="store_true")
    rows = []
    ep1: dict[tuple, float] = {}  # (model, TP) -> hdp-balanced's total step time with EP 1
    for model, tp, ep in EP_GRID:
        args = ap.parse_args(HEADLINE + EP_FLAGS + argv + ["--model", model, "--tp", str(tp), "--ep", str(ep)])
        cfg = config_from_args(args)
        report = run(cfg)
        bal = report.steps["hdp-balanced"]
        total = sum(b["step_time_s"] for b in bal)
        if ep == 1:
            ep1[model, tp] = total
        rows.append(
            {
                "model": model,
                "tp": tp,
                "ep": ep,
                "dataset": cfg.dataset,
                "gpus": cfg.gpus,
                "seed": cfg.seed,
                **grid_row(report, {"static_s": "static"}),
                "balanced_moe_a2a_s": sum(b["exposed_moe_a2a_s"] for b in bal) / len(bal),
                "balanced_idle_s": sum(b["idle_mean_s"] for b in bal) / len(bal),
                "balanced_vs_ep1": total / ep1[model, tp] if (model, tp) in ep1 else None,
                # no EP plan beats its lower bound plus the all-to-alls of an average rank's tokens
                "ep_floor_vs_ep1": (
                    sum(b["lower_bound_s"] + all_to_all_floor_s(report, s[2]) for b, s in zip(bal, report.batch_stats))
                    / ep1[model, tp]
                    if (model, tp) in ep1
                    else None
                ),
            }
        )
        r = rows[-1]
        vs_ep1 = ""
        if r["balanced_vs_ep1"]:
            vs_ep1 = f"  vs EP 1 {r['balanced_vs_ep1']:5.3f}x (floor {r['ep_floor_vs_ep1']:5.3f}x)"
        print(
            f"{model:<14} TP {tp} EP {ep}  static {r['static_s']:7.2f}  balanced {r['balanced_s']:7.2f}"
            f"  MoE a2a {r['balanced_moe_a2a_s']:5.2f}  idle {r['balanced_idle_s']:5.2f}"
            f"  vs static {r['balanced_vs_static']:5.2f}x ({r['balanced_vs_static_per_batch_median']:5.2f}x)"
            f"  x LB {r['balanced_x_lb']:5.3f} ({r['balanced_x_lb_per_batch_median']:5.3f})"
            f"  estimate/sim {r['estimate_vs_sim']:5.3f}{vs_ep1}",
            flush=True,
        )
    print(
        GRID_LEGEND + "; MoE a2a, idle: means over the batches; vs EP 1: total step time over the same model and "
        "TP's with EP 1; floor: the sum of the batches' lower bounds plus an average rank's all-to-alls, "
        "over EP 1's total"
    )
    return _write_rows(args.json, rows)


def main() -> int:
    if "--pipeline-grid" in sys.argv[1:]:
        return pipeline_grid(sys.argv[1:])
    if "--ep-grid" in sys.argv[1:]:
        return ep_grid(sys.argv[1:])
    if "--vpp-grid" in sys.argv[1:]:
        return vpp_grid(sys.argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(ap)
    args = ap.parse_args(HEADLINE + sys.argv[1:])
    cfg = config_from_args(args)
    report = run(cfg)
    print(
        f"{cfg.model}, {report.cluster.describe()}, context {args.context}, capacity {args.capacity}, "
        f"{args.global_batch_tokens} tokens/step, {cfg.dataset}-like, {cfg.steps} steps (seed {cfg.seed})"
    )
    print(format_table(report))
    print()
    names = [n for n in cfg.strategies if n in report.steps]
    steps = [
        {n: report.steps[n][i] for n in names} for i in range(cfg.steps) if all(len(report.steps[n]) > i for n in names)
    ]
    print("per step (seconds; LB = lower bound, CP = critical path of the longest sequence):")
    print(
        f"{'step':>5}{'seqs':>6}{'longest':>9}{'LB':>8}{'CP':>8}"
        + "".join(f"{n:>14}" for n in names)
        + f"{'bal/LB':>8}"
    )
    for i, step in enumerate(steps):
        any_m = next(iter(step.values()))
        bal = step.get("hdp-balanced", {}).get("x_lower_bound")
        print(
            f"{i:>5}{report.batch_stats[i][0]:>6}{format_size(report.batch_stats[i][1]):>9}{any_m['lower_bound_s']:>8.2f}"
            f"{any_m['critical_path_s']:>8.2f}"
            + "".join(f"{step[n]['step_time_s']:>14.2f}" for n in names)
            + (f"{bal:>8.3f}" if bal else "")
        )
    if steps:
        any_name = names[0]
        tot = {n: totals([s[n] for s in steps]) for n in names}
        print(
            f"{'total':>5}{sum(b[0] for b in report.batch_stats[: len(steps)]):>6}{'':>9}"
            f"{tot[any_name]['total_lower_bound_s']:>8.2f}{'':>8}"
            + "".join(f"{tot[n]['total_step_time_s']:>14.2f}" for n in names)
            + (f"{tot['hdp-balanced']['x_lower_bound']:>8.3f}" if "hdp-balanced" in tot else "")
        )
    print()
    goals = goal_verdicts(steps)
    for text, v in goals.items():
        if v["met_steps"] is None:
            print(f"n/a   {text}")
        else:
            print(
                f"{'MET ' if v['met_on_totals'] else 'MISS'}  {text} on the totals; met in {v['met_steps']} of "
                f"{v['steps']} steps alone"
            )
    if args.json:
        data = report.to_json()
        data["goals"] = goals
        Path(args.json).write_text(json.dumps(data, indent=2) + "\n")
        print(f"wrote {args.json}")
    if args.plot and report.timelines:
        from megatron_bytescale.sim.plot import plot_timelines

        plot_timelines(
            report.timelines,
            args.plot,
            lower_bound=report.lower_bound_first,
            title=f"{cfg.model}, {report.cluster.describe()}, {args.context} context, first step",
        )
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
