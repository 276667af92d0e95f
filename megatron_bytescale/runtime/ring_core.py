"""The ring passes both attention variants run: a member's block of queries against every
KV block of its ring (forward), and the backward that sends the dK/dV accumulators home.

``comm`` is anything with ``size``, ``index`` and ``send_recv(tensor, recv_shape, tag)``
returning an object with ``wait()``: a ``RingComm``, a ``LocalRing`` member in one process,
or (two-level attention) a ring across the groups of a node. ``ring_attention`` runs them over
the plain ring, ``two_level_attention`` over the groups after its head all-to-all.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .attention_ops import merge
from .layout import MicroBatchLayout
from .ring_comm import GRAD_TAG, KV_TAG


def ring_forward(q, k, v, layout: MicroBatchLayout, comm, scale, backend, side_work: Callable | None = None):
    """This member's block: q [Ti, hq, d], k/v [Ti, hkv, d] -> fp32 (out, lse) over all blocks."""
    n, i, blocks = comm.size, comm.index, layout.blocks
    kv = torch.stack((k, v))  # what travels: [2, T_j, hkv, d]
    out = lse = None
    for step in range(n):
        j = (i - step) % n  # the block held at this step
        nxt = comm.send_recv(kv, _block_shape(kv, blocks[(j - 1) % n]), KV_TAG) if step < n - 1 else None
        if step == 0 and side_work is not None:
            side_work()
        res = backend.forward(q, kv[0], kv[1], blocks[i], blocks[j], scale)
        if res is not None:
            out, lse = merge(out, lse, *res)
        if nxt is not None:
            kv = nxt.wait()
    return out, lse  # never None: every query sees itself in its own block


def ring_backward(
    dout, q, k, v, out, lse, layout: MicroBatchLayout, comm, scale, backend, side_work=None, grad_dtype=None
):
    """Gradients of this member's block; dK/dV of every block come home round the ring.

    ``grad_dtype`` (e.g. bf16): the dtype the dK/dV accumulators travel in; each hop adds its
    contribution in fp32 and rounds once before sending on (None: fp32 all the way)."""
    n, i, blocks = comm.size, comm.index, layout.blocks
    kv = torch.stack((k, v))
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    grad_in = None  # the accumulator of the next block, on its way from the predecessor
    for step in range(n):
        j = (i - step) % n
        prev_shape = _block_shape(kv, blocks[(j - 1) % n])
        nxt = comm.send_recv(kv, prev_shape, KV_TAG) if step < n - 1 else None
        if step == 0 and side_work is not None:
            side_work()
        res = backend.backward(dout, q, kv[0], kv[1], out, lse, blocks[i], blocks[j], scale)
        dkv = (
            torch.zeros(kv.shape, dtype=torch.float32, device=kv.device) if grad_in is None else grad_in.wait().float()
        )
        if res is not None:
            dq += res[0]
            dkv[0] += res[1]
            dkv[1] += res[2]
        send = dkv if grad_dtype is None or n == 1 else dkv.to(grad_dtype)
        grad_in = comm.send_recv(send, prev_shape, GRAD_TAG)  # block j's accumulator moves on
        if nxt is not None:
            kv = nxt.wait()
    dkv = grad_in.wait().float()  # after N hops: this member's own block, every contribution in
    return dq, dkv[0], dkv[1]


def _block_shape(kv: torch.Tensor, block) -> tuple[int, ...]:
    return (2, block.num_tokens, kv.shape[2], kv.shape[3])
