"""GPU check of two-level attention (head all-to-all in groups, ring across groups) on one GPU.

Ring members are emulated in one process as in ``check_ring_attention.py``: one thread per
member, the all-to-all inside each group through ``group_exchange.LocalGroup`` and the ring
across groups through ``ring_comm.LocalRing``, each member running the same
``two_level_attention`` autograd function as the distributed path (only the transport differs:
no NCCL, one GPU, so communication time is not measured).

1. accuracy (bf16): two-level micro-batches (N = 4, 8, 6 members in groups of u = 2, 4, 8, 3;
   GQA 8 query / 2 KV heads, so u = 4, 8 and 3 cut KV groups and copy KV heads; lengths not
   divisible by 2N; whole short sequences beside; two sequences sharing one ring) against fp32
   attention over each whole sequence (plain torch), next to the plain ring of the same N and
   one bf16 flash call over the whole sequences (what bf16 costs anyway); with dK/dV sent as
   fp32 and as bf16. Flash backend and torch backend.
2. speed: one sequence of 64K / 128K tokens over N = 8 members, u = 1 (plain ring), 2, 4, 8:
   forward+backward time of all members (their kernels share the GPU) against one fused call.
   per-rank = all members / N; efficiency = fused / all members (1.0: splitting is free).
   Two-level runs u times fewer, u times larger block pairs with 1/u of the heads.

Run from the repository root on a machine with a GPU (about 3-5 minutes on one H200):

    PYTHONPATH=. python scripts/gpu/check_two_level_attention.py --json two_level_attention.json

``--smoke`` runs the same logic with tiny sizes on the CPU (fp32, torch backend); the tests do.
"""

from __future__ import annotations

import argparse
import math
import sys
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_ring_attention import (
    Sequences,
    add_common_arguments,
    cuda_with_flash,
    max_errors,
    oracle,
    prepare,
    print_device,
    run_fused,
    run_ring,
    timed,
    write_figures,
)

from megatron_bytescale.planner.contract import MicroBatch, ring_pieces, whole_piece
from megatron_bytescale.runtime.attention_ops import get_backend
from megatron_bytescale.runtime.group_exchange import LocalGroup, SelfRing
from megatron_bytescale.runtime.ring_comm import LocalRing
from megatron_bytescale.runtime.two_level_attention import two_level_with

# (name, ring size N, group size u, distributed sequence lengths, whole short sequences)
ACCURACY_CASES = [
    ("N4-u2+whole", 4, 2, [12345], [300, 77]),
    ("N8-u4-shared", 8, 4, [11999, 3001], [64]),
    ("N8-u8-a2a-only", 8, 8, [9999], [1]),
    ("N6-u3-uneven", 6, 3, [10001], [513]),
]
SMOKE_CASES = [("N4-u2+whole", 4, 2, [45], [5, 1]), ("N6-u3-uneven", 6, 3, [37, 13], [4]), ("N2-u2", 2, 2, [23], [])]


def micro_batches(ring_size: int, u: int, long: list[int], short: list[int]):
    """Sequence lengths and each member's micro-batch: zigzag shares (two-level with groups of
    u when u > 1), whole ones dealt round."""
    ring = tuple(range(ring_size))
    shares = [ring_pieces(sid, s, ring, heads_split=u) for sid, s in enumerate(long)]
    mbs = {}
    for idx in ring:
        pieces = [sh[idx] for sh in shares]
        pieces += [whole_piece(len(long) + i, s, idx) for i, s in enumerate(short) if i % ring_size == idx]
        mbs[idx] = MicroBatch(tuple(pieces))
    return long + short, mbs


def run_two_level(mbs: dict, prepared: dict, backend, scale: float, grad_dtype=None):
    """Forward + backward of every member, one thread each -> {rank: (rows, out, dq, dk, dv)}."""
    first = prepared[0][0].groups
    u, m = first.size, first.num_groups
    groups = [LocalGroup(u, timeout_s=600) for _ in range(m)]
    rings = [LocalRing(m, timeout_s=600) for _ in range(u)]

    def member(rank):
        layout, rows, q, k, v, g = prepared[rank]
        gl = layout.groups
        q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
        cross = rings[gl.place].member(gl.group_index) if m > 1 else SelfRing()
        out = two_level_with(
            q, k, v, layout, groups[gl.group_index].member(gl.place), cross, scale, backend, grad_dtype
        )
        out.backward(g)
        return rank, (rows, out.detach(), q.grad, k.grad, v.grad)

    with ThreadPoolExecutor(len(mbs)) as pool:
        return dict(pool.map(member, sorted(mbs)))


def scatter(result: dict, like) -> list[torch.Tensor]:
    """Each member's tokens back in whole-sequence order (fp32)."""
    got = [torch.empty_like(x, dtype=torch.float32) for x in like]
    for rows, *tensors in result.values():
        for dst, t in zip(got, tensors):
            dst[rows] = t.float()
    return got


def accuracy(cases, hq, hkv, d, dtype, device, backends) -> list[dict]:
    records = []
    for name, n, u, long, short in cases:
        lens, mbs = micro_batches(n, u, long, short)
        _, plain_mbs = micro_batches(n, 1, long, short)
        seqs = Sequences(lens, hq, hkv, d, dtype, device, seed=n + u)
        scale = d**-0.5
        want = oracle(seqs, scale)
        for backend_name in backends:
            backend = get_backend(backend_name, seqs.q)
            prepared = prepare(seqs, mbs)
            two = scatter(run_two_level(mbs, prepared, backend, scale), want)
            two_bf16 = scatter(run_two_level(mbs, prepared, backend, scale, torch.bfloat16), want)
            plain = scatter(run_ring(seqs, plain_mbs, backend, scale), want)
            fused = run_fused(seqs, backend, scale)
            rec = {
                "case": name,
                "ring": n,
                "u": u,
                "tokens": sum(lens),
                "backend": backend.name,
                "two_level_err": max_errors(two, want),
                "two_level_bf16_dkv_err": max_errors(two_bf16, want),
                "plain_ring_err": max_errors(plain, want),
                "one_call_err": max_errors(fused, want),
                "two_level_vs_plain_ring": max_errors(two, plain),
            }
            records.append(rec)
            fmt = lambda e: " ".join(f"{k}={v:.2e}" for k, v in e.items())
            print(
                f"{name:15s} N={n} u={u} {sum(lens):6d} tok {backend.name:5s} | max |err| vs fp32: two-level "
                f"{fmt(rec['two_level_err'])} | bf16 dK/dV {fmt(rec['two_level_bf16_dkv_err'])} | plain ring "
                f"{fmt(rec['plain_ring_err'])} | one call {fmt(rec['one_call_err'])}",
                flush=True,
            )
            del prepared
        del seqs, want
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return records


def speed(token_counts, ring_size, splits, hq, hkv, d, dtype, device, backend_name, repeats) -> list[dict]:
    records = []
    for tokens in token_counts:
        seqs = Sequences([tokens], hq, hkv, d, dtype, device)
        backend = get_backend(backend_name, seqs.q)
        scale = d**-0.5
        fused_ms = timed(partial(run_fused, seqs, backend, scale), repeats, device)
        for u in splits:
            _, mbs = micro_batches(ring_size, u, [tokens], [])
            prepared = prepare(seqs, mbs)
            if u == 1:
                fn = partial(run_ring, seqs, mbs, backend, scale, prepared)
            else:
                fn = partial(run_two_level, mbs, prepared, backend, scale)
            ms = timed(fn, repeats, device)
            rec = {
                "tokens": tokens,
                "ring": ring_size,
                "u": u,
                "backend": backend.name,
                "fused_ms": fused_ms,
                "all_members_ms": ms,
                "per_rank_ms": ms / ring_size,
                "efficiency": fused_ms / ms,
            }
            records.append(rec)
            print(
                f"{tokens:7d} tok N={ring_size} u={u}: fused {fused_ms:9.2f} ms | all members {ms:9.2f} ms, "
                f"per rank {ms / ring_size:8.2f} ms, efficiency {fused_ms / ms:.2f}",
                flush=True,
            )
            del prepared
        del seqs
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return records


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[65536, 131072])
    parser.add_argument("--ring", type=int, default=8)
    parser.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4, 8])
    add_common_arguments(parser)
    args = parser.parse_args(argv)

    if args.smoke:
        device, dtype, cases, backends, speed_backend = (
            torch.device("cpu"),
            torch.float32,
            SMOKE_CASES,
            ["torch"],
            "torch",
        )
        args.tokens, args.ring, args.splits, args.heads, args.kv_heads, args.head_dim, args.repeats = (
            [96],
            4,
            [1, 2, 4],
            8,
            4,
            8,
            1,
        )
        acc_heads = (8, 4, 8)
    else:
        found = cuda_with_flash(args.heads, args.head_dim)
        if found is None:
            return 2
        (device, dtype), cases, speed_backend, backends = found, ACCURACY_CASES, "flash", ["flash", "torch"]
        acc_heads = (8, 2, 128)
    print_device(device, dtype)

    acc = accuracy(cases, *acc_heads, dtype, device, backends)
    spd = speed(
        args.tokens,
        args.ring,
        args.splits,
        args.heads,
        args.kv_heads,
        args.head_dim,
        dtype,
        device,
        speed_backend,
        args.repeats,
    )
    bad = [
        r
        for r in acc
        if not all(math.isfinite(v) for key in ("two_level_err", "two_level_bf16_dkv_err") for v in r[key].values())
    ]
    write_figures(args.json, device, dtype, args, acc, spd)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
