"""``bytescale dataloader-bench``: planning and delivery time per step, and bytes read
(``tools/dataloader_bench.py`` runs it; this parses the flags and prints the results)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..tools.dataloader_bench import DEFAULT_CACHE
from ..units import seed


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mode", choices=["local", "ray"], default="local")
    parser.add_argument("--ranks", type=int, default=8, help="HDP ranks to plan and deliver for")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seed", type=seed, default=0)
    parser.add_argument(
        "--data",
        help="indexed dataset prefix (default: a corpus of this interpreter's site-packages, built once "
        f"under {DEFAULT_CACHE})",
    )
    parser.add_argument("--json", metavar="OUT", help="also write the results as JSON")
    parser.add_argument(
        "--capacity", type=int, default=8192, help="tokens per rank per micro-batch (planner capacity C)"
    )
    parser.add_argument("--step-tokens", type=int, help="token budget per step (default: 4 x ranks x capacity)")
    parser.add_argument("--context-length", type=int, help="longest sample (default: ranks x capacity / 2)")
    parser.add_argument("--ranks-per-node", type=int, default=8, help="HDP ranks per node (planner placement)")
    parser.add_argument("--model", default="tiny", help="model config for the planner's cost model")
    parser.add_argument("--hardware", default="h200", help="hardware config for the planner's cost model")
    parser.add_argument("--servers", type=int, default=2, help="ray mode: document server actors")
    parser.add_argument("--lookahead", type=int, default=4, help="ray mode: steps planned ahead")
    parser.add_argument("--address", help="ray mode: attach to this Ray cluster instead of starting one")


def main(args) -> int:
    from ..tools.dataloader_bench import run_bench

    result = run_bench(args)
    for key, value in result.items():
        print(f"{key:32s} {value:.6g}" if isinstance(value, float) else f"{key:32s} {value}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0
