"""Planner speed and balance on a Byted-like (or ``--dataset``) global batch, per balance mode.

    PYTHONPATH=. python benchmarks/bench_planner.py --modes dp pp vpp ep [--global-batch-tokens 32M] [--json OUT]
    PYTHONPATH=. python benchmarks/bench_planner.py [--gpus 16384] [--pp 1] [--balance dp pp none]

Plans one step (analytic cost model on H100, C = 8K, 2M context) on one core
(OMP/MKL/OpenBLAS threads = 1) several times and reports the median CPU time of
``plan_step`` (wall time beside it: on a shared machine CPU time is the steadier figure),
then the balance of the plan: estimated max / mean per-rank time, and the max against the
compute bound (all FLOPs spread perfectly over all ranks) and against the fastest the longest
ring can possibly run.

``--modes`` runs the planner's balance modes on ``--gpus`` GPUs (16,384 by default), each
as the cluster it is made for (``MODES``): ``dp`` (LLaMA-7B, DP-balance), ``pp`` (LLaMA-7B,
4 pipeline stages, PP-balance), ``vpp`` (LLaMA-70B, TP 8, 4 stages x 5 model chunks) and
``ep`` (Mistral-8x7B, TP 4, expert parallelism 8). Without it: ``--model`` with ``--pp P``
stages (``gpus / P`` HDP ranks) and each ``--balance``.

Lengths: ``megatron_bytescale/data/workloads.py``'s ``sample_lengths(dataset, ...)`` (the
simulator's generator; ``--dataset byted`` by default, or ``github``) when it is installed, else
``byted_like_lengths`` below, a documented parametric mix (``--workload builtin`` forces it).
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_bytescale.errors import ConfigError  # noqa: E402
from megatron_bytescale.planner.cost_model import CostModel  # noqa: E402
from megatron_bytescale.planner.planner import PlannerConfig, plan_step  # noqa: E402
from megatron_bytescale.planner.sizing.offload import host_capacity  # noqa: E402
from megatron_bytescale.planner.sizing.rings import RingSizer  # noqa: E402
from megatron_bytescale.planner.specs import HardwareSpec, ModelSpec  # noqa: E402
from megatron_bytescale.units import parse_size  # noqa: E402

# Byted (docs/design.md, section 3): ~80% of samples <= 4K; samples >= 128K are ~1% of samples and hold
# 44.3% of tokens; > 256K hold 37%; the ~0.05% of samples at the full context hold 12.1%.
# Each band: (low, high, share of samples, share of tokens); lengths inside a band follow a
# truncated power law whose exponent is solved so the band's mean gives its token share.
# The context band pins the mean length: mean = 0.0005 * context / 0.121 (8.7K at 2M).
BYTED_BANDS = (
    # low, high, samples, tokens
    (128, 4096, 0.800, 0.111),
    (4097, 131071, 0.190, 0.446),
    (131072, 262144, 0.0035, 0.073),
    (262145, None, 0.0060, 0.249),  # up to the context (exclusive)
    (None, None, 0.0005, 0.121),  # exactly the context
)


def _power_law_mean(lo: float, hi: float, alpha: float) -> float:
    def integral(power: float) -> float:  # integral of x^power over [lo, hi]
        if abs(power + 1) < 1e-12:
            return np.log(hi / lo)
        return (hi ** (power + 1) - lo ** (power + 1)) / (power + 1)

    return integral(1 - alpha) / integral(-alpha)


def _solve_alpha(lo: float, hi: float, mean: float) -> float:
    """Exponent of a density ~ x^-alpha on [lo, hi] with the given mean (mean falls as alpha rises)."""
    a, b = -10.0, 20.0
    for _ in range(200):
        mid = (a + b) / 2
        if _power_law_mean(lo, hi, mid) > mean:
            a = mid
        else:
            b = mid
    return (a + b) / 2


def _draw(lo: float, hi: float, alpha: float, n: int, rng: np.random.Generator) -> np.ndarray:
    u = rng.random(n)
    if abs(alpha - 1) < 1e-9:
        x = lo * (hi / lo) ** u
    else:
        e = 1 - alpha
        x = (lo**e + u * (hi**e - lo**e)) ** (1 / e)
    return np.clip(np.round(x), lo, hi).astype(np.int64)


def byted_like_lengths(total_tokens: int, context: int, rng: np.random.Generator) -> list[int]:
    """A global batch of about ``total_tokens`` tokens with the Byted statistics."""
    mean_len = BYTED_BANDS[-1][2] * context / BYTED_BANDS[-1][3]
    n = total_tokens / mean_len
    lengths = []
    bands = []
    for lo, hi, samples, tokens in BYTED_BANDS:
        lo = context if lo is None else lo
        hi = context - 1 if hi is None and lo != context else (context if hi is None else hi)
        band_mean = tokens * mean_len / samples
        alpha = None if lo == hi else _solve_alpha(lo, hi, band_mean)
        bands.append((lo, hi, samples, alpha))
    # long bands get their expected counts (rounded); short bands are drawn until the total
    for lo, hi, samples, alpha in bands[2:]:
        count = int(round(samples * n))
        lengths += [lo] * count if alpha is None else _draw(lo, hi, alpha, count, rng).tolist()
    short = bands[:2]
    p_short = np.array([b[2] for b in short]) / sum(b[2] for b in short)
    total = sum(lengths)
    while total < total_tokens:
        k = rng.choice(2, p=p_short)
        lo, hi, _, alpha = short[k]
        s = int(_draw(lo, hi, alpha, 1, rng)[0])
        s = min(s, total_tokens - total)
        lengths.append(s)
        total += s
    rng.shuffle(lengths)
    return lengths


def batch_lengths(workload: str, total: int, context: int, seed: int, dataset: str = "byted") -> tuple[list[int], str]:
    if workload == "auto":
        try:
            from megatron_bytescale.data.workloads import sample_lengths
        except ImportError:
            pass
        else:
            lengths = sample_lengths(dataset, total, context, np.random.default_rng(seed))
            return list(lengths), f"data/workloads.py {dataset}"
    if dataset != "byted":
        raise SystemExit(f"--dataset {dataset} needs data/workloads.py (--workload auto): the builtin mix is Byted")
    return byted_like_lengths(total, context, np.random.default_rng(seed)), "builtin byted-like mix"


def describe_batch(lengths: list[int]) -> dict:
    arr = np.asarray(lengths)
    tot = arr.sum()
    return {
        "sequences": int(arr.size),
        "tokens": int(tot),
        "samples_le_4K": float((arr <= 4096).mean()),
        "samples_ge_128K": float((arr >= 131072).mean()),
        "tokens_ge_128K": float(arr[arr >= 131072].sum() / tot),
        "tokens_gt_256K": float(arr[arr > 262144].sum() / tot),
        "longest": int(arr.max()),
    }


# balance modes as the clusters they are made for: model, TP, PP, model chunks, EP, balance
MODES = {
    "dp": ("llama-7b", 1, 1, 1, 1, "dp"),
    "pp": ("llama-7b", 1, 4, 1, 1, "pp"),
    "vpp": ("llama-70b", 8, 4, 5, 1, "pp"),
    "ep": ("mistral-8x7b", 4, 1, 1, 8, "dp"),
}


def time_plans(lengths, config: PlannerConfig, cost: CostModel, repeat: int):
    """The last plan, and the wall and CPU seconds of each of ``repeat`` plan_step calls."""
    times, cpu = [], []
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        plan = plan_step(lengths, config, cost)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return plan, times, cpu


def plan_digest(plan) -> str:
    """SHA-256 of the plan without its meta (timings): equal digests, identical plans."""
    body = {k: v for k, v in plan.to_dict().items() if k != "meta"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


def plan_figures(plan, times, cpu, critical: float) -> dict:
    m = plan.meta
    est = np.asarray(m["est_rank_time_s"])
    bound = m["compute_bound_s"]
    return {
        "strategy": m["strategy"],
        "plan_time_median_s": statistics.median(times),
        "plan_time_all_s": times,
        "plan_cpu_time_median_s": statistics.median(cpu),
        "plan_cpu_time_all_s": cpu,
        "est_max_s": float(est.max()),
        "est_mean_s": float(est.mean()),
        "max_over_mean": float(est.max() / est.mean()),
        "compute_bound_s": bound,
        "max_over_compute_bound": float(est.max() / bound),
        "fastest_longest_ring_s": critical,
        "max_over_best_possible": float(est.max() / max(bound, critical)),
        "ring_sizes": m["ring_sizes"],
        "offloaded_sequences": m["offloaded_sequences"],
        "micro_batches_per_rank_max": max(len(r) for r in plan.ranks),
        "plan_digest": plan_digest(plan),
    }


def print_figures(label: str, res: dict, repeat: int) -> None:
    print(
        f"{label}: plan {res['plan_cpu_time_median_s'] * 1e3:7.1f} ms CPU, {res['plan_time_median_s'] * 1e3:.1f} ms "
        f"wall (median of {repeat}); est max {res['est_max_s']:.2f} s, mean {res['est_mean_s']:.2f} s, max/mean "
        f"{res['max_over_mean']:.3f}; compute bound {res['compute_bound_s']:.2f} s (max/bound "
        f"{res['max_over_compute_bound']:.3f}); fastest longest ring {res['fastest_longest_ring_s']:.2f} s "
        f"(max/best-possible {res['max_over_best_possible']:.3f}); rings {res['ring_sizes']}; plan {res['plan_digest']}"
    )


def longest_ring_time(lengths, cost: CostModel, capacity: int, ranks: int, ranks_per_node: int, pp: int) -> float:
    sizer = RingSizer(capacity, cost, True, ranks, ranks_per_node, pp, host_capacity(cost, pp))
    return max((sizer.fastest(s) for s in set(lengths) if s > capacity), default=0.0)


def run_modes(args, lengths, capacity: int, out: dict) -> None:
    hardware = HardwareSpec.load(args.hardware)
    for mode in args.modes:
        model, tp, pp, vpp, ep, balance = MODES[mode]
        if args.gpus % (tp * pp):
            raise SystemExit(f"--gpus {args.gpus} does not divide into TP {tp} x PP {pp} for mode {mode}")
        cost = CostModel.analytic(ModelSpec.load(model), hardware, tp=tp, pp=pp)
        ranks, per_node = args.gpus // (tp * pp), max(1, 8 // tp)
        config = PlannerConfig(
            num_ranks=ranks,
            capacity=capacity,
            ranks_per_node=per_node,
            balance=balance,
            pipeline_stages=pp,
            virtual_stages=vpp,
            expert_parallel=ep,
        )
        try:
            plan, times, cpu = time_plans(lengths, config, cost, args.repeat)
        except ConfigError as e:  # e.g. too few GPUs for the mode's model: one line, not a traceback
            raise SystemExit(f"error: mode {mode} ({model}) on {args.gpus} GPUs: {e}") from None
        if args.validate:
            plan.validate()
        res = plan_figures(plan, times, cpu, longest_ring_time(lengths, cost, capacity, ranks, per_node, pp))
        res.update(model=model, tp=tp, pp=pp, virtual_stages=vpp, expert_parallel=ep, balance=balance, hdp_ranks=ranks)
        out["results"][mode] = res
        shape = f"{model}, TP {tp}, PP {pp}" + (f" x V {vpp}" if vpp > 1 else "") + (f", EP {ep}" if ep > 1 else "")
        print_figures(f"{mode:>3} ({shape}, {ranks} HDP ranks, balance {balance})", res, args.repeat)


def run(args) -> dict:
    capacity = parse_size(args.capacity, "capacity")
    context = parse_size(args.context, "context")
    total = parse_size(args.tokens, "tokens")
    lengths, source = batch_lengths(args.workload, total, context, args.seed, args.dataset)
    out = {
        "gpus": args.gpus,
        "hardware": args.hardware,
        "capacity": capacity,
        "context": context,
        "workload": source,
        "batch": describe_batch(lengths),
        "results": {},
    }
    print(f"batch ({source}): {out['batch']}")
    if args.modes:
        run_modes(args, lengths, capacity, out)
        return out
    if args.gpus % args.pp:
        raise SystemExit(f"--gpus {args.gpus} does not divide into --pp {args.pp} stages")
    cost = CostModel.analytic(ModelSpec.load(args.model), HardwareSpec.load(args.hardware), pp=args.pp)
    ranks = args.gpus // args.pp
    out.update(model=args.model, pp=args.pp)
    critical = longest_ring_time(lengths, cost, capacity, ranks, 8, args.pp)
    for balance in args.balance:
        config = PlannerConfig(num_ranks=ranks, capacity=capacity, balance=balance, pipeline_stages=args.pp)
        plan, times, cpu = time_plans(lengths, config, cost, args.repeat)
        if args.validate:
            plan.validate()
        res = plan_figures(plan, times, cpu, critical)
        out["results"][balance] = res
        print_figures(f"{res['strategy']:>13} balance={balance:<4}", res, args.repeat)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus", type=int, default=16384)
    p.add_argument("--pp", type=int, default=1, help="pipeline stages: HDP ranks = gpus / pp")
    p.add_argument("--global-batch-tokens", "--tokens", dest="tokens", default="32M", help="tokens per step [32M]")
    p.add_argument("--capacity", default="8K")
    p.add_argument("--context", default="2M")
    p.add_argument("--model", default="llama-7b")
    p.add_argument("--hardware", default="h100")
    p.add_argument("--balance", nargs="+", default=["dp", "pp", "none"], choices=["dp", "pp", "none"])
    p.add_argument(
        "--modes",
        nargs="+",
        choices=list(MODES),
        help="balance modes, each on the cluster it is made for (MODES); replaces --model, --pp and --balance",
    )
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--dataset",
        default="byted",
        help="the batch's lengths: byted, github or a workload YAML (data/workloads.py) [byted]",
    )
    p.add_argument(
        "--workload",
        choices=["auto", "builtin"],
        default="auto",
        help="auto: data/workloads.py's Byted generator if installed, else the builtin mix",
    )
    p.add_argument("--validate", action="store_true", help="also run Plan.validate() on the last plan")
    p.add_argument("--json", help="write the figures to this JSON file")
    args = p.parse_args(argv)
    out = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
