"""The ring passes both attention variants run: a member's block of queries against every
KV block of its ring (forward), and the backward that sends the dK/dV accumulators home.

``comm`` is anything with ``size``, ``index`` and ``send_recv(tensor, recv_shape, tag)``
returning an object with ``wait()``: a ``RingComm``, a ``LocalRing`` member in one process,
or (two-level attention) a ring across the groups of a node. ``ring_attention`` runs them over
the plain ring, ``two_level_attention`` over the groups after its head all-to-all.
``transport`` (``ring_transport``) says what travels: K and V (the default), or an MLA latent
that each member re-expands.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .attention_ops import merge
from .layout import MicroBatchLayout
from .ring_comm import GRAD_TAG, KV_TAG
from .ring_transport import KVTransport


def ring_forward(
    q, k, v, layout: MicroBatchLayout, comm, scale, backend, side_work: Callable | None = None, transport=None
):
    """This member's block: q [Ti, hq, dk], k [Ti, hkv, dk], v [Ti, hkv, dv] -> fp32 (out, lse)
    over all blocks."""
    n, i, blocks = comm.size, comm.index, layout.blocks
    transport = transport if transport is not None else KVTransport(k, v)
    message = transport.own(k, v)  # what travels
    kb, vb = k, v  # the block attended to at this step
    out = lse = None
    for step in range(n):
        j = (i - step) % n  # the block held at this step
        prev_shape = transport.shape(message, blocks[(j - 1) % n].num_tokens)
        nxt = comm.send_recv(message, prev_shape, KV_TAG) if step < n - 1 else None
        if step == 0 and side_work is not None:
            side_work()
        res = backend.forward(q, kb, vb, blocks[i], blocks[j], scale)
        if res is not None:
            out, lse = merge(out, lse, *res)
        if nxt is not None:
            message = nxt.wait()
            kb, vb = transport.expand(message)
    return out, lse  # never None: every query sees itself in its own block


def ring_backward(
    dout,
    q,
    k,
    v,
    out,
    lse,
    layout: MicroBatchLayout,
    comm,
    scale,
    backend,
    side_work=None,
    grad_dtype=None,
    transport=None,
):
    """Gradients of this member's block; dK/dV of every block come home round the ring.

    ``grad_dtype`` (e.g. bf16): the dtype the accumulators travel in; each hop adds its
    contribution in fp32 and rounds once before sending on (None: fp32 all the way)."""
    n, i, blocks = comm.size, comm.index, layout.blocks
    transport = transport if transport is not None else KVTransport(k, v)
    message = transport.own(k, v)
    kb, vb = k, v
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    grad_in = None  # the accumulator of the next block, on its way from the predecessor
    for step in range(n):
        j = (i - step) % n
        prev_shape = transport.shape(message, blocks[(j - 1) % n].num_tokens)
        nxt = comm.send_recv(message, prev_shape, KV_TAG) if step < n - 1 else None
        if step == 0 and side_work is not None:
            side_work()
        res = backend.backward(dout, q, kb, vb, out, lse, blocks[i], blocks[j], scale)
        acc = transport.grad_zeros(message) if grad_in is None else grad_in.wait().float()
        if res is not None:
            dq += res[0]
            transport.add(acc, res[1], res[2], message, own=step == 0)
        send = acc if grad_dtype is None or n == 1 else acc.to(grad_dtype)
        grad_in = comm.send_recv(send, prev_shape, GRAD_TAG)  # block j's accumulator moves on
        if nxt is not None:
            message = nxt.wait()
            kb, vb = transport.expand(message)
    acc = grad_in.wait().float()  # after N hops: this member's own block, every contribution in
    return (dq, *transport.home(acc))
