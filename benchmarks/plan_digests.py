"""Plan digests: the planner's plans hashed, to show that a change leaves every plan as it was.

    PYTHONPATH=. python benchmarks/plan_digests.py check              # the configurations below
    PYTHONPATH=. python benchmarks/plan_digests.py write              # ... and keep their digests
    PYTHONPATH=. python benchmarks/plan_digests.py --cases F record -- tests/test_plan.py ...
    PYTHONPATH=. python benchmarks/plan_digests.py --cases F replay

``check`` plans every configuration of ``CONFIGS`` (the benchmark's and the simulator's:
DP, PP, PP x V and EP balance, Byted-like and GitHub-like batches, offload on and off,
two-level rings, hdp-naive, the stage-order search and activation recompute) and compares
each plan's digest (``bench_planner.plan_digest``: SHA-256 of the plan without its meta)
with ``benchmarks/plan_digests.json``; a batch whose lengths hash differs from the one kept
there is reported as a changed input, not as a changed plan. ``write`` stores the digests.

``record`` runs pytest on the given test files and writes every plan the tests make through
``plan_step`` (its lengths, ``PlannerConfig``, ``CostModel`` and digest, one JSON line each,
gzip'd); ``replay`` plans each recorded case again and compares the digests.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import gzip  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_planner import MODES, plan_digest  # noqa: E402

from megatron_bytescale.errors import BytescaleError  # noqa: E402
from megatron_bytescale.planner.cost_model import CostModel  # noqa: E402
from megatron_bytescale.planner.planner import PlannerConfig, plan_step  # noqa: E402
from megatron_bytescale.planner.specs import HardwareSpec, ModelSpec  # noqa: E402

DIGESTS = ROOT / "benchmarks" / "plan_digests.json"
CAPACITY, CONTEXT = 8192, 2 << 20


def _batch(dataset: str, tokens: int, seed: int) -> list[int]:
    from megatron_bytescale.data.workloads import sample_lengths

    return list(sample_lengths(dataset, tokens, CONTEXT, np.random.default_rng(seed)))


def _mode(mode: str, gpus: int, **changes) -> tuple[dict, dict]:
    """A ``bench_planner`` mode on ``gpus`` GPUs: the cost model's and the config's fields."""
    model, tp, pp, vpp, ep, balance = MODES[mode]
    cost = dict(model=model, tp=tp, pp=pp)
    config = dict(
        num_ranks=gpus // (tp * pp),
        capacity=CAPACITY,
        ranks_per_node=max(1, 8 // tp),
        balance=balance,
        pipeline_stages=pp,
        virtual_stages=vpp,
        expert_parallel=ep,
    )
    config.update(changes)
    return cost, config


def _configs():
    """(name, dataset, tokens, seed, cost fields, config fields) of every configuration."""
    for dataset in ("byted", "github"):
        for mode in MODES:  # the benchmark's modes on its cluster, two batches, and on 2,048 GPUs
            for seed in (0, 1):
                yield (f"{mode}-16384-32M", dataset, 32 << 20, seed, *_mode(mode, 16384))
            for seed in (0, 1, 2):
                yield (f"{mode}-2048-4M", dataset, 4 << 20, seed, *_mode(mode, 2048))
        # the simulator's headline: LLaMA-7B on 1,024 GPUs, each balance, offload on and off
        for balance in ("dp", "pp", "none"):
            for offload in (True, False):
                name = f"llama-7b-1024-32M-{balance}-offload-{'on' if offload else 'off'}"
                cost = dict(model="llama-7b", tp=1, pp=1)
                config = dict(num_ranks=1024, capacity=CAPACITY, balance=balance, offload=offload)
                yield (name, dataset, 32 << 20, 0, cost, config)
        for stages in (2, 4):  # PP-balance and hdp-naive with pipelines, 1F1B and the order search
            for balance, schedule in (("pp", "1f1b"), ("pp", "search"), ("none", "1f1b"), ("dp", "1f1b")):
                cost = dict(model="llama-7b", tp=1, pp=stages)
                config = dict(
                    num_ranks=1024 // stages,
                    capacity=CAPACITY,
                    balance=balance,
                    pipeline_stages=stages,
                    pipeline_schedule=schedule,
                )
                yield (f"llama-7b-1024-8M-pp{stages}-{balance}-{schedule}", dataset, 8 << 20, 0, cost, config)
        # the simulator's pipeline and expert grids, smaller
        for model, pp, vpp in (("llama-70b", 4, 1), ("llama-70b", 4, 2), ("mistral-8x22b", 2, 1)):
            cost = dict(model=model, tp=8, pp=pp)
            config = dict(num_ranks=4096 // (8 * pp), capacity=CAPACITY, ranks_per_node=1, balance="pp")
            config.update(pipeline_stages=pp, virtual_stages=vpp)
            yield (f"{model}-4096-8M-pp{pp}-v{vpp}", dataset, 8 << 20, 0, cost, config)
        for model, tp, ep in (("mistral-8x7b", 2, 4), ("mistral-8x22b", 4, 8), ("mistral-8x22b", 4, 2)):
            cost = dict(model=model, tp=tp, pp=1)
            config = dict(num_ranks=1024 // tp, capacity=CAPACITY, ranks_per_node=8 // tp, expert_parallel=ep)
            for balance in ("dp", "none"):
                yield (f"{model}-1024-8M-ep{ep}-{balance}", dataset, 8 << 20, 0, cost, {**config, "balance": balance})
        # activation recompute (the cost model's recompute terms) with and without pipelines
        for granularity, method, layers, pp in (("selective", None, None, 1), ("full", "block", 8, 4)):
            cost = dict(model="llama-7b", tp=1, pp=pp, recompute=(granularity, method, layers))
            config = dict(num_ranks=1024 // pp, capacity=CAPACITY, balance="pp" if pp > 1 else "dp")
            config.update(pipeline_stages=pp)
            yield (f"llama-7b-1024-8M-recompute-{granularity}-pp{pp}", dataset, 8 << 20, 0, cost, config)


def _cost(fields: dict) -> CostModel:
    fields = dict(fields)
    recompute = fields.pop("recompute", None)
    model = ModelSpec.load(fields.pop("model"))
    cost = CostModel.analytic(model, HardwareSpec.load("h100"), **fields)
    return cost if recompute is None else cost.with_recompute(*recompute)


def _lengths_hash(lengths) -> str:
    return hashlib.sha256(np.asarray(lengths, dtype=np.int64).tobytes()).hexdigest()[:16]


def run_configs(only: str | None = None) -> dict:
    """Every configuration's lengths hash and plan digest, by name."""
    out, batches = {}, {}
    for name, dataset, tokens, seed, cost_fields, config_fields in _configs():
        key = f"{name}/{dataset}/seed{seed}"
        if only and only not in key:
            continue
        if (dataset, tokens, seed) not in batches:
            batches[dataset, tokens, seed] = _batch(dataset, tokens, seed)
        lengths = batches[dataset, tokens, seed]
        t0 = time.perf_counter()
        try:
            digest = plan_digest(plan_step(lengths, PlannerConfig(**config_fields), _cost(cost_fields)))
        except BytescaleError as e:  # a configuration the planner refuses: the kind of error is the result
            digest = type(e).__name__
        out[key] = {"lengths": _lengths_hash(lengths), "plan": digest}
        print(f"{key}: {out[key]['plan']} ({time.perf_counter() - t0:.2f} s)", flush=True)
    return out


def compare(found: dict, kept: dict) -> int:
    """Prints the differences; returns how many plans differ (a changed input is not counted)."""
    differ = 0
    for key, got in found.items():
        want = kept.get(key)
        if want is None:
            print(f"NEW {key}: {got['plan']}")
        elif want["lengths"] != got["lengths"]:
            print(f"INPUT CHANGED {key}: lengths {want['lengths']} -> {got['lengths']} (not comparable)")
        elif want["plan"] != got["plan"]:
            print(f"DIFFERENT {key}: {want['plan']} -> {got['plan']}")
            differ += 1
    print(f"{len(found)} plans, {differ} different")
    return differ


# ------------------------------------------------------------------ the tests' plans
def record(cases: Path, pytest_args: list[str]) -> int:
    """pytest on ``pytest_args``, every ``plan_step`` the tests make written to ``cases``."""
    import pytest

    from megatron_bytescale.planner import planner

    made = []
    inner = planner._plan_step

    def recording(seq_lens, config, cost):
        plan = inner(seq_lens, config, cost)
        made.append(
            {
                "lens": np.asarray(seq_lens).astype(np.int64).tolist(),
                "config": dataclasses.asdict(config),
                "cost": dataclasses.asdict(cost),
                "digest": plan_digest(plan),
            }
        )
        return plan

    planner._plan_step = recording
    rc = pytest.main(["-q", "-p", "no:cacheprovider", *pytest_args])
    unique = {json.dumps(c, sort_keys=True) for c in made}
    with gzip.open(cases, "wt") as f:
        for line in sorted(unique):
            f.write(line + "\n")
    print(f"recorded {len(made)} plans ({len(unique)} distinct) to {cases}; pytest exit {rc}")
    return 0


def replay(cases: Path) -> int:
    fields = {f.name for f in dataclasses.fields(PlannerConfig)}
    differ, total = 0, 0
    with gzip.open(cases, "rt") as f:
        for line in f:
            case = json.loads(line)
            config = PlannerConfig(**{k: v for k, v in case["config"].items() if k in fields})
            got = plan_digest(plan_step(case["lens"], config, CostModel(**case["cost"])))
            total += 1
            if got != case["digest"]:
                differ += 1
                print(f"DIFFERENT case {total}: {case['digest']} -> {got} ({config})")
    print(f"{total} recorded plans, {differ} different")
    return 1 if differ else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("action", choices=["check", "write", "record", "replay"])
    p.add_argument("--only", help="check or write only the configurations whose name contains this")
    p.add_argument("--cases", type=Path, help="record/replay: the recorded plans (.jsonl.gz)")
    p.add_argument("pytest_args", nargs=argparse.REMAINDER, help="record: pytest's arguments (after --)")
    args = p.parse_args(argv)
    args.pytest_args = [a for a in args.pytest_args if a != "--"]
    if args.action in ("record", "replay") and args.cases is None:
        p.error(f"{args.action} needs --cases")
    if args.action == "record":
        return record(args.cases, args.pytest_args)
    if args.action == "replay":
        return replay(args.cases)
    found = run_configs(args.only)
    kept = json.loads(DIGESTS.read_text()) if DIGESTS.exists() else {}
    if args.action == "write":
        DIGESTS.write_text(json.dumps({**kept, **found}, indent=1, sort_keys=True) + "\n")
        print(f"wrote {len(found)} digests to {DIGESTS}")
        return 0
    return 1 if compare(found, kept) else 0


if __name__ == "__main__":
    sys.exit(main())
