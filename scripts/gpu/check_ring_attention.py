"""GPU check of zigzag ring attention on one GPU: bf16 exactness and time per ring member.

Ring members are emulated in one process: one thread per member, blocks passed in memory
(``runtime.ring_comm.LocalRing``), each running the same ``attention_forward`` /
``attention_backward`` as the distributed path; only the transport differs (no NCCL, one GPU),
so communication time is not measured.

1. accuracy (bf16): packed ring micro-batches (rings of 2, 3, 4, 8; lengths not divisible by
   2N; whole short sequences beside chunk pairs; several sequences sharing one ring; GQA)
   against fp32 attention over each whole sequence (an independent plain-torch oracle). The
   same errors are printed for one bf16 flash call over the whole sequences, the yardstick
   for what bf16 costs anyway. Each case runs with the flash backend and the torch backend.
2. speed: one sequence of 32K/64K/128K tokens over rings of 2/4/8: forward+backward time of all
   members (their kernels share the GPU) against one fused call over the same tokens.
   per-rank = all members / N; efficiency = fused / all members (1.0: splitting is free).

Run from the repository root on a machine with a GPU (about 2-4 minutes on one H200):

    PYTHONPATH=. python scripts/gpu/check_ring_attention.py --json ring_attention.json

``--smoke`` runs the same logic with tiny sizes on the CPU (fp32, torch backend); the tests do.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from megatron_bytescale.planner.contract import MicroBatch, ring_pieces, whole_piece
from megatron_bytescale.runtime.attention_ops import flash_kernel, get_backend
from megatron_bytescale.runtime.layout import MicroBatchLayout, TokenBlock
from megatron_bytescale.runtime.ring_attention import attention_backward, attention_forward
from megatron_bytescale.runtime.ring_comm import LocalRing

# (name, ring size, distributed sequence lengths, whole short sequences)
ACCURACY_CASES = [
    ("ring2+whole", 2, [5001], [300, 77]),
    ("ring3-static", 3, [7001, 2999], [513]),
    ("ring4", 4, [12345], [1000, 1]),
    ("ring8", 8, [11999], [64]),
]
SMOKE_CASES = [("ring2+whole", 2, [23], [5, 1]), ("ring3-static", 3, [31, 13], [4]), ("ring4", 4, [45], [3])]


def ring_micro_batches(ring_size: int, long: list[int], short: list[int]):
    """Sequence lengths and each member's micro-batch: zigzag shares, whole ones dealt round."""
    ring = tuple(range(ring_size))
    shares = [ring_pieces(sid, s, ring) for sid, s in enumerate(long)]
    lens = long + short
    mbs = {}
    for idx in ring:
        pieces = [sh[idx] for sh in shares]
        pieces += [whole_piece(len(long) + i, s, idx) for i, s in enumerate(short) if i % ring_size == idx]
        mbs[idx] = MicroBatch(tuple(pieces))
    return lens, mbs


class Sequences:
    """q, k, v and a loss weight g per sequence, concatenated; gathered per member by index."""

    def __init__(self, lens, hq, hkv, d, dtype, device, seed=0):
        gen = torch.Generator(device=device).manual_seed(seed)
        total = sum(lens)
        self.lens, self.offsets = lens, [sum(lens[:i]) for i in range(len(lens))]
        self.q, self.k, self.v, self.g = (
            torch.randn(total, h, d, generator=gen, device=device, dtype=dtype) for h in (hq, hkv, hkv, hq)
        )

    def index(self, layout: MicroBatchLayout) -> torch.Tensor:
        starts = torch.tensor(self.offsets)[layout.seq_ids]
        return (starts + layout.positions).to(self.q.device)

    def whole_block(self) -> TokenBlock:
        return TokenBlock(tuple((sid, 0, s) for sid, s in enumerate(self.lens)))


def run_ring(seqs: Sequences, mbs: dict, backend, scale: float, prepared=None):
    """Forward + backward of every member, one thread each -> {rank: (rows, out, dq, dk, dv)}."""
    hub = LocalRing(len(mbs), timeout_s=600)
    prepared = prepared or prepare(seqs, mbs)

    def member(rank):
        layout, rows, q, k, v, g = prepared[rank]
        comm = hub.member(layout.ring_index)
        out, lse = attention_forward(q, k, v, layout, comm, scale, backend)
        return rank, (rows, out, *attention_backward(g, q, k, v, out, lse, layout, comm, scale, backend))

    with ThreadPoolExecutor(len(mbs)) as pool:
        return dict(pool.map(member, sorted(mbs)))


def prepare(seqs: Sequences, mbs: dict):
    out = {}
    for rank, mb in mbs.items():
        layout = MicroBatchLayout.from_micro_batch(mb, rank)
        rows = seqs.index(layout)
        out[rank] = (layout, rows, *(x.index_select(0, rows) for x in (seqs.q, seqs.k, seqs.v, seqs.g)))
    return out


def run_fused(seqs: Sequences, backend, scale: float):
    """One call over every whole sequence (the single-device reference)."""
    block = seqs.whole_block()
    out, lse = backend.forward(seqs.q, seqs.k, seqs.v, block, block, scale)
    out = out.to(seqs.q.dtype)
    return out, *backend.backward(seqs.g, seqs.q, seqs.k, seqs.v, out, lse, block, block, scale)


def oracle(seqs: Sequences, scale: float):
    """fp32 causal attention of each whole sequence and its gradients: plain torch autograd."""
    group = seqs.q.shape[1] // seqs.k.shape[1]
    results = [[], [], [], []]
    for off, s in zip(seqs.offsets, seqs.lens):
        q, k, v = (x[off : off + s].float().requires_grad_() for x in (seqs.q, seqs.k, seqs.v))
        kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q, kk) * scale
        causal = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
        out = torch.einsum("hqk,khd->qhd", scores.masked_fill(~causal, float("-inf")).softmax(-1), vv)
        (out * seqs.g[off : off + s].float()).sum().backward()
        for acc, t in zip(results, (out.detach(), q.grad, k.grad, v.grad)):
            acc.append(t)
        del scores, out
    return [torch.cat(r) for r in results]


def max_errors(got, want) -> dict:
    return {name: (g.float() - w).abs().max().item() for name, g, w in zip(("out", "dq", "dk", "dv"), got, want)}


def accuracy(cases, hq, hkv, d, dtype, device, backends) -> list[dict]:
    records = []
    for name, n, long, short in cases:
        lens, mbs = ring_micro_batches(n, long, short)
        seqs = Sequences(lens, hq, hkv, d, dtype, device, seed=n)
        scale = d**-0.5
        want = oracle(seqs, scale)
        for backend_name in backends:
            backend = get_backend(backend_name, seqs.q)
            ring = run_ring(seqs, mbs, backend, scale)
            # scatter each member's tokens back to whole-sequence order
            got = [torch.empty_like(x, dtype=torch.float32) for x in want]
            for rows, *tensors in ring.values():
                for dst, t in zip(got, tensors):
                    dst[rows] = t.float()
            fused = run_fused(seqs, backend, scale)
            records.append(accuracy_record(name, n, sum(lens), backend.name, got, want, fused))
    return records


def accuracy_record(name, n, tokens, backend, got, want, fused, errors=None, **extra) -> dict:
    """One accuracy case's figures (the ring's and the one call's errors against the fp32
    oracle, the ring against the one call), printed as one line. ``errors``: how two lists of
    tensors are compared (default ``max_errors``); ``extra``: more keys, printed after the backend."""
    errors = errors or max_errors
    rec = {
        "case": name,
        "ring": n,
        "tokens": tokens,
        "backend": backend,
        **extra,
        "ring_err": errors(got, want),
        "one_call_err": errors(fused, want),
        "ring_vs_one_call": errors(got, [f.float() for f in fused]),
    }
    print(
        f"{name:13s} N={n} {tokens:6d} tok {backend:5s} {' '.join(map(str, extra.values()))} | max err vs fp32: ring "
        + " ".join(f"{k}={v:.2e}" for k, v in rec["ring_err"].items())
        + " | one call "
        + " ".join(f"{k}={v:.2e}" for k, v in rec["one_call_err"].items()),
        flush=True,
    )
    return rec


def timed(fn, repeats: int, device) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()  # warm-up (kernels, caches)
    sync()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync()
    return (time.perf_counter() - start) / repeats * 1e3


def speed(token_counts, ring_sizes, hq, hkv, d, dtype, device, backend_name, repeats) -> list[dict]:
    records = []
    for tokens in token_counts:
        seqs = Sequences([tokens], hq, hkv, d, dtype, device)
        backend = get_backend(backend_name, seqs.q)
        scale = d**-0.5
        fused_ms = timed(lambda: run_fused(seqs, backend, scale), repeats, device)
        for n in ring_sizes:
            _, mbs = ring_micro_batches(n, [tokens], [])
            prepared = prepare(seqs, mbs)
            ring_ms = timed(lambda: run_ring(seqs, mbs, backend, scale, prepared), repeats, device)
            rec = {
                "tokens": tokens,
                "ring": n,
                "backend": backend.name,
                "fused_ms": fused_ms,
                "all_members_ms": ring_ms,
                "per_rank_ms": ring_ms / n,
                "efficiency": fused_ms / ring_ms,
            }
            records.append(rec)
            print(
                f"{tokens:7d} tok N={n}: fused {fused_ms:9.2f} ms | ring all members {ring_ms:9.2f} ms, "
                f"per rank {ring_ms / n:8.2f} ms, efficiency {fused_ms / ring_ms:.2f}",
                flush=True,
            )
            del prepared
        del seqs
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return records


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags every attention GPU check takes besides its own sizes."""
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (fp32, torch backend)")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write the figures here")


def cuda_with_flash(heads: int, head_dim: int):
    """(device, dtype) for the full check: CUDA in bf16 with a usable flash kernel, or None
    after saying on stderr why not."""
    if not torch.cuda.is_available():
        print("no CUDA device; run with --smoke for the CPU dry run", file=sys.stderr)
        return None
    device, dtype = torch.device("cuda"), torch.bfloat16
    if flash_kernel(torch.zeros(1, heads, head_dim, device=device, dtype=dtype)) is None:
        print("no usable flash kernel (flash-attn or torch's built-in FA2) for this GPU/dtype", file=sys.stderr)
        return None
    return device, dtype


def print_device(device, dtype) -> None:
    print(
        f"device {device} ({torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}), torch "
        f"{torch.__version__}, {dtype}"
    )


def write_figures(path: str | None, device, dtype, args, acc: list[dict], spd: list[dict]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(
                {
                    "device": str(device),
                    "torch": torch.__version__,
                    "dtype": str(dtype),
                    "heads": [args.heads, args.kv_heads, args.head_dim],
                    "accuracy": acc,
                    "speed": spd,
                },
                f,
                indent=1,
            )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[32768, 65536, 131072])
    parser.add_argument("--rings", type=int, nargs="+", default=[2, 4, 8])
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
        args.tokens, args.rings, args.heads, args.kv_heads, args.head_dim, args.repeats = [96], [2, 4], 4, 2, 8, 1
        acc_heads = (4, 2, 8)
    else:
        found = cuda_with_flash(args.heads, args.head_dim)
        if found is None:
            return 2
        (device, dtype), cases, speed_backend, backends = found, ACCURACY_CASES, "flash", ["flash", "torch"]
        acc_heads = (8, 2, 128)
    print_device(device, dtype)
    if device.type == "cuda":
        print(f"flash kernel: {type(flash_kernel(torch.zeros(1, 8, 128, device=device, dtype=dtype))).__name__}")

    acc = accuracy(cases, *acc_heads, dtype, device, backends)
    spd = speed(
        args.tokens, args.rings, args.heads, args.kv_heads, args.head_dim, dtype, device, speed_backend, args.repeats
    )
    bad = [r for r in acc if not all(math.isfinite(v) for v in r["ring_err"].values())]
    write_figures(args.json, device, dtype, args, acc, spd)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
