"""Two-level attention: head all-to-all inside each group (node), ring across groups.

For a micro-batch whose plan sets ``heads_split`` u > 1, the ring's N members form M = N/u
groups of u consecutive members (``layout.GroupLayout``). Member a of group g:

1. sends each other member b of its group its block's tokens for b's head slice, and gets
   theirs for slice a: it now holds its group's *group block* (u blocks) for 1/u of the heads;
2. runs the ring (``ring_forward``/``ring_backward``, unchanged) across the M members at
   place a of every group: M-1 hops of group blocks, u times larger and with 1/u of the
   heads, so the same bytes per hop meet u times the compute;
3. sends each member b the output rows of b's block back; backward mirrors it (``dout``
   goes out as the queries did, dQ, dK, dV come back as the output did).

Head slices (``head_slices``): query heads split into u contiguous near-equal slices. When a
slice is whole KV groups (u divides the KV heads) it takes those KV heads; otherwise it takes
one copy of its queries' KV head per query head, and the copies' gradients are summed on the
way back: exact for any u up to the query heads, at more bytes (the planner avoids it).
Zigzag and document masking carry over: a group block is per sequence two runs of the
sequence's zigzag split over M, so the block attention of ``attention_ops`` applies as is.
Sequences local to this rank are attended whole while the first exchange is in flight.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from ..errors import PlanError
from .group_exchange import GroupExchange, SelfRing
from .layout import MicroBatchLayout, put_rows, take_rows
from .ring_comm import RingComm
from .ring_core import ring_backward, ring_forward

HeadSlice = tuple[tuple[int, ...], tuple[int, ...]]  # (query heads, KV heads) of one place


@lru_cache(maxsize=64)
def head_slices(hq: int, hkv: int, u: int) -> tuple[HeadSlice, ...]:
    """Query and KV heads of each of the u places of a group (see the module docstring)."""
    if not 1 <= u <= hq:
        raise PlanError(f"two-level attention splits {hq} query heads over groups of {u}; use heads_split <= {hq}")
    group = hq // hkv
    slices = []
    for a in range(u):
        q0, q1 = a * hq // u, (a + 1) * hq // u
        if q0 % group == 0 and q1 % group == 0:
            kv = tuple(range(q0 // group, q1 // group))
        else:
            kv = tuple(h // group for h in range(q0, q1))
        slices.append((tuple(range(q0, q1)), kv))
    return tuple(slices)


def two_level_attention(q, k, v, layout: MicroBatchLayout, group, scale: float, backend, counter=None, grad_dtype=None):
    """``ring_attention`` for a two-level layout (it checks the inputs and calls this)."""
    gl = layout.groups
    slices = head_slices(q.shape[1], k.shape[1], gl.size)
    exchange = GroupExchange(gl.group, gl.place, group, counter)
    ring = RingComm(gl.cross_ring, gl.group_index, group, counter) if gl.num_groups > 1 else SelfRing()
    return _TwoLevel.apply(q, k, v, layout, exchange, ring, slices, scale, backend, grad_dtype)


def two_level_with(q, k, v, layout: MicroBatchLayout, exchange, ring, scale: float, backend, grad_dtype=None):
    """The same over given transports: ``exchange`` (a ``group_exchange.LocalGroup`` member, say)
    and ``ring`` (a ``ring_comm.LocalRing`` member of the ring across groups, or ``SelfRing``);
    differentiable. For checks with every member a thread of one process."""
    slices = head_slices(q.shape[1], k.shape[1], layout.groups.size)
    return _TwoLevel.apply(q, k, v, layout, exchange, ring, slices, scale, backend, grad_dtype)


# ------------------------------------------------------------------ the head exchange
def _heads(x: torch.Tensor, heads: tuple[int, ...]) -> torch.Tensor:
    return x.index_select(1, torch.tensor(heads, device=x.device))


def to_group_block(exchange, gl, parts) -> list[torch.Tensor]:
    """This rank's block, all heads -> its group block, its head slice.

    ``parts``: (tensor [T_i, h, d], heads of every place) per input, head dims free (MLA's K and
    V differ); one message per place carries every input's slice, each flattened per token.
    Returns per input its group block [S, heads of this place, d], rows in group-block order."""
    x0 = parts[0][0]
    sends = [torch.cat([_heads(x, heads[b]).flatten(1) for x, heads in parts], dim=1) for b in range(gl.size)]
    width = sends[gl.place].shape[1]
    shapes = [(gl.member_tokens[b], width) for b in range(gl.size)]
    got = exchange.exchange(sends, shapes, x0.dtype, x0.device)
    got[gl.place] = sends[gl.place]
    block = torch.cat(got).index_select(0, gl.order.to(x0.device))
    sizes = [len(heads[gl.place]) * x.shape[2] for x, heads in parts]
    return [
        part.reshape(part.shape[0], len(heads[gl.place]), x.shape[2])
        for part, (x, heads) in zip(block.split(sizes, dim=1), parts)
    ]


def from_group_block(exchange, gl, x: torch.Tensor, widths: list[int]) -> list[torch.Tensor]:
    """The reverse: group block rows [S, W] (this place's heads, flattened per token) -> per
    place b, the rows of this rank's block for b's heads (``widths[b]`` values per token)."""
    rows = torch.empty_like(x)
    rows.index_copy_(0, gl.order.to(x.device), x)  # back to the members' blocks back to back
    mine = list(torch.split(rows, list(gl.member_tokens)))
    t = gl.member_tokens[gl.place]
    shapes = [(t, widths[b]) for b in range(gl.size)]
    got = exchange.exchange(mine, shapes, x.dtype, x.device)
    got[gl.place] = mine[gl.place]
    return got


def _scatter_heads(dst: torch.Tensor, heads: tuple[int, ...], src: torch.Tensor) -> None:
    """dst[:, heads] += src (repeated heads add up)."""
    dst.index_add_(1, torch.tensor(heads, device=dst.device), src.to(dst.dtype))


# ------------------------------------------------------------------ the autograd function
class _TwoLevel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, layout, exchange, ring, slices, scale, backend, grad_dtype):
        gl = layout.groups
        qh = [s[0] for s in slices]
        kvh = [s[1] for s in slices]
        rq, rk, rv = (take_rows(x, layout.ring_rows) for x in (q, k, v))
        sq, sk, sv = to_group_block(exchange, gl, [(rq, qh), (rk, kvh), (rv, kvh)])

        dv = v.shape[2]
        out = q.new_zeros(*q.shape[:2], dv)
        local = _LocalPart(q, k, v, layout, scale, backend)
        so, slse = ring_forward(sq, sk, sv, gl, ring, scale, backend, side_work=lambda: local.forward(out))
        so = so.to(q.dtype)
        back = from_group_block(exchange, gl, so.flatten(1), [len(h) * dv for h in qh])
        ro = q.new_zeros(rq.shape[0], rq.shape[1], dv)
        for b, part in enumerate(back):
            _scatter_heads(ro, qh[b], part.reshape(part.shape[0], len(qh[b]), dv))
        put_rows(out, layout.ring_rows, ro)

        ctx.save_for_backward(sq, sk, sv, so, slse, *local.saved())
        ctx.args = (layout, exchange, ring, slices, scale, backend, grad_dtype, q.shape, k.shape, v.shape)
        return out

    @staticmethod
    def backward(ctx, dout):
        sq, sk, sv, so, slse, *local_saved = ctx.saved_tensors
        layout, exchange, ring, slices, scale, backend, grad_dtype, qshape, kshape, vshape = ctx.args
        gl = layout.groups
        qh = [s[0] for s in slices]
        kvh = [s[1] for s in slices]
        dq = torch.zeros(qshape, dtype=sq.dtype, device=sq.device)
        dk = torch.zeros(kshape, dtype=sq.dtype, device=sq.device)
        dv = torch.zeros(vshape, dtype=sq.dtype, device=sq.device)
        (sdo,) = to_group_block(exchange, gl, [(take_rows(dout, layout.ring_rows), qh)])
        local = _LocalPart.restore(local_saved, layout, scale, backend)
        gq, gk, gv = ring_backward(
            sdo,
            sq,
            sk,
            sv,
            so,
            slse,
            gl,
            ring,
            scale,
            backend,
            side_work=lambda: local.backward(dout, dq, dk, dv),
            grad_dtype=grad_dtype,
        )
        dims = (qshape[2], kshape[2], vshape[2])
        msg = torch.cat((gq.flatten(1), gk.flatten(1), gv.flatten(1)), dim=1).to(sq.dtype)
        sizes = [(len(qh[b]) * dims[0], len(kvh[b]) * dims[1], len(kvh[b]) * dims[2]) for b in range(gl.size)]
        back = from_group_block(exchange, gl, msg, [sum(z) for z in sizes])
        t = gl.member_tokens[gl.place]
        rq, rk, rv = (
            torch.zeros((t, shape[1], shape[2]), dtype=torch.float32, device=sq.device)
            for shape in (qshape, kshape, vshape)
        )
        for b, part in enumerate(back):
            pq, pk, pv = part.split(sizes[b], dim=1)
            _scatter_heads(rq, qh[b], pq.reshape(t, len(qh[b]), dims[0]))
            _scatter_heads(rk, kvh[b], pk.reshape(t, len(kvh[b]), dims[1]))  # copies of a KV head add up here
            _scatter_heads(rv, kvh[b], pv.reshape(t, len(kvh[b]), dims[2]))
        for dst, g in ((dq, rq), (dk, rk), (dv, rv)):
            put_rows(dst, layout.ring_rows, g)
        return dq, dk, dv, None, None, None, None, None, None, None


class _LocalPart:
    """The sequences local to this rank (whole, all heads): attended beside the exchange."""

    def __init__(self, q, k, v, layout, scale, backend, saved=None):
        self.layout, self.scale, self.backend = layout, scale, backend
        self.active = bool(layout.local_block.runs)
        if saved is not None:
            self.parts = saved
        elif self.active:
            self.parts = [take_rows(x, layout.local_rows) for x in (q, k, v)]
        else:
            self.parts = []

    def forward(self, out: torch.Tensor) -> None:
        if self.active:
            lq, lk, lv = self.parts
            o, lse = self.backend.forward(lq, lk, lv, self.layout.local_block, self.layout.local_block, self.scale)
            put_rows(out, self.layout.local_rows, o)
            self.parts = [lq, lk, lv, o.to(lq.dtype), lse]

    def saved(self) -> list[torch.Tensor]:
        return self.parts

    @classmethod
    def restore(cls, saved, layout, scale, backend) -> _LocalPart:
        return cls(None, None, None, layout, scale, backend, saved=list(saved))

    def backward(self, dout, dq, dk, dv) -> None:
        if self.active:
            lq, lk, lv, lo, lse = self.parts
            ld = take_rows(dout, self.layout.local_rows)
            block = self.layout.local_block
            grads = self.backend.backward(ld, lq, lk, lv, lo, lse, block, block, self.scale)
            for dst, g in zip((dq, dk, dv), grads):
                put_rows(dst, self.layout.local_rows, g)
