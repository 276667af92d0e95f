"""Sequence parallelism pads a micro-batch to a multiple of the TP size.

Megatron's sequence parallelism splits the token dimension evenly over the TP ranks (the
embedding output is scattered, every TP region gathers it back), so a micro-batch must hold a
multiple of TP tokens; HDP micro-batches hold any number. ``pad_micro_batch`` appends the few
missing tokens as a document of their own (``PAD_SEQ``): ring attention attends it only to
itself, so no real token ever sees it; its loss mask is 0, so it adds nothing to the loss, the
gradients or the token count (the count is the loss mask's sum). Only the micro-batch's data
and layout grow; the plan, the ring blocks and so the P2P traffic stay as planned.

Under expert parallelism the padding tokens pass the MoE router like any token: the experts
they reach compute their outputs, which no real token and no loss reads, so every gradient is
exactly unchanged; the data's ``padding_mask`` keeps them out of the router's load-balancing
statistics (aux losses, z-loss, expert bias: megatron-core's ``padding_mask`` of MoE routing).
"""

from __future__ import annotations

import dataclasses

import torch

from .batch import MicroBatchData
from .layout import MicroBatchLayout, TokenBlock, _rows

PAD_SEQ = -1  # sequence id of the padding tokens (real sequences have ids >= 0)
PAD_TOKEN = 0  # any id in the vocabulary: padding is never attended by real tokens nor in the loss


def padding_for(num_tokens: int, multiple: int) -> int:
    """Tokens to append so that ``num_tokens`` becomes a multiple of ``multiple``."""
    return -num_tokens % multiple


def pad_micro_batch(
    data: MicroBatchData, layout: MicroBatchLayout, multiple: int
) -> tuple[MicroBatchData, MicroBatchLayout]:
    """``data`` and ``layout`` with padding appended up to a multiple of ``multiple`` tokens
    (themselves when none is needed). An empty micro-batch (an expert-parallel slot filler,
    ``planner.expert.slots``) gets ``multiple`` padding tokens: megatron-core's layers do not
    run zero tokens, and the filler must run every MoE layer to join its all-to-alls."""
    t = data.num_tokens
    n = padding_for(t, multiple) if t else multiple
    if n == 0:
        return data, layout
    zeros = torch.zeros(n, dtype=torch.int64)
    padded = dataclasses.replace(
        data,
        tokens=torch.cat([data.tokens, torch.full((n,), PAD_TOKEN, dtype=torch.int64)]),
        labels=torch.cat([data.labels, zeros]),
        loss_mask=torch.cat([data.loss_mask, torch.zeros(n, dtype=data.loss_mask.dtype)]),
        positions=torch.cat([data.positions, torch.arange(n, dtype=torch.int64)]),
        padding_mask=torch.cat(
            [
                data.padding_mask if data.padding_mask is not None else torch.zeros(t, dtype=torch.bool),
                torch.ones(n, dtype=torch.bool),
            ]
        ),
    )
    local_rows = layout.local_rows
    if isinstance(local_rows, slice):
        spans = [(local_rows.start, local_rows.stop)] if local_rows.stop > local_rows.start else []
    else:
        spans = [(int(r), int(r) + 1) for r in local_rows]
    spans.append((t, t + n))
    grown = dataclasses.replace(
        layout,
        seq_ids=torch.cat([layout.seq_ids, torch.full((n,), PAD_SEQ, dtype=torch.int64)]),
        positions=torch.cat([layout.positions, torch.arange(n, dtype=torch.int64)]),
        local_block=TokenBlock(layout.local_block.runs + ((PAD_SEQ, 0, n),)),
        local_rows=_rows(spans),
    )
    return padded, grown


def sequence_parallel_multiple(config) -> int:
    """The token multiple a micro-batch needs under ``config`` (1 without sequence parallelism)."""
    if getattr(config, "sequence_parallel", False):
        return int(config.tensor_model_parallel_size)
    return 1
