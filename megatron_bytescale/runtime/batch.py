"""One micro-batch's tensors as a rank receives them: the contract between the data loaders
and the HDP step. Tokens are laid out piece after piece, in plan order; each token carries
its true position inside its own sequence (RoPE, causal masking) and its next-token label.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import PlanError
from ..planner.contract import MicroBatch, Plan

# (seq_id, start, end) -> token ids of that sequence's tokens [start, end)
TokenReader = Callable[[int, int, int], np.ndarray]


@dataclass
class MicroBatchData:
    micro_batch: MicroBatch  # pieces, ring, offload ratio
    tokens: torch.Tensor  # int64 [T]
    labels: torch.Tensor  # int64 [T]: token at position p+1 of the same sequence
    loss_mask: torch.Tensor  # float32 [T]: 0 for the last token of each sequence (no label)
    positions: torch.Tensor  # int64 [T]: position inside its own sequence
    # bool [T], True on padding tokens (runtime.padding); None: no padding. MoE routers leave
    # padding out of their load-balancing statistics
    padding_mask: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())

    def check(self) -> None:
        """Tensor shapes must match the plan's pieces (a mismatch is a data bug, not a hang)."""
        expected = self.micro_batch.tokens
        for name in ("tokens", "labels", "loss_mask", "positions"):
            t = getattr(self, name)
            if t.dim() != 1 or t.numel() != expected:
                raise PlanError(f"micro-batch {name} has shape {tuple(t.shape)}, but its pieces hold {expected} tokens")


@dataclass
class StepBatch:
    """What one HDP rank receives for one training step: the step's plan and its own
    micro-batches (possibly none), in plan order."""

    plan: Plan
    rank: int  # HDP rank this delivery is for
    micro_batches: list[MicroBatchData]
    step: int = 0

    def check(self) -> None:
        planned = self.plan.micro_batches(self.rank)
        if len(planned) != len(self.micro_batches):
            raise PlanError(
                f"rank {self.rank} received {len(self.micro_batches)} micro-batches, its plan has {len(planned)}"
            )
        for i, (mb, data) in enumerate(zip(planned, self.micro_batches)):
            if data.micro_batch != mb:
                raise PlanError(f"rank {self.rank} micro-batch {i} does not match the step's plan")
            data.check()


def build_micro_batch_data(mb: MicroBatch, read: TokenReader, label_mask: TokenReader | None = None) -> MicroBatchData:
    """Read exactly this micro-batch's tokens (plus one label token past each range end).
    ``label_mask(seq_id, start, end)``, where given: 1 for each token of ``[start, end)`` that
    counts as a label (an answer token of a conversation, ``--sft``); a token's loss-mask entry
    is then its label's, so prompt tokens stay out of the loss on whichever rank holds them."""
    tokens, labels, mask, positions = [], [], [], []
    for piece in mb.pieces:
        for start, end in piece.ranges:
            stop = min(end + 1, piece.seq_len)
            ids = np.asarray(read(piece.seq_id, start, stop), dtype=np.int64)
            if ids.shape != (stop - start,):
                raise PlanError(
                    f"sequence {piece.seq_id}: reader returned {ids.shape[0] if ids.ndim else 0} tokens for "
                    f"[{start}, {stop}); the data does not match the planned length {piece.seq_len}"
                )
            n = end - start
            tokens.append(ids[:n])
            lab = np.zeros(n, dtype=np.int64)
            lab[: stop - start - 1] = ids[1:]
            labels.append(lab)
            m = np.ones(n, dtype=np.float32)
            if label_mask is not None:
                m[: stop - start - 1] = np.asarray(label_mask(piece.seq_id, start + 1, stop), dtype=np.float32)
            if end == piece.seq_len:
                m[-1] = 0.0
            mask.append(m)
            positions.append(np.arange(start, end, dtype=np.int64))
    cat = lambda parts, dtype: torch.from_numpy(np.concatenate(parts)) if parts else torch.zeros(0, dtype=dtype)  # noqa: E731
    data = MicroBatchData(
        micro_batch=mb,
        tokens=cat(tokens, torch.int64),
        labels=cat(labels, torch.int64),
        loss_mask=cat(mask, torch.float32),
        positions=cat(positions, torch.int64),
    )
    data.check()
    return data
