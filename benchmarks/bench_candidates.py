"""What each kind of candidate the planner's search tries (``planner/search.py``'s docstring)
earns, on the simulator's headline batches: every batch is planned and simulated with all
candidates (``bytescale simulate``'s hdp-balanced), then with each kind left out in turn.

    PYTHONPATH=. python benchmarks/bench_candidates.py [--only dp,pp,vpp,ep] [--steps 6] [--json OUT]

A kind is left out through the tuple its search reads (``search.RETARGET``,
``search.PIPELINE_RETARGET``, ``search.PIPELINE_ORDERED``, ``search.ORDERS``,
``order.slots.FALLBACKS``, ``order.stage_schedule.CHUNK_ORDERS``), set for one plan and put
back; the stage-order search is ``pipeline_schedule="search"`` against the default 1F1B. A kind
*wins* a batch where the simulated step is longer without it; its gain is the total step time
over the batches without it against the total with it. A plan identical to the full one (the
same digest) is not simulated again.

The configurations are those of docs/results.md's tables, ``--steps`` batches each (seed 0,
the simulator's draws), Byted-like and GitHub-like: ``dp`` LLaMA-7B on 1,024 GPUs (the
headline), ``pp`` LLaMA-70B on 8,192 GPUs, TP 8 x PP 4, ``vpp`` the same with 5 model chunks,
``ep`` Mistral-8x7B on 1,024 GPUs, TP 2, EP 4; 2M context, 8K capacity, 32M tokens.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_planner import plan_digest  # noqa: E402

from megatron_bytescale.data.workloads import sample_lengths  # noqa: E402
from megatron_bytescale.errors import BytescaleError  # noqa: E402
from megatron_bytescale.planner import search  # noqa: E402
from megatron_bytescale.planner.order import slots, stage_schedule  # noqa: E402
from megatron_bytescale.sim.simulate import SimConfig, check_config, collector_paused  # noqa: E402
from megatron_bytescale.sim.strategies import StrategyInput, make_plan  # noqa: E402
from megatron_bytescale.sim.timeline import evaluate  # noqa: E402

CAPACITY, CONTEXT, TOKENS = 8192, 2 << 20, 32 << 20
# name: (model, GPUs, TP, PP, VPP, EP)
CONFIGS = {
    "dp": ("llama-7b", 1024, 1, 1, 1, 1),
    "pp": ("llama-70b", 8192, 8, 4, 1, 1),
    "vpp": ("llama-70b", 8192, 8, 4, 5, 1),
    "ep": ("mistral-8x7b", 1024, 2, 1, 1, 4),
}


def _without(tup: tuple, item) -> tuple:
    return tuple(x for x in tup if x != item)


def kinds(pp: int, vpp: int) -> list[tuple[str, str, dict]]:
    """(group, kind, what to set) for every kind that can win in a configuration: what to set
    maps (module, tuple's name) to the value without the kind, or "schedule" to the
    ``pipeline_schedule`` the kind is."""
    if pp == 1:
        return [("retarget", f"x{s}", {(search, "RETARGET"): _without(search.RETARGET, s)}) for s in search.RETARGET]
    out = [
        ("pipeline retarget", f"x{s}", {(search, "PIPELINE_RETARGET"): _without(search.PIPELINE_RETARGET, s)})
        for s in search.PIPELINE_RETARGET
    ]
    for k in range(search.PIPELINE_ORDERED, 1, -1):  # the k-th smallest bound (and those after it)
        out.append(("pipeline ordered", f"bound #{k}", {(search, "PIPELINE_ORDERED"): k - 1}))
    out += [("1F1B order", o, {(search, "ORDERS"): _without(search.ORDERS, o)}) for o in search.ORDERS]
    out += [("deadlock fallback", f, {(slots, "FALLBACKS"): _without(slots.FALLBACKS, f)}) for f in slots.FALLBACKS]
    if vpp > 1:
        orders = stage_schedule.CHUNK_ORDERS
        out += [("chunk order", c, {(stage_schedule, "CHUNK_ORDERS"): _without(orders, c)}) for c in orders]
    else:
        out.append(("stage orders", 'pipeline_schedule="search"', {"schedule": "1f1b"}))
    return out


@contextmanager
def leaving_out(settings: dict):
    """The search's tuples set as ``settings`` says for the block, then put back."""
    kept = {key: getattr(*key) for key in settings if key != "schedule"}
    try:
        for key, value in settings.items():
            if key != "schedule":
                setattr(*key, value)
        yield
    finally:
        for key, value in kept.items():
            setattr(*key, value)


def _plan(x: StrategyInput, cluster, cost, digest: str | None = None) -> tuple[str, float, float]:
    """(digest, simulated step seconds, plan seconds) of hdp-balanced's plan (inf: no plan);
    a plan of digest ``digest`` is not simulated (nan)."""
    try:
        with collector_paused():
            t0 = time.perf_counter()
            plan = make_plan("hdp-balanced", x)
            wall = time.perf_counter() - t0
            d = plan_digest(plan)
            return d, float("nan") if d == digest else evaluate(plan, cluster, cost).timeline.step_time, wall
    except BytescaleError as exc:
        return type(exc).__name__, float("inf"), 0.0


def run(only: list[str], steps: int) -> dict:
    out: dict = {"batches": [], "kinds": []}
    for name in only:
        model, gpus, tp, pp, vpp, ep = CONFIGS[name]
        sim = SimConfig(
            gpus, CONTEXT, CAPACITY, TOKENS, model=model, tp=tp, pp=pp, ep=ep, vpp=vpp, strategies=("hdp-balanced",)
        )
        cluster, cost = check_config(sim)
        # the default schedule is 1F1B; the stage-order search is the kind tried on top of it
        schedule_kind = pp > 1 and vpp == 1
        for dataset in ("byted", "github"):
            rng = np.random.default_rng(0)
            for step in range(steps):
                lengths = sample_lengths(dataset, TOKENS, CONTEXT, rng)
                t0 = time.perf_counter()
                x = StrategyInput(lengths, cluster, cost, CAPACITY, CONTEXT, "1f1b", vpp)
                digest, full, wall = _plan(x, cluster, cost)
                row = {"config": name, "dataset": dataset, "step": step, "step_s": full, "plan_s": wall, "without": {}}
                if schedule_kind:  # with the search: the full set; 1F1B is the search left out
                    y = StrategyInput(lengths, cluster, cost, CAPACITY, CONTEXT, "search", vpp)
                    searched = _plan(y, cluster, cost, digest)
                    searched = (searched[0], full if searched[0] == digest else searched[1])
                for group, kind, settings in kinds(pp, vpp):
                    if "schedule" in settings:
                        row["step_s_search"] = searched[1]
                        row["without"][f"{group}: {kind}"] = {"step_s": full, "same_plan": searched[0] == digest}
                        continue
                    with leaving_out(settings):
                        d, s, _ = _plan(x, cluster, cost, digest)
                    row["without"][f"{group}: {kind}"] = {
                        "step_s": full if d == digest else s,
                        "same_plan": d == digest,
                    }
                out["batches"].append(row)
                print(f"{name} {dataset} step {step}: {full:.3f} s ({time.perf_counter() - t0:.0f} s)", flush=True)
        for group, kind, settings in kinds(pp, vpp):
            key = f"{group}: {kind}"
            rows = [b for b in out["batches"] if b["config"] == name]
            if "schedule" in settings:
                with_ = sum(b["step_s_search"] for b in rows)
                without = sum(b["step_s"] for b in rows)
                wins = sum(b["step_s_search"] < b["step_s"] * (1 - 1e-9) for b in rows)
                changed = sum(not b["without"][key]["same_plan"] for b in rows)
            else:
                with_ = sum(b["step_s"] for b in rows)
                without = sum(b["without"][key]["step_s"] for b in rows)
                wins = sum(b["without"][key]["step_s"] > b["step_s"] * (1 + 1e-9) for b in rows)
                changed = sum(not b["without"][key]["same_plan"] for b in rows)
            out["kinds"].append(
                {
                    "config": name,
                    "kind": key,
                    "batches": len(rows),
                    "wins": wins,
                    "plans_changed": changed,
                    "gain": without / with_,
                }
            )
    return out


def table(kinds_: list[dict]) -> str:
    """A row per group of kinds and configuration: each kind's wins, plans changed and gain,
    in the order the row names the kinds."""
    rows: dict[tuple[str, str], list[dict]] = {}
    for k in kinds_:
        group = k["kind"].split(": ", 1)[0]
        rows.setdefault((group, k["config"]), []).append(k)
    lines = [
        "| candidate kinds | config | wins (of batches) | plans changed | gain, % of the total |",
        "|---" * 5 + "|",
    ]
    for (group, config), ks in rows.items():
        names = " / ".join(k["kind"].split(": ", 1)[1] for k in ks)
        gains = " / ".join("no plan" if k["gain"] == float("inf") else f"{100 * (k['gain'] - 1):+.2f}" for k in ks)
        wins = "/".join(str(k["wins"]) for k in ks) + f" (of {ks[0]['batches']})"
        changed = "/".join(str(k["plans_changed"]) for k in ks)
        lines.append(f"| {group}: {names} | {config} | {wins} | {changed} | {gains} |")
    return "\n".join(lines).replace("+0.00", "0").replace("-0.00", "0")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default="dp,pp,vpp,ep", help="configurations, comma-separated: dp, pp, vpp, ep")
    p.add_argument("--steps", type=int, default=6, help="batches per dataset and configuration")
    p.add_argument("--json", help="write every batch's step times here")
    args = p.parse_args(argv)
    only = args.only.split(",")
    unknown = [c for c in only if c not in CONFIGS]
    if unknown:
        p.error(f"--only {','.join(unknown)}: choose from {', '.join(CONFIGS)}")
    out = run(only, args.steps)
    print(table(out["kinds"]))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
