"""GPU check of multi-latent attention (MLA) ring attention on one GPU: both ring transports,
bf16 exactness, time and the bytes each transport sends.

Ring members are emulated in one process as in ``check_ring_attention.py``: one thread per
member, blocks passed in memory (``runtime.ring_comm.LocalRing``), each running the autograd
function of the distributed path (``ring_attention_with``) with its layout's transport:

* ``kv``: K (qk + rope head dims) and V (v head dim) travel as one buffer per token; the flash
  kernels get V padded to K's head dim for the call;
* ``latent``: the KV latent and the rotary key travel; each member re-expands K and V with the
  up-projection (a GEMM per ring step, and its backward).

Communication time is not measured (one GPU, no NCCL); the bytes are counted.

1. accuracy (bf16): rings of 2, 3, 4 and 8 members, lengths not divisible by 2N, whole short
   sequences beside, each transport: out, dQ, d(latent), d(rotary key) and the up-projection's
   gradient against fp32 attention of each whole sequence with K and V made from the latent as
   MLA makes them (plain torch autograd), and the same errors of one bf16 call over the whole
   sequences (what bf16 costs anyway). Flash backend and torch backend.
2. speed: one sequence of 32K / 64K / 128K tokens over rings of 2 / 4 / 8, each transport:
   forward+backward of all members (their kernels share the GPU; the up-projection's backward
   included) against one call over the same tokens (K and V made once, one flash call):
   per-rank = all members / N, efficiency = fused / all members; and the bytes each member sent.

Head shapes: DeepSeek-V3's (qk 128 + rope 64, v 128, latent 512) with 16 heads, the heads of one
rank at TP 8 (``--heads``); accuracy with 4 heads (its fp32 oracle holds [heads, s, s] scores).

Run from the repository root on a machine with a GPU (about 4-6 minutes on one H100):

    PYTHONPATH=. python scripts/gpu/check_mla_ring.py --json mla_ring.json

``--smoke`` runs the same logic with tiny sizes on the CPU (fp32, torch backend); the tests do.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_ring_attention import accuracy_record, cuda_with_flash, print_device, ring_micro_batches, timed

from megatron_bytescale.planner.contract import MicroBatch
from megatron_bytescale.runtime.attention_ops import get_backend
from megatron_bytescale.runtime.layout import MicroBatchLayout, TokenBlock
from megatron_bytescale.runtime.ring_attention import MLALatent, ring_attention_with
from megatron_bytescale.runtime.ring_comm import LocalRing, P2PCounter

TRANSPORTS = ("kv", "latent")
# (name, ring size, distributed sequence lengths, whole short sequences)
ACCURACY_CASES = [
    ("ring2+whole", 2, [5001], [300, 77]),
    ("ring3-shared", 3, [7001, 2999], [513]),
    ("ring4", 4, [12345], [1000, 1]),
    ("ring8", 8, [11999], [64]),
]
SMOKE_CASES = [("ring2+whole", 2, [23], [5, 1]), ("ring3-shared", 3, [31, 13], [4]), ("ring4", 4, [45], [3])]


class Dims:
    """Heads and MLA head dims: no-rope K, rope key, V, latent."""

    def __init__(self, heads: int, nope: int, rope: int, v: int, latent: int):
        self.heads, self.nope, self.rope, self.v, self.latent = heads, nope, rope, v, latent

    def widths(self) -> dict[str, int]:
        """Values per token of a block, per transport."""
        return {"kv": self.heads * (self.nope + self.rope + self.v), "latent": self.latent + self.rope}


class Sequences:
    """Per token: latent, rotary key, query, loss weight g; one up-projection. Concatenated."""

    def __init__(self, lens, dims: Dims, dtype, device, seed=0):
        gen = torch.Generator(device=device).manual_seed(seed)
        total, h = sum(lens), dims.heads
        draw = lambda *shape: torch.randn(*shape, generator=gen, device=device, dtype=dtype)  # noqa: E731
        self.lens, self.offsets, self.dims = lens, [sum(lens[:i]) for i in range(len(lens))], dims
        self.latent, self.rope_key = draw(total, dims.latent), draw(total, dims.rope)
        self.q, self.g = draw(total, h, dims.nope + dims.rope), draw(total, h, dims.v)
        self.weight = draw(h * (dims.nope + dims.v), dims.latent) * dims.latent**-0.5

    def index(self, layout: MicroBatchLayout) -> torch.Tensor:
        starts = torch.tensor(self.offsets)[layout.seq_ids]
        return (starts + layout.positions).to(self.q.device)

    def whole_block(self) -> TokenBlock:
        return TokenBlock(tuple((sid, 0, s) for sid, s in enumerate(self.lens)))


def expand(latent, rope_key, weight, dims: Dims):
    """K and V as MLA makes them from the latent and the rotary key."""
    kv = (latent @ weight.t()).view(latent.shape[0], dims.heads, dims.nope + dims.v)
    k = torch.cat([kv[..., : dims.nope], rope_key[:, None].expand(-1, dims.heads, -1)], -1)
    return k, kv[..., dims.nope :]


def attend(parts, g, layout, comm, backend, scale, dims):
    """Forward and backward of one member (or of the whole batch, ``comm`` None): the grads of
    the query, latent, rotary key and up-projection."""
    q, latent, rope_key, weight = (x.detach().requires_grad_() for x in parts)
    k, v = expand(latent, rope_key, weight, dims)
    out = ring_attention_with(q, k, v, layout, comm, scale, backend, latent=MLALatent(latent, weight, dims.rope))
    out.backward(g)
    return out.detach(), q.grad, latent.grad, rope_key.grad, weight.grad


def prepare(seqs: Sequences, mbs: dict, transport: str):
    out = {}
    for rank, mb in mbs.items():
        pieces = tuple(replace(p, transport=transport) if p.is_distributed else p for p in mb.pieces)
        layout = MicroBatchLayout.from_micro_batch(MicroBatch(pieces), rank)
        rows = seqs.index(layout)
        parts = [x.index_select(0, rows) for x in (seqs.q, seqs.latent, seqs.rope_key)] + [seqs.weight]
        out[rank] = (layout, rows, parts, seqs.g.index_select(0, rows))
    return out


def run_ring(seqs: Sequences, prepared: dict, backend, scale: float, counters=None):
    """Every member, one thread each -> {rank: (rows, out, dq, dlatent, drope, dweight)}."""
    hub = LocalRing(len(prepared), timeout_s=900)

    def member(rank):
        layout, rows, parts, g = prepared[rank]
        counter = counters[rank] if counters is not None else None
        comm = hub.member(layout.ring_index, counter, layout.transport)
        return rank, (rows, *attend(parts, g, layout, comm, backend, scale, seqs.dims))

    with ThreadPoolExecutor(len(prepared)) as pool:
        return dict(pool.map(member, sorted(prepared)))


def run_fused(seqs: Sequences, backend, scale: float):
    """One call over every whole sequence (K and V made once): the single-device reference."""
    block = seqs.whole_block()
    layout = MicroBatchLayout(
        rank=0,
        seq_ids=block.seq_ids,
        positions=block.positions,
        local_block=block,
        local_rows=slice(0, block.num_tokens),
        ring=(0,),
        ring_index=0,
        blocks=(),
        ring_rows=slice(0, 0),
    )
    parts = (seqs.q, seqs.latent, seqs.rope_key, seqs.weight)
    return attend(parts, seqs.g, layout, None, backend, scale, seqs.dims)


def oracle(seqs: Sequences, scale: float):
    """fp32 causal attention of each whole sequence, K and V from the latent: plain torch autograd."""
    d = seqs.dims
    weight = seqs.weight.float().requires_grad_()
    results = [[], [], [], []]
    for off, s in zip(seqs.offsets, seqs.lens):
        q, latent, rope_key = (x[off : off + s].float().requires_grad_() for x in (seqs.q, seqs.latent, seqs.rope_key))
        k, v = expand(latent, rope_key, weight, d)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        causal = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
        out = torch.einsum("hqk,khd->qhd", scores.masked_fill(~causal, float("-inf")).softmax(-1), v)
        out.backward(seqs.g[off : off + s].float())
        for acc, t in zip(results, (out.detach(), q.grad, latent.grad, rope_key.grad)):
            acc.append(t)
        del scores, out
    return [torch.cat(r) for r in results] + [weight.grad]


NAMES = ("out", "dq", "dlatent", "drope", "dweight")


def max_errors(got, want) -> dict:
    """max |got - want| / max |want| per tensor (relative: the five tensors differ in size)."""
    return {n: ((g.float() - w).abs().max() / w.abs().max()).item() for n, g, w in zip(NAMES, got, want)}


def gathered(ring: dict, like: list) -> list:
    """Members' rows back in whole-sequence order; the up-projection's gradient summed."""
    got = [torch.empty_like(x, dtype=torch.float32) for x in like[:4]] + [torch.zeros_like(like[4])]
    for rows, *tensors in ring.values():
        for dst, t in zip(got[:4], tensors[:4]):
            dst[rows] = t.float()
        got[4] += tensors[4].float()
    return got


def accuracy(cases, dims: Dims, dtype, device, backends) -> list[dict]:
    records = []
    scale = (dims.nope + dims.rope) ** -0.5
    for name, n, long, short in cases:
        lens, mbs = ring_micro_batches(n, long, short)
        seqs = Sequences(lens, dims, dtype, device, seed=n)
        want = oracle(seqs, scale)
        for backend_name in backends:
            backend = get_backend(backend_name, seqs.q)
            fused = run_fused(seqs, backend, scale)
            for transport in TRANSPORTS:
                got = gathered(run_ring(seqs, prepare(seqs, mbs, transport), backend, scale), want)
                records.append(
                    accuracy_record(
                        name, n, sum(lens), backend.name, got, want, fused, errors=max_errors, transport=transport
                    )
                )
    return records


def speed(token_counts, ring_sizes, dims: Dims, dtype, device, backend_name, repeats) -> list[dict]:
    records = []
    scale = (dims.nope + dims.rope) ** -0.5
    for tokens in token_counts:
        seqs = Sequences([tokens], dims, dtype, device)
        backend = get_backend(backend_name, seqs.q)
        fused = run_fused(seqs, backend, scale)
        fused_ms = timed(lambda: run_fused(seqs, backend, scale), repeats, device)
        for n in ring_sizes:
            _, mbs = ring_micro_batches(n, [tokens], [])
            for transport in TRANSPORTS:
                prepared = prepare(seqs, mbs, transport)
                counters = {rank: P2PCounter() for rank in prepared}
                # one counted pass, compared with the one call (both bf16)
                got = gathered(run_ring(seqs, prepared, backend, scale, counters), fused)
                vs_one_call = max_errors(got, [f.float() for f in fused])
                del got
                sent = sum(c.bytes_sent for c in counters.values())
                ring_ms = timed(lambda: run_ring(seqs, prepared, backend, scale), repeats, device)
                rec = {
                    "tokens": tokens,
                    "ring": n,
                    "transport": transport,
                    "backend": backend.name,
                    "fused_ms": fused_ms,
                    "all_members_ms": ring_ms,
                    "per_rank_ms": ring_ms / n,
                    "efficiency": fused_ms / ring_ms,
                    "bytes_sent": sent,
                    "ring_vs_one_call": vs_one_call,
                }
                records.append(rec)
                print(
                    f"{tokens:7d} tok N={n} {transport:6s}: fused {fused_ms:9.2f} ms | ring all members {ring_ms:9.2f} "
                    f"ms, per rank {ring_ms / n:8.2f} ms, efficiency {fused_ms / ring_ms:.2f} | sent "
                    f"{sent / 2**20:9.1f} MiB (one layer, forward and backward) | max rel diff to the one call "
                    + " ".join(f"{k}={v:.1e}" for k, v in vs_one_call.items()),
                    flush=True,
                )
                del prepared
        del seqs, fused
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return records


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (fp32, torch backend)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[32768, 65536, 131072])
    parser.add_argument("--rings", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--heads", type=int, default=16, help="heads of one rank (DeepSeek-V3's 128 at TP 8: 16)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)

    if args.smoke:  # fp32 on the CPU, the dense backend, tiny shapes
        device, dtype = torch.device("cpu"), torch.float32
        cases, backends, speed_backend = SMOKE_CASES, ["torch"], "torch"
        acc_dims = speed_dims = Dims(2, 8, 4, 6, 10)
        args.tokens, args.rings, args.repeats = [96], [2, 4], 1
    else:
        speed_dims, acc_dims = Dims(args.heads, 128, 64, 128, 512), Dims(4, 128, 64, 128, 512)
        found = cuda_with_flash(args.heads, 192)
        if found is None:
            return 2
        (device, dtype), cases, speed_backend, backends = found, ACCURACY_CASES, "flash", ["flash", "torch"]
    print_device(device, dtype)
    acc = accuracy(cases, acc_dims, dtype, device, backends)
    spd = speed(args.tokens, args.rings, speed_dims, dtype, device, speed_backend, args.repeats)
    widths = speed_dims.widths()
    print(
        f"values per token of a ring block: K/V {widths['kv']}, latent {widths['latent']} "
        f"({widths['latent'] / widths['kv']:.4f} of K/V's at {speed_dims.heads} heads)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "device": str(device),
                    "torch": torch.__version__,
                    "dtype": str(dtype),
                    "dims": vars(speed_dims),
                    "values_per_token": widths,
                    "accuracy": acc,
                    "speed": spd,
                },
                f,
                indent=1,
            )
    bad = [r for r in acc if not all(math.isfinite(v) for v in r["ring_err"].values())]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
