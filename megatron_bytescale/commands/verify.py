"""``bytescale verify``: does HDP on N gloo ranks train exactly like one rank?

Bare, it checks the batch of docs/results.md's exactness figure: 8 sequences (2 to 40 tokens)
on 4 ranks at capacity 16, so the longest sequence spans three ranks.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..units import parse_size

DEFAULTS = {"world_size": 4, "lengths": "40,5,9,7,3,11,2,30", "capacity": "16"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--world-size",
        type=int,
        default=DEFAULTS["world_size"],
        help="gloo processes for the HDP run (TP x HDP ranks; default 4)",
    )
    parser.add_argument(
        "--lengths", help=f"comma-separated sequence lengths, e.g. 300,2K,17 (default {DEFAULTS['lengths']})"
    )
    parser.add_argument("--lengths-file", help="one sequence length per line")
    parser.add_argument(
        "--capacity", default=DEFAULTS["capacity"], help="tokens per micro-batch per rank (K/M suffixes; default 16)"
    )
    parser.add_argument("--seed", type=int, default=0, help="weights and tokens (default 0)")
    parser.add_argument("--model", default="tiny", help="model config (default: tiny)")
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel size inside each HDP rank")
    parser.add_argument(
        "--offload-ratio",
        type=float,
        default=None,
        help="plan with offloading (a long sequence may then fit on fewer ranks) and offload at least this share "
        "of every ring micro-batch's activations; the check is that offloading changes nothing",
    )
    parser.add_argument(
        "--dtype",
        default="fp32",
        help="fp32 (default: exact, tolerance 1e-5) or bf16: HDP in bf16 against a bf16 one-rank reference, "
        "tolerance 5e-2 relative on gradients and 2e-3 on the loss (measured: 1e-2 and 3e-6 on the tiny model), since "
        "bf16 keeps 8 mantissa bits "
        "(rounding 2^-8 = 0.4%%) and HDP sums ring blocks and gradients in another order than one rank, "
        "so a few roundings differ. fp64 is not supported",
    )
    parser.add_argument(
        "--two-level",
        metavar="SEQ[:U]",
        default=None,
        help="force two-level attention (head all-to-all in groups of U ranks, default 2, ring across groups) "
        "on sequence SEQ's ring (an index into the lengths)",
    )
    parser.add_argument("--json", help="write the report here")


def main(args: argparse.Namespace) -> int:
    from ..verify import parse_lengths, parse_two_level, passed, verify

    text = DEFAULTS["lengths"] if args.lengths is None and args.lengths_file is None else args.lengths
    lengths = parse_lengths(text, args.lengths_file)
    report = verify(
        lengths,
        world_size=args.world_size,
        capacity=parse_size(args.capacity, "--capacity"),
        seed=args.seed,
        model=args.model,
        tp=args.tp,
        offload_ratio=args.offload_ratio,
        dtype=args.dtype,
        two_level=parse_two_level(args.two_level),
        progress=lambda line: print(line, flush=True),
    )
    failures = passed(report)
    report["ok"] = not failures
    print(
        f"HDP on {report['world_size']} ranks vs one rank, {len(lengths)} sequences, capacity {report['capacity']}, "
        f"{report['dtype']}"
    )
    print(f"  ranks per sequence : {report['ranks_per_sequence']}")
    static = report["static_skipped"] is None
    static_loss = f"  static {report['loss_static']:.8f}" if static else ""
    print(f"  loss               : one rank {report['loss_ref']:.8f}  HDP {report['loss_hdp']:.8f}{static_loss}")
    static_grad = f"  static max relative {report['static_max_rel_grad_diff']:.2e}" if static else ""
    print(
        f"  gradients          : max |diff| {report['max_abs_grad_diff']:.2e}  max relative "
        f"{report['max_rel_grad_diff']:.2e}{static_grad}"
    )
    static_p2p = (
        f"static DPxCP (CP={report['static_cp']}) {report['p2p_bytes_static']:,}"
        if static
        else f"static DPxCP not run: it cannot hold the batch without offloading ({report['static_skipped']})"
    )
    print(
        f"  P2P bytes          : HDP {report['p2p_bytes']:,} (plan predicts {report['p2p_bytes_predicted']:,})  "
        f"{static_p2p}"
    )
    transports = report.get("ring_transports")
    if transports:
        kv, latent = transports["kv"], transports["latent"]
        print(
            f"  latent ring        : loss {latent['loss_hdp']:.8f}  gradients max relative "
            f"{latent['max_rel_grad_diff']:.2e}"
        )
        print(
            f"  bytes by transport : K/V ring {kv['p2p_bytes']:,} ({kv['values_per_token']} values per token)  latent "
            f"ring {latent['p2p_bytes']:,} ({latent['values_per_token']}; plan predicts "
            f"{latent['p2p_bytes_predicted']:,}): {latent['p2p_bytes'] / kv['p2p_bytes']:.3f} of the K/V ring's"
        )
    if report["two_level"] is not None:
        tl = report["two_level"]
        print(
            f"  two-level          : sequence {tl['seq']}'s ring in groups of {tl['heads_split']} (head all-to-all, "
            "ring across groups)"
        )
    if args.offload_ratio is not None:
        ratios = ", ".join(f"{r:g}" for r in report["offload_ratios"]) or "none"
        print(f"  offloaded bytes    : {report['offloaded_bytes']:,} (ring micro-batch ratios: {ratios})")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    for f in failures:
        print(f"FAILED: {f}", file=sys.stderr)
    print(
        ("OK: HDP matches one rank" + (" (and so does the static mesh)" if static else ""))
        if not failures
        else "MISMATCH"
    )
    return 0 if not failures else 1
