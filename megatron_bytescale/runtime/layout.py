"""Where every token of one micro-batch sits, as ring attention needs it on one rank.

This rank's tokens come piece after piece in plan order, each piece's ranges in order (the
layout of ``runtime.batch.MicroBatchData``). Pieces whose ring is this rank alone are *local*
(whole sequences, attended here). The other pieces are *distributed*: all of them share the
micro-batch's ring, and what travels round that ring is one *block* per member holding that
member's distributed tokens in a canonical order: sequences by id, each sequence's zigzag
ranges in order. Every block is derived from ``zigzag_ranges`` alone, so a receiver sizes its
buffers and builds its masks without being sent any metadata.

Two-level attention (``heads_split`` u > 1): the ring's consecutive members form groups of u
(one node each); ``GroupLayout`` says which group this rank is in, its place there, the ring
across groups it joins (members at the same place of every group) and each group's *group
block*: the group's blocks merged, sequences by id, each sequence's runs by position (so a
group block of a zigzag ring is itself zigzag: two runs per sequence).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from ..errors import PlanError
from ..planner.contract import RING_TRANSPORTS, MicroBatch
from ..planner.contract.zigzag import zigzag_ranges

Run = tuple[int, int, int]  # (seq_id, start, end): positions [start, end) of one sequence
Rows = slice | torch.Tensor  # rows of this rank's token tensors: a slice when contiguous


@dataclass(frozen=True)
class TokenBlock:
    """Tokens laid out as runs, back to back; a sequence's runs are adjacent and ascending."""

    runs: tuple[Run, ...]

    @cached_property
    def num_tokens(self) -> int:
        return sum(end - start for _, start, end in self.runs)

    @cached_property
    def seq_ids(self) -> torch.Tensor:
        return torch.tensor([sid for sid, start, end in self.runs for _ in range(start, end)], dtype=torch.int64)

    @cached_property
    def positions(self) -> torch.Tensor:
        return torch.tensor([p for _, start, end in self.runs for p in range(start, end)], dtype=torch.int64)

    @cached_property
    def row_runs(self) -> tuple[tuple[int, int, int, int], ...]:
        """(seq_id, start, end, first row) of every run."""
        out, row = [], 0
        for sid, start, end in self.runs:
            out.append((sid, start, end, row))
            row += end - start
        return tuple(out)


@dataclass(frozen=True, eq=False)
class MicroBatchLayout:
    rank: int  # this rank's HDP rank
    seq_ids: torch.Tensor  # int64 [T]: sequence of each token
    positions: torch.Tensor  # int64 [T]: true position of each token inside its sequence
    local_block: TokenBlock  # the local (whole) sequences, in token order
    local_rows: Rows  # where the local tokens sit among this rank's tokens
    ring: tuple[int, ...]  # HDP ranks of the distributed pieces' ring; (rank,) when there are none
    ring_index: int  # this rank's place in ``ring``
    blocks: tuple[TokenBlock, ...]  # every ring member's block (empty when there is no ring)
    ring_rows: Rows  # where this rank's own block sits among its tokens, in block order
    heads_split: int = 1  # two-level group size u (1: the plain ring)
    transport: str = "kv"  # what the ring carries (the plan's Piece.transport)

    @property
    def num_tokens(self) -> int:
        return int(self.seq_ids.numel())

    @property
    def ring_size(self) -> int:
        return len(self.ring)

    @property
    def block_tokens(self) -> tuple[int, ...]:
        """Tokens of each ring member's block (what each KV hop carries)."""
        return tuple(b.num_tokens for b in self.blocks)

    @cached_property
    def groups(self) -> GroupLayout:
        """The two-level structure of this rank's ring (``heads_split`` > 1 only)."""
        return GroupLayout.of(self.blocks, self.ring, self.ring_index, self.heads_split)

    @classmethod
    def from_micro_batch(cls, mb: MicroBatch, rank: int) -> MicroBatchLayout:
        # no pieces: an expert-parallel slot filler (planner.expert.slots); the step pads it to
        # padding tokens of its own (runtime.padding) so that it joins the MoE all-to-alls
        seen, rings = set(), set()
        for p in mb.pieces:
            where = f"rank {rank}: piece of sequence {p.seq_id}"
            if p.seq_id in seen:
                raise PlanError(f"{where} appears twice in one micro-batch; merge its ranges into one piece")
            seen.add(p.seq_id)
            if rank not in p.ring:
                raise PlanError(
                    f"{where} is on ring {p.ring}, which does not contain rank {rank}; build the layout on a ring "
                    "member"
                )
            if p.is_distributed:
                if len(set(p.ring)) != len(p.ring):
                    raise PlanError(f"{where}: ring {p.ring} repeats a rank")
                if p.ring_size > p.seq_len:
                    raise PlanError(f"{where}: a ring of {p.ring_size} ranks for {p.seq_len} tokens leaves ranks empty")
                rings.add(p.ring)
                share = zigzag_ranges(p.seq_len, p.ring_size)[p.ring_index(rank)]
                if p.ranges != share:
                    raise PlanError(f"{where} holds {p.ranges}, but its zigzag share on ring {p.ring} is {share}")
            elif p.ranges != ((0, p.seq_len),):
                raise PlanError(f"{where} is on a ring of one but holds {p.ranges}, not the whole [0, {p.seq_len})")
        if len(rings) > 1:
            raise PlanError(f"rank {rank}: distributed pieces use rings {sorted(rings)}; a micro-batch has one ring")
        splits = {p.heads_split for p in mb.pieces if p.is_distributed}
        heads_split = splits.pop() if len(splits) == 1 else 1
        if splits or (rings and (heads_split < 1 or len(next(iter(rings))) % heads_split)):
            raise PlanError(f"rank {rank}: distributed pieces need one heads_split that divides their ring's size")
        carried = {p.transport for p in mb.pieces if p.is_distributed}
        transport = carried.pop() if len(carried) == 1 else "kv"
        if carried or transport not in RING_TRANSPORTS or (transport != "kv" and heads_split > 1):
            raise PlanError(
                f"rank {rank}: distributed pieces need one ring transport of {', '.join(RING_TRANSPORTS)} "
                "('latent' on a plain ring only)"
            )

        # this rank's token order, and the offset of each piece in it
        offsets, seq_ids, positions, row = {}, [], [], 0
        for p in mb.pieces:
            offsets[p.seq_id] = row
            for start, end in p.ranges:
                seq_ids.extend([p.seq_id] * (end - start))
                positions.extend(range(start, end))
                row += end - start

        local = [p for p in mb.pieces if not p.is_distributed]
        local_block = TokenBlock(tuple((p.seq_id, 0, p.seq_len) for p in local))
        local_rows = _rows([(offsets[p.seq_id], offsets[p.seq_id] + p.tokens) for p in local])

        if not rings:
            ring, index, blocks, ring_rows = (rank,), 0, (), slice(0, 0)
        else:
            ring = next(iter(rings))
            index = ring.index(rank)
            dist = sorted((p for p in mb.pieces if p.is_distributed), key=lambda p: p.seq_id)
            blocks = tuple(
                TokenBlock(tuple((p.seq_id, a, b) for p in dist for a, b in zigzag_ranges(p.seq_len, len(ring))[j]))
                for j in range(len(ring))
            )
            ring_rows = _rows([(offsets[p.seq_id], offsets[p.seq_id] + p.tokens) for p in dist])
        return cls(
            rank=rank,
            seq_ids=torch.tensor(seq_ids, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            local_block=local_block,
            local_rows=local_rows,
            ring=ring,
            ring_index=index,
            blocks=blocks,
            ring_rows=ring_rows,
            heads_split=heads_split if rings else 1,
            transport=transport,
        )


@dataclass(frozen=True, eq=False)
class GroupLayout:
    """This rank's place in a two-level ring (see the module docstring)."""

    size: int  # u: members per group
    num_groups: int  # M: the ring across groups has M members
    group_index: int  # g: this rank's group (its place in ``cross_ring``)
    place: int  # a: this rank's place in its group (its head slice)
    group: tuple[int, ...]  # HDP ranks of this rank's group, by place
    cross_ring: tuple[int, ...]  # HDP ranks at place a of every group, by group
    blocks: tuple[TokenBlock, ...]  # every group's group block (what travels the cross ring)
    member_tokens: tuple[int, ...]  # tokens of each group member's own block, by place
    order: torch.Tensor  # int64: group-block row r is row order[r] of the members' blocks back to back

    @classmethod
    def of(cls, blocks: tuple[TokenBlock, ...], ring: tuple[int, ...], index: int, u: int) -> GroupLayout:
        n = len(ring)
        if u < 2 or n % u:
            raise PlanError(f"two-level attention needs heads_split >= 2 dividing the ring size {n}; got {u}")
        m, g, a = n // u, index // u, index % u
        merged, order = [], None
        for h in range(m):
            runs, row = [], 0  # (seq_id, start, end, row in the members' blocks back to back)
            for b in range(u):
                for sid, start, end in blocks[h * u + b].runs:
                    runs.append((sid, start, end, row))
                    row += end - start
            runs.sort()
            out: list[list[int]] = []
            for sid, start, end, _ in runs:
                if out and out[-1][0] == sid and out[-1][2] == start:
                    out[-1][2] = end
                else:
                    out.append([sid, start, end])
            merged.append(TokenBlock(tuple(tuple(r) for r in out)))
            if h == g:
                order = torch.cat([torch.arange(r, r + end - start) for _, start, end, r in runs])
        return cls(
            size=u,
            num_groups=m,
            group_index=g,
            place=a,
            group=tuple(ring[g * u : (g + 1) * u]),
            cross_ring=tuple(ring[h * u + a] for h in range(m)),
            blocks=tuple(merged),
            member_tokens=tuple(blocks[g * u + b].num_tokens for b in range(u)),
            order=order,
        )


def _rows(spans: list[tuple[int, int]]) -> Rows:
    """Row spans as a slice when they are back to back, else as an index tensor."""
    if not spans:
        return slice(0, 0)
    if all(a[1] == b[0] for a, b in zip(spans, spans[1:])):
        return slice(spans[0][0], spans[-1][1])
    return torch.cat([torch.arange(a, b) for a, b in spans])


def take_rows(x: torch.Tensor, rows: Rows) -> torch.Tensor:
    """``x[rows]`` along dim 0 (a view for a slice)."""
    return x[rows] if isinstance(rows, slice) else x.index_select(0, rows.to(x.device))


def put_rows(dst: torch.Tensor, rows: Rows, src: torch.Tensor) -> None:
    """``dst[rows] = src`` along dim 0 (cast to dst's dtype)."""
    if isinstance(rows, slice):
        dst[rows] = src
    else:
        dst.index_copy_(0, rows.to(dst.device), src.to(dst.dtype))
