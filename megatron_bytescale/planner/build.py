"""The plan's micro-batches from each rank's ordered items: ring members' shares (zigzag
pieces) and local micro-batches of whole sequences."""

from __future__ import annotations

from .balance import Unit
from .contract import MicroBatch, Piece, micro_batch, ring_pieces, whole_pieces
from .cost_model import CostModel
from .order.runs import Item, LocalBatch
from .sizing import two_level


def build_ranks(
    lens,
    units: list[Unit],
    members: dict[int, tuple[int, ...]],
    runs: list[list[Item]],
    ranks_per_node: int = 1,
    cost: CostModel | None = None,
) -> tuple:
    """The plan's micro-batches from each rank's ordered items (a two-level ring keeps the
    group size its placement allows: ``two_level.realized_split``)."""
    pieces_of: dict[int, dict[int, Piece]] = {}  # rings with whole sequences beside their shares
    ring_mbs: dict[int, dict[int, MicroBatch]] = {}  # the others: each member's micro-batch
    new = object.__new__  # ``micro_batch`` inlined: a ring member each
    for u, ring in members.items():
        unit = units[u]
        sid = unit.seq_ids[0]
        split = two_level.realized_split(ring, unit.heads_split, ranks_per_node, cost) if cost is not None else 1
        if unit.fillers:
            pieces_of[u] = dict(zip(ring, ring_pieces(sid, lens[sid], ring, heads_split=split)))
            continue
        s = lens[sid]
        ring_t = tuple(ring)
        ratio = unit.ratio
        key = (ring_t, (sid,))  # MicroBatch.ring_key, one tuple for all members
        per_member = {}
        for r, piece in zip(ring, ring_pieces(sid, s, ring_t, heads_split=split)):
            mb = new(MicroBatch)
            d = mb.__dict__
            d["pieces"] = (piece,)
            d["offload_ratio"] = ratio
            d["ring_key"] = key
            per_member[r] = mb
        ring_mbs[u] = per_member
    ranges_of: dict[int, tuple] = {}  # shared by the whole pieces of one length
    ranks = []
    for rank, items in enumerate(runs):
        mbs = []
        one = (rank,)
        for x in items:
            if type(x) is LocalBatch:
                mb = new(MicroBatch)
                d = mb.__dict__
                d["pieces"] = whole_pieces(x.seq_ids, lens, one, ranges_of)
                d["offload_ratio"] = x.ratio
                mbs.append(mb)
                continue
            member = ring_mbs.get(x)
            if member is not None:
                mbs.append(member[rank])
                continue
            unit = units[x]
            slot = members[x].index(rank)
            mbs.append(
                micro_batch((pieces_of[x][rank],) + whole_pieces(unit.fillers[slot], lens, one, ranges_of), unit.ratio)
            )
        ranks.append(tuple(mbs))
    return tuple(ranks)
