"""``bytescale plan``: plan one step for a batch of sequence lengths and show it per rank.

bytescale plan --model llama-7b --gpus 64 --capacity 8K --lengths 1K,300K,4K,9K
bytescale plan --model llama-7b --gpus 1024 --capacity 8K --lengths-file lens.txt --json plan.json
bytescale plan --model llama-7b --gpus 64 --capacity 8K --context 32K --data-path 0.3 books 0.7 code \
    --global-batch-tokens 1M --steps 4
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ConfigError
from ..lengths_file import iter_lengths_file, read_lengths_file
from ..units import format_size, parse_size
from ..virtual_stages import check_vpp

if TYPE_CHECKING:
    from ..planner.contract import MicroBatch, Plan
    from ..planner.cost_model import CostModel
    from ..planner.planner import PlannerConfig

BALANCE_HELP = "dp | pp | none"  # the planner's BALANCE_MODES, checked in main (not imported for --help)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="model name (configs/models) or a Megatron .args file")
    p.add_argument("--hardware", default="h100", help="hardware name (configs/hardware) or a YAML file [h100]")
    p.add_argument("--profile", help="a measured cost-model profile (YAML/JSON); replaces the analytic model")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size [1]")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size [1]")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE): aligned slots per EP group [1]")
    p.add_argument(
        "--vpp",
        type=int,
        default=1,
        metavar="V",
        help="model chunks per pipeline device (virtual pipeline stages); needs --pp > 1 [1]",
    )
    p.add_argument("--gpus", type=int, required=True, help="GPUs in the job; HDP ranks = gpus / (tp * pp)")
    p.add_argument("--gpus-per-node", type=int, help="GPUs per node [the hardware spec's]")
    p.add_argument("--capacity", required=True, help="tokens per micro-batch per rank without offloading, e.g. 8K")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--lengths", help="comma-separated sequence lengths, e.g. 1K,300K,4096")
    src.add_argument("--lengths-file", help="a file with one positive integer (a sequence length) per line")
    src.add_argument(
        "--data-path",
        nargs="+",
        metavar="[WEIGHT] PREFIX",
        help="a Megatron indexed dataset, or a blend in Megatron's syntax (W1 P1 W2 P2 ...): plan the steps "
        "training on it would see (the HDP loader's order for --seed, documents cut at --context, "
        "--global-batch-tokens per step, a blend's tokens by weight); needs --global-batch-tokens",
    )
    p.add_argument("--steps", type=int, default=1, help="with --data-path: how many steps to plan [1]")
    p.add_argument("--seed", type=int, default=1234, help="with --data-path: the training run's --seed [1234]")
    p.add_argument("--context", default="2M", help="longest sequence allowed [2M]")
    p.add_argument("--cut", action="store_true", help="cut sequences longer than --context to the context")
    p.add_argument("--balance", default="dp", help=f"balance scheduler mode: {BALANCE_HELP} [dp]")
    p.add_argument("--slack", type=float, default=0.05, help="balance slack, a fraction of the max time [0.05]")
    p.add_argument("--no-offload", action="store_true", help="never offload activations")
    p.add_argument(
        "--host-memory-per-gpu",
        default=None,
        metavar="BYTES",
        help="pinned host memory per GPU for offloaded activations, e.g. 64G "
        "[the profile's or the hardware spec's host_memory_bytes]",
    )
    p.add_argument(
        "--global-batch-tokens",
        default=None,
        metavar="TOKENS",
        help="plan the lengths, in order, as consecutive steps of at most TOKENS tokens (e.g. 32M), "
        "printing each step's summary as it is planned (no per-rank table; --json writes one plan "
        "per line); a lengths file is then read as it goes, one step in memory at a time. "
        "Default: all lengths are one step",
    )
    p.add_argument("--json", help="write the plan JSON here")
    p.add_argument("--max-rows", type=int, default=64, help="ranks shown in the table [64]; 0 shows all")


def parse_lengths(text: str) -> list[int]:
    items = text.split(",")
    if not text.strip():
        raise ConfigError("--lengths is empty: give comma-separated lengths, e.g. --lengths 1K,300K")
    for position, item in enumerate(items, start=1):
        if not item.strip():
            raise ConfigError(
                f"--lengths {text}: item {position} of {len(items)} is empty (two commas in a row, or one at an end); "
                "give comma-separated lengths, e.g. --lengths 1K,300K"
            )
    return [parse_size(t, f"sequence length {t.strip()!r} in --lengths") for t in items]


def apply_context(lengths: Sequence[int], context: int, cut: bool) -> list[int]:
    longer = [i for i, s in enumerate(lengths) if s > context]
    if longer and not cut:
        i = longer[0]
        raise ConfigError(
            f"sequence {i} has {lengths[i]} tokens, longer than the {format_size(context)} context "
            f"({len(longer)} such); raise --context or pass --cut to cut them to the context"
        )
    return [min(s, context) for s in lengths]


def describe_micro_batch(mb: MicroBatch, rank: int) -> str:
    parts = []
    for p in mb.pieces:
        ranges = "".join(f"[{a}:{b})" for a, b in p.ranges)
        if p.is_distributed:
            parts.append(f"s{p.seq_id}{ranges} ring {p.ring_size}#{p.ring_index(rank)}")
        else:
            parts.append(f"s{p.seq_id}{ranges}")
    text = " + ".join(parts)
    if mb.offload_ratio > 0:
        text += f" (offload {mb.offload_ratio:.2f})"
    return text


def format_table(plan: Plan, max_rows: int) -> str:
    est = plan.meta.get("est_rank_time_s") or [0.0] * plan.num_ranks
    tokens = plan.tokens_per_rank()
    rows = range(plan.num_ranks) if max_rows <= 0 else range(min(plan.num_ranks, max_rows))
    lines = [f"{'rank':>5} {'mbs':>4} {'tokens':>8} {'est s':>8}  micro-batches (pieces as seq[start:end))"]
    for r in rows:
        mbs = plan.ranks[r]
        desc = " | ".join(describe_micro_batch(mb, r) for mb in mbs) or "-"
        lines.append(f"{r:>5} {len(mbs):>4} {tokens[r]:>8} {est[r]:>8.2f}  {desc}")
    if len(rows) < plan.num_ranks:
        lines.append(f"... {plan.num_ranks - len(rows)} more ranks (--max-rows 0 shows all)")
    return "\n".join(lines)


def format_summary(plan: Plan) -> str:
    import numpy as np

    m = plan.meta
    est = np.asarray(m.get("est_rank_time_s") or [0.0])
    rings = ", ".join(f"{n}x{size}" for size, n in m.get("ring_sizes", {}).items()) or "none"
    return "\n".join(
        [
            f"strategy {m.get('strategy')} (balance {m.get('balance')}), {plan.num_ranks} HDP ranks, "
            f"{len(plan.seq_lens)} sequences, {sum(plan.seq_lens)} tokens, capacity {plan.capacity}",
            f"long sequences (count x ring size): {rings}; offloaded: {m.get('offloaded_sequences', 0)}",
            f"estimated step: max {est.max():.2f} s, mean {est.mean():.2f} s (max/mean "
            f"{est.max() / max(est.mean(), 1e-12):.3f}); "
            f"compute bound {m.get('compute_bound_s', 0.0):.2f} s; planned in {m.get('plan_time_s', 0.0) * 1e3:.1f} ms",
        ]
    )


def build_cost(args):
    from ..planner.cost_model import CostModel
    from ..planner.specs import HardwareSpec, ModelSpec

    if args.profile:
        cost = CostModel.from_profile(args.profile)
    else:
        cost = CostModel.analytic(ModelSpec.load(args.model), HardwareSpec.load(args.hardware), tp=args.tp, pp=args.pp)
    if args.host_memory_per_gpu is None:
        return cost
    return cost.with_overrides(host_memory_bytes=float(parse_size(args.host_memory_per_gpu, "--host-memory-per-gpu")))


def hdp_shape(gpus: int, tp: int, pp: int, gpus_per_node: int) -> tuple[int, int]:
    """(HDP ranks, HDP ranks per node): TP shards share a node first (Megatron's rank order)."""
    if gpus <= 0 or tp <= 0 or pp <= 0 or gpus_per_node <= 0:
        raise ConfigError(
            f"--gpus, --tp, --pp and --gpus-per-node must be positive, got {gpus}, {tp}, {pp}, {gpus_per_node}"
        )
    if gpus % (tp * pp):
        raise ConfigError(f"--gpus {gpus} does not divide by TP x PP = {tp * pp}; use a multiple of {tp * pp} GPUs")
    return gpus // (tp * pp), max(1, gpus_per_node // tp)


def main(args) -> int:
    from ..planner.balance import BALANCE_MODES
    from ..planner.planner import PlannerConfig, plan_step
    from ..planner.specs import HardwareSpec

    if args.balance not in BALANCE_MODES:
        raise ConfigError(f"--balance {args.balance}: choose one of {', '.join(BALANCE_MODES)}")
    per_node = HardwareSpec.load(args.hardware).gpus_per_node if args.gpus_per_node is None else args.gpus_per_node
    num_ranks, ranks_per_node = hdp_shape(args.gpus, args.tp, args.pp, per_node)
    cost = build_cost(args)
    check_vpp(args.vpp, args.pp, cost.num_layers)
    capacity = parse_size(args.capacity, "--capacity")
    context = parse_size(args.context, "--context")
    config = PlannerConfig(
        num_ranks=num_ranks,
        capacity=capacity,
        ranks_per_node=ranks_per_node,
        balance=args.balance,
        slack=args.slack,
        offload=not args.no_offload,
        pipeline_stages=args.pp,
        expert_parallel=args.ep,
        virtual_stages=args.vpp,
        capacity_flag="--capacity",
    )
    if args.data_path is not None and args.global_batch_tokens is None:
        raise ConfigError("--data-path plans training's steps: add --global-batch-tokens (the step size, e.g. 1M)")
    if args.global_batch_tokens is not None:
        return plan_steps(args, config, cost, context, parse_size(args.global_batch_tokens, "--global-batch-tokens"))
    if args.lengths is not None:
        lengths = parse_lengths(args.lengths)
    else:
        lengths = read_with_progress(args.lengths_file)
        if len(lengths) > LARGE_STEP:
            print(
                f"planning {len(lengths):,} sequences as one step (--global-batch-tokens plans them step by step)",
                file=sys.stderr,
                flush=True,
            )
    lengths = apply_context(lengths, context, args.cut)
    plan = plan_step(lengths, config, cost).validate()
    print(format_table(plan, args.max_rows))
    print(format_summary(plan))
    if args.json:
        plan.to_json(args.json)
        print(f"plan written to {args.json}")
    return 0


LARGE_STEP = 100_000  # sequences: planning one step this large takes a minute or more


def _progress_bar(path):
    """A tqdm bar over the file's bytes on stderr (shown for files that take a while to read)."""
    from tqdm import tqdm

    return tqdm(
        total=Path(path).stat().st_size,
        unit="B",
        unit_scale=True,
        desc=f"reading {path}",
        file=sys.stderr,
        mininterval=1.0,
        delay=2.0,
        leave=False,
    )


def read_with_progress(path) -> list[int]:
    if not Path(path).is_file():
        return read_lengths_file(path)  # its one-line error
    with _progress_bar(path) as bar:
        return list(iter_lengths_file(path, bar.update))


def step_lengths(lengths: Iterator[int], budget: int, context: int, cut: bool) -> Iterator[list[int]]:
    """Consecutive steps of at most ``budget`` tokens from ``lengths`` (in order, each cut or
    refused at ``context`` first)."""
    step: list[int] = []
    tokens = 0
    for _index, length in enumerate(lengths):
        if length > context:
            if not cut:
                apply_context([length], context, cut)  # the one-line refusal
            length = context
        if step and tokens + length > budget:
            yield step
            step, tokens = [], 0
        step.append(length)
        tokens += length
    if step:
        yield step


def data_steps(data_path: list[str], budget: int, context: int, seed: int, count: int) -> Iterator[list[int]]:
    """The first ``count`` global batches training on ``data_path`` would see (the HDP loader's
    sampler, as ``bytescale simulate --data-path`` reads them), saying what the data are."""
    import itertools

    from ..data.workloads import training_batches

    if count < 1:
        raise ConfigError(f"--steps {count}: give a positive number of steps")
    batches, info = training_batches(data_path, budget, context, seed)
    print(
        f"data: {info['prefix']}: {info['documents']:,} documents, {info['tokens']:,} tokens, longest "
        f"{info['longest_document']:,} ({info['documents_over_context']:,} longer than the context, cut)",
        flush=True,
    )
    return itertools.islice(batches, count)


def plan_steps(args, config: PlannerConfig, cost: CostModel, context: int, budget: int) -> int:
    """Plan and print step after step; only the current step's plan is kept."""
    from ..planner.planner import plan_step

    if budget < context and not args.cut:
        raise ConfigError(
            f"--global-batch-tokens {format_size(budget)} is smaller than --context {format_size(context)}: "
            "a context-long sequence could never be in a step; raise --global-batch-tokens or lower --context"
        )
    context = min(context, budget)
    bar = None
    if args.data_path is not None:
        steps_of_data = data_steps(args.data_path, budget, context, args.seed, args.steps)
    else:
        source = iter(parse_lengths(args.lengths)) if args.lengths is not None else None
        bar = None if source is not None else _progress_bar(args.lengths_file)
        if source is None:
            source = iter_lengths_file(args.lengths_file, bar.update)
        steps_of_data = step_lengths(source, budget, context, args.cut)
    with open(args.json, "w") if args.json else contextlib.nullcontext() as out:
        try:
            steps = 0
            for steps, lengths in enumerate(steps_of_data, start=1):
                plan = plan_step(lengths, config, cost).validate()
                if out is not None:
                    out.write(plan.to_json() + "\n")
                summary = format_summary(plan).replace("\n", "\n  ")
                if bar is not None:
                    bar.write(f"step {steps}: {summary}", file=sys.stdout)
                else:
                    print(f"step {steps}: {summary}", flush=True)
        finally:
            if bar is not None:
                bar.close()
    print(f"{steps} steps planned" + (f"; plans written to {args.json}, one JSON object per line" if args.json else ""))
    return 0
