"""Shift a per-token tensor one token along each document, across ring members (multi-token prediction).

Multi-token prediction (Megatron's ``--mtp-num-layers``) gives MTP depth k, at each token,
the embedding of the token k positions further on and the label k + 1 positions further on:
megatron-core makes them by rolling input ids, labels and the loss mask left one token per
depth (``multi_token_prediction.roll_tensor``), zeroing what falls off the end. Under HDP a
rank's row holds whole documents and zigzag shares of long ones, so "the next token" must
stay inside its document and may live on another member of the document's ring (the
token after a share's range is the first token of another member's range), or in the
other zigzag chunk of the same member (merged into one range then: adjacent).

``roll_within_documents(x, layout)`` is that shift: ``out[..., t] = x[..., next(t)]``, where
``next(t)`` is the row holding the same document's next position, and 0 after a document's
last token. The rows whose next token is elsewhere are the ends of distributed ranges: each
member sends the values at its ranges' first tokens to the member holding the token before,
one message per peer, both sides ordered by (sequence, position), so nothing but the data
travels (the layout says who holds what). Every ring member makes the same calls in the same
order (the same model code), so the exchanges pair up.
"""

from __future__ import annotations

from dataclasses import dataclass
from weakref import WeakKeyDictionary

import torch
import torch.distributed as dist

from ..errors import ConfigError
from .layout import MicroBatchLayout
from .ring_comm import RING_TIMEOUT_S, Pending

ROLL_TAG = 3  # beside ring_comm's KV_TAG, GRAD_TAG and group_exchange's A2A_TAG


@dataclass(frozen=True)
class RollRoute:
    """Where each row's next token comes from, for one rank's micro-batch."""

    source: torch.Tensor  # int64 [T]: the local row holding the next token, or -1
    sends: dict[int, torch.Tensor]  # ring index -> rows whose values that member needs, in order
    receives: dict[int, torch.Tensor]  # ring index -> rows filled from that member's message, in order


_routes: WeakKeyDictionary = WeakKeyDictionary()


def roll_route(layout: MicroBatchLayout) -> RollRoute:
    """The route of ``layout`` (made once per layout)."""
    route = _routes.get(layout)
    if route is None:
        route = _routes[layout] = _make_route(layout)
    return route


def _make_route(layout: MicroBatchLayout) -> RollRoute:
    seq, pos = layout.seq_ids, layout.positions
    t = seq.numel()
    span = int(pos.max()) + 2 if t else 1
    key = seq * span + pos
    order = torch.argsort(key)
    sorted_key = key[order]
    found = torch.searchsorted(sorted_key, key + 1).clamp(max=max(t - 1, 0))
    local = sorted_key[found] == key + 1 if t else torch.zeros(0, dtype=torch.bool)
    source = torch.where(local, order[found], torch.full_like(key, -1))

    # distributed sequences: who holds which positions (from the blocks: no metadata travels)
    holders: dict[int, list[tuple[int, int, int]]] = {}  # seq -> (start, end, ring index)
    for j, block in enumerate(layout.blocks):
        for sid, start, end in block.runs:
            holders.setdefault(sid, []).append((start, end, j))

    def row_of(sid: int, position: int) -> int:
        return int(order[torch.searchsorted(sorted_key, torch.tensor(sid * span + position))])

    me = layout.ring_index
    sends: dict[int, list[tuple[int, int, int]]] = {}
    receives: dict[int, list[tuple[int, int, int]]] = {}
    for sid, runs in holders.items():
        length = max(end for _, end, _ in runs)
        for start, end, j in runs:
            if j != me:
                continue
            if start > 0:  # the member holding start - 1 needs this run's first value
                sends.setdefault(_holder(runs, start - 1), []).append((sid, start, row_of(sid, start)))
            if end < length:  # this run's last row takes the first value of the member holding `end`
                receives.setdefault(_holder(runs, end), []).append((sid, end, row_of(sid, end - 1)))
    rows = lambda entries: torch.tensor([r for *_, r in sorted(entries)], dtype=torch.int64)  # noqa: E731
    return RollRoute(
        source=source,
        sends={j: rows(e) for j, e in sends.items()},
        receives={j: rows(e) for j, e in receives.items()},
    )


def _holder(runs, position: int) -> int:
    for start, end, j in runs:
        if start <= position < end:
            return j
    raise ConfigError(f"no ring member holds position {position}")  # the layout's blocks cover the sequence


def roll_within_documents(x: torch.Tensor, layout: MicroBatchLayout, group=None) -> torch.Tensor:
    """``x`` [..., T] (this rank's tokens last, in layout order) shifted one token left along
    each document: row t takes the value of its document's next token, 0 after the last.
    ``group``: the HDP process group the layout's ring refers to (None: the world)."""
    route = roll_route(layout)
    device = x.device
    source = route.source.to(device)
    out = torch.where(
        source >= 0, x.index_select(-1, source.clamp(min=0)), torch.zeros((), dtype=x.dtype, device=device)
    )
    if route.sends or route.receives:
        wire = torch.uint8 if x.dtype == torch.bool else x.dtype  # gloo has no bool
        to_global = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
        ops, incoming = [], {}
        for j, rows in sorted(route.sends.items()):
            message = x.index_select(-1, rows.to(device)).to(wire).contiguous()
            ops.append(dist.P2POp(dist.isend, message, to_global(layout.ring[j]), group, ROLL_TAG))
        for j, rows in sorted(route.receives.items()):
            incoming[j] = torch.empty((*x.shape[:-1], rows.numel()), dtype=wire, device=device)
            ops.append(dist.P2POp(dist.irecv, incoming[j], to_global(layout.ring[j]), group, ROLL_TAG))
        timeout = RING_TIMEOUT_S if dist.get_backend(group) == "gloo" else None
        peers = f"ring {layout.ring}: shifting multi-token prediction's tokens across its members"
        Pending(dist.batch_isend_irecv(ops), None, None, timeout, peers).wait()
        for j, rows in route.receives.items():
            out.index_copy_(-1, rows.to(device), incoming[j].to(x.dtype))
    return out
