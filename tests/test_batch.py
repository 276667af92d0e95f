import numpy as np
import pytest
import torch

from megatron_bytescale.errors import PlanError
from megatron_bytescale.planner.contract import MicroBatch, ring_pieces, whole_piece
from megatron_bytescale.runtime.batch import build_micro_batch_data

DOCS = {0: np.arange(100, 120), 1: np.arange(7, 10)}


def read(seq_id, start, end):
    return DOCS[seq_id][start:end]


def test_ring_share_reads_labels_across_its_range_ends():
    piece = ring_pieces(0, 20, (0, 1))[0]  # ranges (0,5), (15,20)
    data = build_micro_batch_data(MicroBatch((piece, whole_piece(1, 3, 0))), read)
    assert data.positions.tolist() == [0, 1, 2, 3, 4, 15, 16, 17, 18, 19, 0, 1, 2]
    assert data.tokens[:5].tolist() == [100, 101, 102, 103, 104]
    # token 4's label lives on the other rank's range: it is read, never lost
    assert data.labels[:5].tolist() == [101, 102, 103, 104, 105]
    # the last token of each sequence has no label
    assert data.loss_mask.tolist() == [1] * 9 + [0] + [1, 1, 0]
    assert data.labels[-3:].tolist() == [8, 9, 0]


def test_short_reader_is_a_clear_error():
    with pytest.raises(PlanError, match="does not match the planned length"):
        build_micro_batch_data(MicroBatch((whole_piece(1, 5, 0),)), read)


def test_shape_check():
    data = build_micro_batch_data(MicroBatch((whole_piece(1, 3, 0),)), read)
    data.tokens = torch.zeros(4, dtype=torch.int64)
    with pytest.raises(PlanError, match="pieces hold 3 tokens"):
        data.check()
