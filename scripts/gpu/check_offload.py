#!/usr/bin/env python3
"""GPU check of selective activation offloading (design 2.4), single GPU, under 10 minutes.

For 16K / 64K / 128K tokens and offload ratios 0, 0.5, 1 on a LLaMA-7B-shaped stack of
transformer layers (bf16; as many layers as fit, at most --max-layers, at least keep_last + 1
so that the last two layers staying on the device matters), measures forward+backward time and
peak memory (torch.cuda.max_memory_allocated), and prints one JSON report. Paper figure to
beat: at 64K tokens, r = 0.5 saved about 32% of memory with no throughput loss.

Run from the repository root on a GPU machine (no megatron-core needed: the plain-torch layer
is used where it is missing):

    PYTHONPATH=. python3 scripts/gpu/check_offload.py --json $OUT/offload.json

Smaller trial: --tokens 4K,16K --max-layers 4. The measuring code is
megatron_bytescale/tools/offload_bench.py, which the CPU tests run on a tiny model.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from megatron_bytescale.tools.layer_stack import default_backend  # noqa: E402
from megatron_bytescale.tools.offload_bench import run_offload_check  # noqa: E402
from megatron_bytescale.units import parse_size  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-7b")
    p.add_argument("--tokens", default="16K,64K,128K", help="comma-separated token counts")
    p.add_argument("--ratios", default="0,0.5,1", help="comma-separated offload ratios (0 is always added)")
    p.add_argument("--layers", type=int, default=None, help="fixed layer count (default: the most that fit)")
    p.add_argument("--max-layers", type=int, default=8)
    p.add_argument("--keep-last", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--min-tensor-bytes", default="1M", help="smaller saved tensors stay on the device")
    p.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    p.add_argument("--backend", default="auto", choices=["auto", "megatron", "torch"])
    p.add_argument("--device", default="cuda", help="cuda (the check); cpu only to try the script")
    p.add_argument("--json", default=None, help="also write the report here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "check_offload: no GPU visible to torch; this check needs one (or pass --device cpu to try it)",
            file=sys.stderr,
        )
        return 2
    report = run_offload_check(
        model=args.model,
        tokens_list=[parse_size(t, "token count") for t in args.tokens.split(",")],
        ratios=[float(r) for r in args.ratios.split(",")],
        layers=args.layers,
        max_layers=args.max_layers,
        device=args.device,
        dtype=DTYPES[args.dtype],
        backend=default_backend() if args.backend == "auto" else args.backend,
        keep_last=args.keep_last,
        repeats=args.repeats,
        min_tensor_bytes=parse_size(args.min_tensor_bytes, "tensor size") if args.min_tensor_bytes != "0" else 0,
    )
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    for row in report["rows"]:
        if row["ratio"] > 0:
            mem = row.get("memory_saved")
            act = row.get("activation_memory_saved", row["resident_saved"])
            print(
                f"{row['tokens']:>7} tokens r={row['ratio']:.2f} ({row['layers']} layers): memory saved "
                f"{'n/a' if mem is None else f'{mem:.1%}'}, activations saved {act:.1%}, "
                f"throughput {row['throughput_change']:+.1%}, late reloads {row['late_reloads']}",
                file=sys.stderr,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
