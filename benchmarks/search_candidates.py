"""What each kind of candidate the planner's search tries (``planner/search.py``) gains, on the
simulator's batches: every batch is planned with all candidates, then without each kind in
turn; a kind's gain on a batch is how much longer the planner's estimated step
(``est_time_max_s``) gets without it.

    PYTHONPATH=. python benchmarks/search_candidates.py [--only headline,pipeline,vpp,ep] [--json OUT]

The batches are those of ``benchmarks/bench_simulate.py``: the headline (LLaMA-7B, 1,024 GPUs,
2M context, 32M tokens, six steps), the pipeline grid (LLaMA-70B and Mistral-8x22B, 8,192
GPUs, TP 8, PP 2 and 4, two steps), the VPP grid (LLaMA-70B, PP 4, V 2, 4, 5, two steps) and
the expert grid (Mistral-8x7B TP 2 EP 4, Mistral-8x22B TP 4 EP 2 and 8, one step), each
Byted-like and GitHub-like (seed 0: the simulator's draws, one after another).
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from unittest import mock  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_bytescale.data.workloads import sample_lengths  # noqa: E402
from megatron_bytescale.errors import BytescaleError  # noqa: E402
from megatron_bytescale.planner import search  # noqa: E402
from megatron_bytescale.planner.cost_model import CostModel  # noqa: E402
from megatron_bytescale.planner.order import stage_schedule  # noqa: E402
from megatron_bytescale.planner.planner import PlannerConfig, plan_step  # noqa: E402
from megatron_bytescale.planner.specs import HardwareSpec, ModelSpec  # noqa: E402

CAPACITY, CONTEXT, TOKENS = 8192, 2 << 20, 32 << 20


def _grids():
    """(grid, name, model, tp, pp, vpp, ep, gpus, steps) of every configuration."""
    yield "headline", "llama-7b 1024 GPUs", "llama-7b", 1, 1, 1, 1, 1024, 6
    for model, pp in (("llama-70b", 2), ("llama-70b", 4), ("mistral-8x22b", 2), ("mistral-8x22b", 4)):
        yield "pipeline", f"{model} PP {pp}", model, 8, pp, 1, 1, 8192, 2
    for vpp in (2, 4, 5):
        yield "vpp", f"llama-70b PP 4 V {vpp}", "llama-70b", 8, 4, vpp, 1, 8192, 2
    for model, tp, ep in (("mistral-8x7b", 2, 4), ("mistral-8x22b", 4, 2), ("mistral-8x22b", 4, 8)):
        yield "ep", f"{model} EP {ep}", model, tp, 1, 1, ep, 1024, 1


def _without(grid: str, pp: int, vpp: int):
    """(kind, the patches that leave it out) for the kinds that can win in this grid."""
    out = []
    if pp == 1:
        for scale in search.RETARGET[1:]:
            out.append((f"retarget x{scale}", [(search, "RETARGET", tuple(s for s in search.RETARGET if s != scale))]))
        return out
    for scale in search.PIPELINE_RETARGET[1:]:
        kept = tuple(s for s in search.PIPELINE_RETARGET if s != scale)
        out.append((f"pipeline target x{scale}", [(search, "PIPELINE_RETARGET", kept)]))
    for ordered in range(1, search.PIPELINE_ORDERED):
        out.append((f"{search.PIPELINE_ORDERED - ordered + 1}th+ best bound", [(search, "PIPELINE_ORDERED", ordered)]))
    for kind in search.ORDERS:
        out.append((f"{kind} order", [(search, "ORDERS", tuple(k for k in search.ORDERS if k != kind))]))
    if vpp > 1:
        for kind in stage_schedule.CHUNK_ORDERS:
            kept = tuple(k for k in stage_schedule.CHUNK_ORDERS if k != kind)
            out.append((f"chunk order: {kind}", [(stage_schedule, "CHUNK_ORDERS", kept)]))
    return out


def _estimate(lengths, config, cost, patches) -> float:
    """The planner's estimated step with ``patches`` applied (inf: no plan)."""
    with _patched(patches):
        try:
            return float(plan_step(lengths, config, cost).meta["est_time_max_s"])
        except BytescaleError:
            return float("inf")


class _patched:
    def __init__(self, patches):
        self.patches = [mock.patch.object(module, name, value) for module, name, value in patches]

    def __enter__(self):
        for p in self.patches:
            p.start()

    def __exit__(self, *exc):
        for p in reversed(self.patches):
            p.stop()


def run(only: set[str] | None) -> dict:
    hardware = HardwareSpec.load("h100")
    out: dict = {"batches": [], "gain": {}}
    for grid, name, model, tp, pp, vpp, ep, gpus, steps in _grids():
        if only and grid not in only:
            continue
        cost = CostModel.analytic(ModelSpec.load(model), hardware, tp=tp, pp=pp)
        config = PlannerConfig(
            num_ranks=gpus // (tp * pp),
            capacity=CAPACITY,
            ranks_per_node=max(1, 8 // tp),
            balance="pp" if pp > 1 else "dp",
            pipeline_stages=pp,
            virtual_stages=vpp,
            expert_parallel=ep,
        )
        for dataset in ("byted", "github"):
            rng = np.random.default_rng(0)
            for step in range(steps):
                lengths = sample_lengths(dataset, TOKENS, CONTEXT, rng)
                t0 = time.perf_counter()
                full = _estimate(lengths, config, cost, [])
                row = {"config": name, "dataset": dataset, "step": step, "estimate_s": full, "without": {}}
                for kind, patches in _without(grid, pp, vpp):
                    alone = _estimate(lengths, config, cost, patches)
                    row["without"][kind] = alone
                    gain = alone / full - 1.0
                    best = out["gain"].setdefault(kind, {"batches": 0, "wins": 0, "largest": 0.0, "where": None})
                    best["batches"] += 1
                    if gain > 1e-12:
                        best["wins"] += 1
                    if gain > best["largest"]:
                        best["largest"], best["where"] = gain, f"{name} {dataset} step {step}"
                out["batches"].append(row)
                print(f"{name} {dataset} step {step}: {full:.3f} s ({time.perf_counter() - t0:.0f} s)", flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", help="grids to run, comma-separated: headline, pipeline, vpp, ep")
    p.add_argument("--json", help="write every batch's estimates here")
    args = p.parse_args(argv)
    out = run(set(args.only.split(",")) if args.only else None)
    print(f"{'candidate kind':<34}{'batches':>8}{'wins':>6}{'largest gain':>14}  where")
    for kind, g in out["gain"].items():
        where = g["where"] or "-"
        print(f"{kind:<34}{g['batches']:>8}{g['wins']:>6}{100 * g['largest']:>13.2f}%  {where}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
