"""The micro-batch whose forward is running: what attention and RoPE need beyond the tensors.

Megatron's modules receive hidden states, not a plan. The HDP step wraps each micro-batch's
forward in ``active_micro_batch(...)``; our core attention reads the layout (ring, document
boundaries, true positions) and RoPE reads each token's true position from
``current_micro_batch()``. Backward never reads it: the ring-attention autograd function keeps
what it needs, so backward may run after the context has exited.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import BytescaleError

_active: contextvars.ContextVar[ActiveMicroBatch | None] = contextvars.ContextVar(
    "bytescale_active_micro_batch", default=None
)


@dataclass(frozen=True)
class ActiveMicroBatch:
    layout: Any  # runtime.layout.MicroBatchLayout of this rank's tokens
    positions: torch.Tensor  # int64 [T]: each token's position inside its own sequence
    group: Any = None  # process group the ring ranks belong to (None: the caller's default)
    counter: Any = None  # runtime.ring_comm.P2PCounter that accumulates ring bytes, or None
    # every sequence length of the step's global batch (the plan's); what per-token counts
    # over the whole step derive from (multi-token prediction's loss scale)
    step_seq_lens: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        return int(self.positions.numel())


def _check(layout, positions) -> None:
    if not isinstance(positions, torch.Tensor) or positions.dim() != 1:
        shape = tuple(positions.shape) if isinstance(positions, torch.Tensor) else type(positions).__name__
        raise BytescaleError(f"positions must be a 1-D tensor with one entry per token, got {shape}")
    if positions.dtype.is_floating_point or positions.dtype == torch.bool:
        raise BytescaleError(f"positions must be an integer tensor, got {positions.dtype}")
    if positions.numel() and int(positions.min()) < 0:
        raise BytescaleError("positions must not be negative: they are token positions inside their sequences")
    expected = getattr(layout, "positions", None)  # runtime.layout.MicroBatchLayout has them
    if isinstance(expected, torch.Tensor) and not torch.equal(expected, positions.to(expected.device)):
        raise BytescaleError(
            f"positions ({positions.numel()} tokens) differ from the layout's ({expected.numel()} tokens): "
            "pass the positions of the micro-batch the layout was built from"
        )


@contextlib.contextmanager
def active_micro_batch(
    layout, positions: torch.Tensor, group=None, counter=None, step_seq_lens: tuple[int, ...] = ()
) -> Iterator[ActiveMicroBatch]:
    """Make one micro-batch current for the forward run inside this block (not nestable)."""
    if _active.get() is not None:
        raise BytescaleError(
            "a micro-batch is already active: run one micro-batch's forward at a time "
            "(leave the previous active_micro_batch block first)"
        )
    _check(layout, positions)
    active = ActiveMicroBatch(
        layout=layout, positions=positions, group=group, counter=counter, step_seq_lens=tuple(step_seq_lens)
    )
    token = _active.set(active)
    try:
        yield active
    finally:
        _active.reset(token)


def current_micro_batch() -> ActiveMicroBatch:
    """The active micro-batch; an error names the fix when there is none."""
    active = _active.get()
    if active is None:
        raise BytescaleError(
            "no micro-batch is active: run the model's forward inside "
            "megatron_bytescale.runtime.context.active_micro_batch(layout, positions) "
            "(the HDP step does this for each micro-batch)"
        )
    return active


def active_or_none() -> ActiveMicroBatch | None:
    """The active micro-batch, or None outside the HDP step (Megatron's own schedules)."""
    return _active.get()
