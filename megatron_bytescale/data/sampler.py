"""Global batches: the order in which documents are trained on, cut into steps.

* Each epoch visits every document once, in an order shuffled from ``(seed, epoch)``.
* A document longer than ``context_length`` is cut into consecutive windows of
  ``context_length`` tokens (the last one shorter). **The remainder is not dropped**: each
  window is its own sample (its positions restart at 0 and its last token has no label, as
  at the end of a document), and the windows follow each other in the sample stream, so
  they land in the same step or the next ones. Every token is trained on once per epoch.
* A step takes samples in stream order while their total stays within ``step_tokens``
  (a token budget, not a sample count: lengths vary freely, nothing is padded or packed to a
  fixed length). The sample that would overflow opens the next step. Steps run across epoch
  boundaries without a break.

The stream position (:class:`Position`: epoch, index in the epoch's order, tokens of that
document already used) is the loader's entire state: from it, the same seed and the same
document lengths give the identical sequence of steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from ..errors import ConfigError


@dataclass(frozen=True)
class Sample:
    """One sequence of a global batch: tokens ``[start, end)`` of document ``doc_id``."""

    doc_id: int
    start: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Position:
    epoch: int = 0
    index: int = 0  # position in the epoch's document order
    offset: int = 0  # tokens of that document already taken (its next window starts here)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Position:
        return cls(int(data["epoch"]), int(data["index"]), int(data["offset"]))


class GlobalBatchSampler:
    def __init__(self, doc_lengths: Sequence[int], *, step_tokens: int, context_length: int, seed: int = 0):
        self.lengths = np.asarray(doc_lengths, dtype=np.int64)
        if self.lengths.ndim != 1 or self.lengths.size == 0:
            raise ConfigError("the dataset has no documents; build one with `bytescale prepare-data`")
        if np.any(self.lengths <= 0):
            raise ConfigError(f"document {int(np.flatnonzero(self.lengths <= 0)[0])} is empty; documents need tokens")
        if context_length <= 0:
            raise ConfigError(f"context length must be positive, got {context_length}")
        if step_tokens < context_length:
            raise ConfigError(
                f"the step token budget ({step_tokens}) is smaller than the context length ({context_length}); "
                f"a full-length sample could never be scheduled - raise the budget or lower the context length"
            )
        self.step_tokens = int(step_tokens)
        self.context_length = int(context_length)
        self.seed = int(seed)
        self._order_epoch = -1
        self._order: np.ndarray | None = None

    @property
    def num_documents(self) -> int:
        return int(self.lengths.size)

    def order(self, epoch: int) -> np.ndarray:
        """Document ids in the order epoch ``epoch`` visits them."""
        if epoch != self._order_epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._order = rng.permutation(self.lengths.size)
            self._order_epoch = epoch
        return self._order

    def fingerprint(self) -> dict:
        """What a saved stream position is only valid with."""
        return stream_fingerprint(self)

    def check_position(self, pos: Position) -> None:
        if pos.epoch < 0 or not 0 <= pos.index < self.lengths.size:
            raise ConfigError(f"loader position {pos} is outside a dataset of {self.lengths.size} documents")
        doc = int(self.order(pos.epoch)[pos.index])
        if not 0 <= pos.offset < self.lengths[doc]:
            raise ConfigError(f"loader position {pos}: offset outside document {doc} of {self.lengths[doc]} tokens")

    position_type = Position

    def start(self) -> Position:
        """Where the stream begins."""
        return Position()

    def take(self, pos: Position) -> tuple[Sample, Position]:
        """The stream's next sample at ``pos``, and the position after it."""
        doc = int(self.order(pos.epoch)[pos.index])
        length = int(self.lengths[doc])
        end = min(pos.offset + self.context_length, length)
        if end < length:
            return Sample(doc, pos.offset, end), Position(pos.epoch, pos.index, end)
        if pos.index + 1 == self.lengths.size:
            return Sample(doc, pos.offset, end), Position(pos.epoch + 1, 0, 0)
        return Sample(doc, pos.offset, end), Position(pos.epoch, pos.index + 1, 0)

    def batch(self, pos: Position) -> tuple[tuple[Sample, ...], Position]:
        """The samples of the step that starts at ``pos``, and where the next step starts."""
        return cut_step(self.take, pos, self.step_tokens)


def stream_fingerprint(sampler) -> dict:
    """The settings and data a sampler's positions are only valid with."""
    return {
        "seed": sampler.seed,
        "step_tokens": sampler.step_tokens,
        "context_length": sampler.context_length,
        "num_documents": sampler.num_documents,
        "num_tokens": int(sampler.lengths.sum()),
    }


def cut_step(take, pos, step_tokens: int):
    """One step of a sample stream: samples in stream order while their total stays within
    ``step_tokens``; the sample that would overflow opens the next step (it is not taken)."""
    samples: list[Sample] = []
    total = 0
    while True:
        sample, after = take(pos)
        if samples and total + sample.length > step_tokens:
            return tuple(samples), pos
        samples.append(sample)
        total += sample.length
        pos = after


STATE_VERSION = 1
_FINGERPRINT_KEYS = ("seed", "step_tokens", "context_length", "num_documents", "num_tokens")


def loader_state(step: int, position: Position, fingerprint: dict) -> dict:
    """What a checkpoint stores: the next step and where its samples begin, plus what the
    position is only meaningful with (``GlobalBatchSampler.fingerprint()``)."""
    return {"version": STATE_VERSION, "step": int(step), "position": position.to_dict(), **fingerprint}


def restore_state(state: dict, fingerprint: dict, position_type=Position) -> tuple[int, Position]:
    """(step, position) from :func:`loader_state`, refused if the loader differs (every key of
    ``fingerprint``: a blend's adds its parts and weights)."""
    keys = (*_FINGERPRINT_KEYS, *(k for k in fingerprint if k not in _FINGERPRINT_KEYS))
    try:
        if state.get("version") != STATE_VERSION:
            raise ConfigError(f"data loader state version {state.get('version')!r}; this loader reads {STATE_VERSION}")
        step, position = int(state["step"]), position_type.from_dict(state["position"])
        saved = {k: state[k] for k in keys}
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ConfigError(
            f"malformed data loader state ({type(exc).__name__}: {exc}); pass what state_dict() returned"
        ) from None
    diff = [f"{k}: saved {saved[k]}, now {fingerprint[k]}" for k in keys if saved[k] != fingerprint[k]]
    if diff:
        raise ConfigError(
            "the data loader state was saved with a different dataset or settings (" + "; ".join(diff) + "); "
            "resume with the same --data, seed, step token budget and context length"
        )
    if step < 0:
        raise ConfigError(f"data loader state has a negative step {step}")
    return step, position
