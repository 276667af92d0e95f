"""Exact document-causal attention over one micro-batch; distributed pieces go round their ring.

Local sequences (ring of one) are attended here. Distributed sequences are zigzag-split over
the micro-batch's ring of N ranks (design 2.3); each member holds one block of them (see
``layout``) and only its KV heads travel:

* forward: N steps; at each the member attends its queries to the KV block it holds, merges
  (fp32, log-sum-exp) and passes the block on: N-1 KV hops, the next block in flight while
  the current one is computed;
* backward: the KV blocks go round again (N-1 hops) with an fp32 dK/dV accumulator beside
  each, which every member adds its contribution to and passes on; after N hops each
  accumulator is back with the block's owner.

So member i sends ``(sum T - T_{i+1})`` KV tokens forward, as many backward, and ``sum T``
accumulator tokens: ``Plan.p2p_bytes_per_rank`` with kv bytes/token ``2*hkv*d*k.element_size()``
and grad bytes/token ``2*hkv*d*4`` (``2*hkv*d*2`` with ``grad_dtype=bf16``). A ring of one sends
nothing. A micro-batch planned two-level (``heads_split`` > 1) runs ``two_level_attention``,
which builds on the same ring passes (``ring_core``).
"""

from __future__ import annotations

import torch

from ..errors import PlanError
from .attention_ops import get_backend
from .layout import MicroBatchLayout, put_rows, take_rows
from .ring_comm import P2PCounter, RingComm
from .ring_core import ring_backward, ring_forward
from .two_level_attention import two_level_attention


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: MicroBatchLayout,
    group=None,
    softmax_scale: float | None = None,
    backend: str = "auto",
    counter: P2PCounter | None = None,
    grad_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """q [T, hq, d], k/v [T, hkv, d] in ``layout``'s token order -> out [T, hq, d]; differentiable.

    ``group``: the HDP process group the layout's ranks refer to (None: the world).
    ``backend``: "auto" (flash kernels: torch's on the CPU, flash-attn's on CUDA fp16/bf16;
    else the dense torch math), "flash" or "torch" (the dense reference).
    ``counter``: adds the bytes this rank sends (forward and backward; a recomputed forward
    under activation checkpointing sends, and counts, its KV again).
    ``grad_dtype``: the dtype the backward's dK/dV accumulators travel in (None: fp32; bf16
    halves those bytes, each hop still adding in fp32).
    A layout with ``heads_split`` > 1 runs two-level attention (``two_level_attention``).
    """
    check_inputs(q, k, v, layout)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    if layout.heads_split > 1 and layout.blocks:
        return two_level_attention(q, k, v, layout, group, scale, get_backend(backend, q), counter, grad_dtype)
    comm = RingComm(layout.ring, layout.ring_index, group, counter) if layout.ring_size > 1 else None
    return _RingAttention.apply(q, k, v, layout, comm, scale, get_backend(backend, q), grad_dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, layout, comm, scale, backend, grad_dtype=None):
        out, lse = attention_forward(q, k, v, layout, comm, scale, backend)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (layout, comm, scale, backend, grad_dtype)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = attention_backward(dout, q, k, v, out, lse, *ctx.args)
        return dq, dk, dv, None, None, None, None, None


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: MicroBatchLayout) -> None:
    """Raise PlanError on any shape or metadata mismatch, before any communication."""
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape:
        raise PlanError(
            f"ring attention takes q [T, hq, d] and k, v [T, hkv, d]; got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.shape[0] != layout.num_tokens or k.shape[0] != layout.num_tokens:
        raise PlanError(
            f"q has {q.shape[0]} tokens and k/v {k.shape[0]}, but rank {layout.rank}'s micro-batch holds "
            f"{layout.num_tokens}; pass exactly this micro-batch's tokens, in its layout order"
        )
    if q.shape[2] != k.shape[2]:
        raise PlanError(f"q head dim {q.shape[2]} differs from k/v head dim {k.shape[2]}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise PlanError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads (GQA)")
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        raise PlanError(
            f"q, k, v must share dtype and device; got {q.dtype}/{k.dtype}/{v.dtype} on "
            f"{q.device}/{k.device}/{v.device}"
        )


# ------------------------------------------------------------------ the computation
# ``comm`` is anything with ``size``, ``index`` and ``send_recv(tensor, recv_shape, tag)``
# returning an object with ``wait()``: a RingComm, or a LocalRing member in one process.


def attention_forward(q, k, v, layout: MicroBatchLayout, comm, scale: float, backend):
    """-> (out in q's dtype [T, hq, d], lse fp32 [T, hq]) for all of this rank's tokens."""
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)

    def local():
        if layout.local_block.runs:
            lq, lk, lv = (take_rows(x, layout.local_rows) for x in (q, k, v))
            o, l = backend.forward(lq, lk, lv, layout.local_block, layout.local_block, scale)
            put_rows(out, layout.local_rows, o)
            put_rows(lse, layout.local_rows, l)

    if layout.blocks:  # the local sequences are computed while the first KV hop is in flight
        rq, rk, rv = (take_rows(x, layout.ring_rows) for x in (q, k, v))
        o, l = ring_forward(rq, rk, rv, layout, comm, scale, backend, side_work=local)
        put_rows(out, layout.ring_rows, o)
        put_rows(lse, layout.ring_rows, l)
    else:
        local()
    return out, lse


def attention_backward(dout, q, k, v, out, lse, layout: MicroBatchLayout, comm, scale: float, backend, grad_dtype=None):
    """-> (dq, dk, dv) in the inputs' dtypes."""
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def local():
        if layout.local_block.runs:
            parts = (take_rows(x, layout.local_rows) for x in (dout, q, k, v, out, lse))
            grads = backend.backward(*parts, layout.local_block, layout.local_block, scale)
            for dst, g in zip((dq, dk, dv), grads):
                put_rows(dst, layout.local_rows, g)

    if layout.blocks:
        parts = (take_rows(x, layout.ring_rows) for x in (dout, q, k, v, out, lse))
        grads = ring_backward(*parts, layout, comm, scale, backend, side_work=local, grad_dtype=grad_dtype)
        for dst, g in zip((dq, dk, dv), grads):
            put_rows(dst, layout.ring_rows, g)
    else:
        local()
    return dq, dk, dv
