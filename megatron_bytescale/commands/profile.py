"""``bytescale profile``: measure the cost model's coefficients on this machine
(``tools/profiler.py`` measures; this parses its flags and prints the fit)."""

from __future__ import annotations

import argparse
import logging
import os

from ..units import format_size, parse_size

# tools/profiler.py's defaults, named here so --help needs no torch
DTYPE_NAMES = ("bf16", "fp16", "fp32")
HOST_MEMORY_SHARE = 0.5  # profiler.HOST_MEMORY_SHARE
DEFAULT_SEQ_LENS = {"cpu": "128,256,512,1K,2K", "cuda": "1K,2K,4K,8K,16K,32K"}  # the sweep per device


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny", help="model name (configs/models) or .args file (default: tiny)")
    parser.add_argument(
        "--hardware", default="h200", help="hardware spec for the fields not measured here (default: h200)"
    )
    parser.add_argument("--out", default="profile.json", help="profile file to write (JSON; default: profile.json)")
    parser.add_argument(
        "--seq-lens",
        default=None,
        help=f"comma-separated sweep, K/M suffixes allowed (default: {DEFAULT_SEQ_LENS['cpu']} on CPU, "
        f"{DEFAULT_SEQ_LENS['cuda']} on GPU)",
    )
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument(
        "--dtype", default="auto", choices=["auto", *DTYPE_NAMES], help="default: bf16 on GPU, fp32 on CPU"
    )
    parser.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "megatron", "torch"],
        help="layer implementation (default: megatron-core where installed)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed repetitions per length (best is kept)")
    parser.add_argument("--copy-bytes", default=None, help="bytes per bandwidth copy (default: 256M GPU, 64M CPU)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages: num_layers is the layers of one stage")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)")
    parser.add_argument(
        "--host-memory-per-gpu",
        default=None,
        metavar="BYTES",
        help="pinned host memory per GPU for offloaded activations, e.g. 64G "
        "(default: --host-memory-share of this host's RAM over its GPUs)",
    )
    parser.add_argument(
        "--host-memory-share",
        type=float,
        default=HOST_MEMORY_SHARE,
        help=f"share of host RAM offloading may pin, all GPUs together (default {HOST_MEMORY_SHARE})",
    )
    parser.add_argument("--pin-probe", default="1G", help="bytes pinned once on a GPU host to check pinning works (1G)")


def _parse_lengths(text: str) -> list[int]:
    return [parse_size(part, "sequence length") for part in text.split(",") if part.strip()]


def main(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from ..tools.profiler import MEASURED, build_profile, write_profile

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    seq_lens = _parse_lengths(args.seq_lens or DEFAULT_SEQ_LENS[device])
    copy_bytes = parse_size(args.copy_bytes, "copy size") if args.copy_bytes else None
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():  # launched by torchrun: measure P2P too
        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    profile = build_profile(
        args.model,
        args.hardware,
        seq_lens,
        device=device,
        dtype=args.dtype,
        backend=args.backend,
        repeats=args.repeats,
        copy_bytes=copy_bytes,
        measure_on_this_rank=rank == 0,
        pp=args.pp,
        host_memory=parse_size(args.host_memory_per_gpu, "--host-memory-per-gpu") if args.host_memory_per_gpu else None,
        host_memory_share=args.host_memory_share,
        pin_probe=parse_size(args.pin_probe, "--pin-probe"),
    )
    if rank == 0:
        cost = write_profile(profile, args.out)
        n = profile["notes"]
        print(f"wrote {args.out} ({n['model']}, {n['device']}, {n['dtype']}, {n['backend']} layer)")
        for s, t, a in zip(n["seq_lens"], n["layer_seconds"], n["act_bytes"]):
            print(
                f"  s={format_size(s):>5}: T={t * 1e3:9.3f} ms (fit {cost.layer_time(s) * 1e3:9.3f}), "
                f"Act={a / 2**20:9.2f} MiB (fit {cost.act_bytes(s) / 2**20:9.2f})"
            )
        print(
            f"  a1={cost.a1:.3e} s/tok^2  b1={cost.b1:.3e} s/tok  g={cost.g:.3e} s  "
            f"(R^2 {n['fit_r2']['layer_time']:.4f})"
        )
        print(f"  a2={cost.a2:.1f} B/tok  b2={cost.b2:.0f} B  (analytic a2={n['analytic']['a2']:.1f})")
        print(
            f"  D2H {cost.bw_d2h / 1e9:.1f} GB/s, H2D {cost.bw_h2d / 1e9:.1f} GB/s ({n['copies']}); "
            f"forward {cost.forward_share:.2f} of a layer's time"
        )
        print(
            f"  host memory for offloaded activations: {cost.host_memory_bytes / 1e9:.1f} GB per GPU "
            f"({profile['source']['host_memory_bytes']})"
        )
        if profile["source"]["bw_intra_node"] == MEASURED:
            print(f"  P2P {cost.bw_intra_node / 1e9:.2f} GB/s, latency {cost.p2p_latency_s * 1e6:.1f} us")
    if dist.is_initialized() and world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return 0
