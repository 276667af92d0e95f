import numpy as np
import pytest
import torch

from megatron_bytescale.errors import PlanError
from megatron_bytescale.planner.contract import MicroBatch, Piece, ring_pieces, whole_piece
from megatron_bytescale.planner.contract.zigzag import rank_tokens
from megatron_bytescale.runtime.batch import build_micro_batch_data
from megatron_bytescale.runtime.layout import MicroBatchLayout, put_rows, take_rows

RING = (3, 0, 2)  # ring order differs from rank order on purpose


def mixed_micro_batches():
    """Per ring member: whole short sequences around the shares of two long ones (ids 7 and 2)."""
    long7, long2 = ring_pieces(7, 23, RING), ring_pieces(2, 13, RING)
    return {
        3: MicroBatch((long7[0], whole_piece(4, 3, 3), long2[0])),
        0: MicroBatch((whole_piece(5, 2, 0), long2[1], long7[1], whole_piece(6, 4, 0))),
        2: MicroBatch((long7[2], long2[2])),
    }


def test_token_order_matches_micro_batch_data():
    mb = mixed_micro_batches()[0]
    layout = MicroBatchLayout.from_micro_batch(mb, 0)
    data = build_micro_batch_data(mb, lambda sid, a, b: np.arange(a, b) + 1000 * sid)
    assert layout.num_tokens == data.num_tokens == mb.tokens
    assert torch.equal(layout.positions, data.positions)
    assert torch.equal(layout.seq_ids, (data.tokens - data.positions) // 1000)
    assert layout.ring == RING and layout.ring_index == 1 and layout.rank == 0


def test_local_and_ring_rows_partition_the_tokens():
    for rank, mb in mixed_micro_batches().items():
        layout = MicroBatchLayout.from_micro_batch(mb, rank)
        seq = layout.seq_ids
        local = take_rows(seq, layout.local_rows)
        ring = take_rows(seq, layout.ring_rows)
        assert sorted(local.tolist() + ring.tolist()) == sorted(seq.tolist())
        assert set(ring.tolist()) == {2, 7}
        assert set(local.tolist()).isdisjoint({2, 7})
        # this rank's own block is exactly its distributed tokens, in block order
        own = layout.blocks[layout.ring_index]
        assert torch.equal(own.seq_ids, ring)
        assert torch.equal(own.positions, take_rows(layout.positions, layout.ring_rows))
        assert torch.equal(layout.local_block.positions, take_rows(layout.positions, layout.local_rows))


def test_every_member_derives_the_same_blocks():
    layouts = {r: MicroBatchLayout.from_micro_batch(mb, r) for r, mb in mixed_micro_batches().items()}
    blocks = {lay.blocks for lay in layouts.values()}
    assert len(blocks) == 1
    blocks = blocks.pop()
    assert layouts[2].block_tokens == tuple(rank_tokens(23, 3, j) + rank_tokens(13, 3, j) for j in range(3))
    # together the blocks hold every token of the distributed sequences exactly once
    pairs = sorted(
        zip(torch.cat([b.seq_ids for b in blocks]).tolist(), torch.cat([b.positions for b in blocks]).tolist())
    )
    assert pairs == sorted([(7, p) for p in range(23)] + [(2, p) for p in range(13)])


def test_rows_come_back_in_place():
    layout = MicroBatchLayout.from_micro_batch(mixed_micro_batches()[0], 0)
    x = torch.arange(layout.num_tokens * 2.0).reshape(-1, 2)
    y = torch.zeros_like(x)
    for rows in (layout.local_rows, layout.ring_rows):
        put_rows(y, rows, take_rows(x, rows))
    assert torch.equal(x, y)


def test_all_local_micro_batch_has_a_ring_of_one():
    layout = MicroBatchLayout.from_micro_batch(MicroBatch((whole_piece(0, 5, 1), whole_piece(1, 2, 1))), 1)
    assert layout.ring == (1,) and layout.ring_size == 1 and layout.blocks == ()
    assert layout.local_rows == slice(0, 7)


def test_an_empty_micro_batch_is_an_expert_slot_filler_of_padding_tokens():
    from megatron_bytescale.runtime.batch import build_micro_batch_data
    from megatron_bytescale.runtime.padding import PAD_SEQ, pad_micro_batch

    empty = MicroBatch(())
    layout = MicroBatchLayout.from_micro_batch(empty, 3)
    assert layout.num_tokens == 0 and layout.ring == (3,)
    data = build_micro_batch_data(empty, lambda sid, a, b: None)
    for multiple in (1, 2):  # one padding token, or TP's multiple under sequence parallelism
        padded, grown = pad_micro_batch(data, layout, multiple)
        assert padded.num_tokens == grown.num_tokens == multiple
        assert padded.loss_mask.sum() == 0 and grown.seq_ids.tolist() == [PAD_SEQ] * multiple


@pytest.mark.parametrize(
    "mb, rank, message",
    [
        (MicroBatch((whole_piece(0, 4, 1),)), 0, "does not contain rank 0"),
        (MicroBatch((ring_pieces(0, 8, (0, 1))[0], ring_pieces(1, 8, (0, 2))[0])), 0, "a micro-batch has one ring"),
        (MicroBatch((ring_pieces(0, 8, (0, 1))[1],)), 0, "zigzag share"),
        (MicroBatch((Piece(0, 8, ((0, 4),), (0,)),)), 0, "not the whole"),
        (MicroBatch((whole_piece(0, 4, 0), whole_piece(0, 4, 0))), 0, "appears twice"),
        (MicroBatch((Piece(0, 2, ((0, 1),), (0, 1, 2)),)), 0, "leaves ranks empty"),
        (MicroBatch((Piece(0, 8, ((0, 4),), (0, 0)),)), 0, "repeats a rank"),
    ],
)
def test_bad_micro_batches_are_plan_errors(mb, rank, message):
    with pytest.raises(PlanError, match=message):
        MicroBatchLayout.from_micro_batch(mb, rank)
