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

Multi-latent attention (K and V of different head dims) runs the same passes with one of two
transports (``ring_transport``), as the layout's ring says (the plan's choice): ``"kv"``, K
and V back to back in one message (``2*hkv*d`` above becomes ``hkv*(dk + dv)``), or ``"latent"``,
the compressed latent and the rotary key (``r + dpe`` values per token whatever the heads; the
accumulators likewise), re-expanded on each member by the layer's up-projection
(``MLALatent``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import PlanError
from .attention_ops import get_backend
from .layout import MicroBatchLayout, put_rows, take_rows
from .ring_comm import P2PCounter, RingComm
from .ring_core import ring_backward, ring_forward
from .ring_transport import LatentTransport
from .two_level_attention import two_level_attention


@dataclass(frozen=True)
class MLALatent:
    """What the latent ring needs beside q, k, v: the latent [T, r] every token's K and V are
    made from (after its norm; on every TP rank the whole latent), and the up-projection
    weight [heads * (dn + dv), r] of this TP rank's heads (no bias). The rotary key travels
    too: it is the rope part of K, the same in every head (read from ``k``)."""

    latent: torch.Tensor
    weight: torch.Tensor
    pos_dim: int
    # Megatron's gradient-accumulation fusion: the linear layers add their weight gradients into
    # ``weight.main_grad`` themselves (and mark them added); the ring's share goes there too
    fuse_wgrad: bool = False


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
    latent: MLALatent | None = None,
) -> torch.Tensor:
    """q [T, hq, dk], k [T, hkv, dk], v [T, hkv, dv] in ``layout``'s token order -> out [T, hq, dv];
    differentiable.

    ``group``: the HDP process group the layout's ranks refer to (None: the world).
    ``backend``: "auto" (flash kernels: torch's on the CPU, flash-attn's on CUDA fp16/bf16;
    else the dense torch math), "flash" or "torch" (the dense reference).
    ``counter``: adds the bytes this rank sends (forward and backward; a recomputed forward
    under activation checkpointing sends, and counts, its KV again).
    ``grad_dtype``: the dtype the backward's dK/dV accumulators travel in (None: fp32; bf16
    halves those bytes, each hop still adding in fp32).
    A layout with ``heads_split`` > 1 runs two-level attention (``two_level_attention``).
    ``latent``: an MLA layer's latent and up-projection; used where the layout's ring is a
    latent ring (``layout.transport``), which needs it.
    """
    check_inputs(q, k, v, layout)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    if layout.heads_split > 1 and layout.blocks:
        return two_level_attention(q, k, v, layout, group, scale, get_backend(backend, q), counter, grad_dtype)
    if layout.transport == "latent" and layout.blocks:
        check_latent(q, k, latent)
    comm = (
        RingComm(layout.ring, layout.ring_index, group, counter, transport=layout.transport)
        if layout.ring_size > 1
        else None
    )
    return ring_attention_with(q, k, v, layout, comm, scale, get_backend(backend, q), grad_dtype, latent)


def ring_attention_with(q, k, v, layout: MicroBatchLayout, comm, scale: float, backend, grad_dtype=None, latent=None):
    """``ring_attention`` over a given ring transport ``comm`` (a ``RingComm``, or a
    ``LocalRing`` member for checks with every member a thread of one process); differentiable."""
    if layout.transport == "latent" and layout.blocks:
        check_latent(q, k, latent)
        return _LatentRingAttention.apply(
            q, k, v, latent.latent, latent.weight, layout, comm, scale, backend, grad_dtype, latent
        )
    return _RingAttention.apply(q, k, v, layout, comm, scale, backend, grad_dtype)


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


class _LatentRingAttention(torch.autograd.Function):
    """Ring attention whose ring carries the latent (``ring_transport.LatentTransport``): the
    latent's and the up-projection's gradients from the other members' attention to this
    member's block come back through this function; those from its own are K's and V's."""

    @staticmethod
    def forward(ctx, q, k, v, latent, weight, layout, comm, scale, backend, grad_dtype, spec):
        transport = _latent_transport(q, k, v, latent, weight, layout, spec)
        out, lse = attention_forward(q, k, v, layout, comm, scale, backend, transport)
        ctx.save_for_backward(q, k, v, latent, weight, out, lse)
        ctx.args = (layout, comm, scale, backend, grad_dtype, spec)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, latent, weight, out, lse = ctx.saved_tensors
        layout, comm, scale, backend, grad_dtype, spec = ctx.args
        transport = _latent_transport(q, k, v, latent, weight, layout, spec)
        dq, dk, dv = attention_backward(dout, q, k, v, out, lse, layout, comm, scale, backend, grad_dtype, transport)
        dlatent = torch.zeros_like(latent)
        put_rows(dlatent, layout.ring_rows, transport.dlatent)
        if spec.fuse_wgrad and getattr(weight, "main_grad", None) is not None:
            weight.main_grad.add_(transport.dweight.to(weight.main_grad.dtype))
            dweight = None
        else:
            dweight = transport.dweight.to(weight.dtype)
        return dq, dk, dv, dlatent, dweight, None, None, None, None, None, None


def _latent_transport(q, k, v, latent, weight, layout: MicroBatchLayout, spec: MLALatent) -> LatentTransport:
    """This member's block as the latent ring carries it: latent rows and the rope key."""
    rows = take_rows(k, layout.ring_rows)
    return LatentTransport(
        take_rows(latent, layout.ring_rows), rows[:, 0, -spec.pos_dim :], weight, q.shape[1], v.shape[-1]
    )


def check_latent(q: torch.Tensor, k: torch.Tensor, latent: MLALatent | None) -> None:
    if latent is None:
        raise PlanError(
            "this micro-batch's ring carries the latent (the plan's ring transport 'latent'), but the attention "
            "has none: only multi-latent attention layers run a latent ring; plan their rings with transport 'kv'"
        )
    if q.shape[1] != k.shape[1]:
        raise PlanError(f"the latent ring expands each query head's K: got {q.shape[1]} query, {k.shape[1]} K heads")
    if latent.latent.shape[0] != q.shape[0] or latent.latent.dim() != 2:
        raise PlanError(
            f"the latent is {tuple(latent.latent.shape)}; the latent ring needs one [{q.shape[0]}, r] row per token"
        )
    if not 0 < latent.pos_dim < k.shape[-1]:
        raise PlanError(f"rotary key width {latent.pos_dim} does not fit K's head dim {k.shape[-1]}")


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: MicroBatchLayout) -> None:
    """Raise PlanError on any shape or metadata mismatch, before any communication."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3 or k.shape[:2] != v.shape[:2]:
        raise PlanError(
            f"ring attention takes q [T, hq, dk], k [T, hkv, dk] and v [T, hkv, dv]; got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.shape[0] != layout.num_tokens or k.shape[0] != layout.num_tokens:
        raise PlanError(
            f"q has {q.shape[0]} tokens and k/v {k.shape[0]}, but rank {layout.rank}'s micro-batch holds "
            f"{layout.num_tokens}; pass exactly this micro-batch's tokens, in its layout order"
        )
    if q.shape[2] != k.shape[2]:
        raise PlanError(f"q head dim {q.shape[2]} differs from k head dim {k.shape[2]}")
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


def attention_forward(q, k, v, layout: MicroBatchLayout, comm, scale: float, backend, transport=None):
    """-> (out in q's dtype [T, hq, dv], lse fp32 [T, hq]) for all of this rank's tokens;
    ``transport``: what the ring carries (None: K and V)."""
    out = q.new_empty(*q.shape[:2], v.shape[-1])
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)

    def local():
        if layout.local_block.runs:
            lq, lk, lv = (take_rows(x, layout.local_rows) for x in (q, k, v))
            o, l = backend.forward(lq, lk, lv, layout.local_block, layout.local_block, scale)
            put_rows(out, layout.local_rows, o)
            put_rows(lse, layout.local_rows, l)

    if layout.blocks:  # the local sequences are computed while the first KV hop is in flight
        rq, rk, rv = (take_rows(x, layout.ring_rows) for x in (q, k, v))
        o, l = ring_forward(rq, rk, rv, layout, comm, scale, backend, side_work=local, transport=transport)
        put_rows(out, layout.ring_rows, o)
        put_rows(lse, layout.ring_rows, l)
    else:
        local()
    return out, lse


def attention_backward(
    dout, q, k, v, out, lse, layout: MicroBatchLayout, comm, scale: float, backend, grad_dtype=None, transport=None
):
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
        grads = ring_backward(
            *parts, layout, comm, scale, backend, side_work=local, grad_dtype=grad_dtype, transport=transport
        )
        for dst, g in zip((dq, dk, dv), grads):
            put_rows(dst, layout.ring_rows, g)
    else:
        local()
    return dq, dk, dv
