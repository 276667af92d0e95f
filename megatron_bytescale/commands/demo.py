"""``bytescale demo``: the main job on a CPU machine, with no GPU and no network (``demo.py``
runs it); ``--megatron-lm DIR`` runs Megatron-LM's own pretrain_gpt.py under HDP instead."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..demo import STRATEGY_NAMES, DemoConfig
from ..errors import BytescaleError
from ..units import parse_size, seed


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = DemoConfig()
    parser.add_argument("--ranks", type=int, default=d.ranks, help=f"gloo processes (default {d.ranks})")
    parser.add_argument("--steps", type=int, default=d.steps, help=f"training steps per strategy (default {d.steps})")
    parser.add_argument(
        "--capacity", default=str(d.capacity), help=f"tokens per micro-batch per rank (default {d.capacity})"
    )
    parser.add_argument(
        "--context", default=str(d.context), help=f"longest sequence; longer documents are cut (default {d.context})"
    )
    parser.add_argument(
        "--step-tokens", default=str(d.step_tokens), help=f"tokens per global batch (default {d.step_tokens})"
    )
    parser.add_argument("--seed", type=seed, default=d.seed)
    parser.add_argument("--lr", type=float, default=d.lr)
    parser.add_argument(
        "--profile", default=d.profile, help="the HDP planner's cost-model profile (default: measured tiny-on-CPU)"
    )
    parser.add_argument(
        "--data", help="Megatron indexed dataset prefix (default: built from megatron-core's source files)"
    )
    parser.add_argument("--out", default=d.out, help=f"output folder (default {d.out})")
    parser.add_argument("--strategies", default=",".join(d.strategies), help="hdp, static or both (default hdp,static)")
    parser.add_argument(
        "--checkpoint-every", type=int, default=d.checkpoint_every, help="steps between checkpoints (0: none)"
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue each strategy from its newest valid checkpoint (the same settings; --steps may grow)",
    )
    parser.add_argument(
        "--megatron-lm",
        metavar="DIR",
        help="instead: run DIR/pretrain_gpt.py (Megatron-LM core_v0.16.1 or core_v0.19.x, "
        "Megatron's own training loop) under HDP on CPU/gloo on the demo corpus",
    )


def config_from_args(args: argparse.Namespace) -> DemoConfig:
    strategies = tuple(s.strip() for s in args.strategies.split(",") if s.strip())
    unknown = [s for s in strategies if s not in STRATEGY_NAMES]
    if unknown or not strategies:
        raise BytescaleError(f"unknown strategy {unknown or '(none)'}; choose from {', '.join(STRATEGY_NAMES)}")
    if args.ranks < 1 or args.steps < 1:
        raise BytescaleError("--ranks and --steps must be at least 1")
    return DemoConfig(
        ranks=args.ranks,
        steps=args.steps,
        capacity=parse_size(args.capacity, "--capacity"),
        context=parse_size(args.context, "--context"),
        step_tokens=parse_size(args.step_tokens, "--step-tokens"),
        seed=args.seed,
        lr=args.lr,
        profile=args.profile,
        out=args.out,
        data=args.data,
        strategies=strategies,
        checkpoint_every=args.checkpoint_every,
        resume=args.resume,
    )


def main(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    from ..demo import ensure_corpus, run_demo
    from ..local_world import shape_warnings

    if getattr(args, "megatron_lm", None):  # the launcher says what the run's shape costs
        from ..megatron.cpu_pretrain import run_pretrain_gpt

        data = cfg.data or ensure_corpus(Path(cfg.out) / "data" / "megatron_core_sources")
        return run_pretrain_gpt(
            args.megatron_lm,
            data,
            Path(cfg.out) / "megatron_lm.log",
            ranks=cfg.ranks,
            steps=cfg.steps,
            capacity=cfg.capacity,
            context=cfg.context,
            step_tokens=cfg.step_tokens,
            seed=cfg.seed,
            lr=cfg.lr,
            profile=cfg.profile,
        )
    for line in shape_warnings(cfg.ranks, cfg.capacity, cfg.context):
        print(line, flush=True)
    run_demo(cfg)
    return 0
