"""Weighted blends of document sources, as Megatron's ``--data-path W1 P1 W2 P2 ...`` means them.

Megatron's weights are shares of fixed-length samples, that is of tokens. Under HDP a step takes
whole documents (cut at the context length), so the blend is kept on **tokens**: the stream
interleaves the parts' samples, always taking the next sample from the part furthest behind its
share of the tokens taken so far (the token analogue of Megatron's blending index,
``build_blending_indices``, which does the same over fixed-length samples). Steps cut that one
stream by the token budget (``sampler.cut_step``), so a step's composition follows from the
stream and the stream does not depend on the step size.

How closely. Let ``T`` be the tokens taken so far, ``T_j`` part j's and ``d_j = w_j T - T_j``
its deficit. The part taken has ``d_j >= 0`` (deficits sum to 0) and a sample holds at most
``L`` (the context length) tokens, so every deficit stays in ``[-L, (k - 1) L]`` for ``k``
parts. Over a run each part's token share is therefore within ``(k - 1) L / T`` of its weight;
a single step's share of part j differs from ``w_j`` times the step's tokens by at most
``k L`` tokens (measured figures: docs/cluster.md, "Blends").

Each part keeps its own epochs and shuffle (a :class:`~.sampler.GlobalBatchSampler` over the
part's documents, seeded from ``(seed, part)``); the stream's whole state is
:class:`BlendPosition`: each part's position and its tokens taken, saved with the loader state.
Document ids of the samples are global: part j's documents follow those of parts ``0..j-1``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError
from .sampler import GlobalBatchSampler, Position, Sample, cut_step, stream_fingerprint


def part_seed(seed: int, part: int) -> int:
    """Part ``part``'s shuffle seed: independent of the other parts' (two parts of the same size
    would otherwise visit their documents in the same order)."""
    return int(np.random.SeedSequence([seed, part]).generate_state(1)[0])


@dataclass(frozen=True)
class BlendPosition:
    parts: tuple[Position, ...]
    taken: tuple[int, ...]  # tokens taken from each part since the stream began

    def to_dict(self) -> dict:
        return {"parts": [p.to_dict() for p in self.parts], "taken": [int(t) for t in self.taken]}

    @classmethod
    def from_dict(cls, data: dict) -> BlendPosition:
        return cls(tuple(Position.from_dict(p) for p in data["parts"]), tuple(int(t) for t in data["taken"]))


class BlendSampler:
    """Global batches from several parts (a blend), each part's token share following its weight.

    ``part_lengths[j]``: the document lengths of part j; ``weights``: one per part (normalised
    here), or None for Megatron's default: each part in proportion to its size (its tokens).
    Same interface as :class:`~.sampler.GlobalBatchSampler`."""

    position_type = BlendPosition

    def __init__(
        self,
        part_lengths: Sequence[Sequence[int]],
        weights: Sequence[float] | None,
        *,
        step_tokens: int,
        context_length: int,
        seed: int = 0,
    ):
        self.parts = [
            GlobalBatchSampler(lengths, step_tokens=step_tokens, context_length=context_length, seed=part_seed(seed, j))
            for j, lengths in enumerate(part_lengths)
        ]
        if len(self.parts) < 2:
            raise ConfigError("a blend needs at least two parts (one part: use GlobalBatchSampler)")
        raw = [float(p.lengths.sum()) for p in self.parts] if weights is None else [float(w) for w in weights]
        if len(raw) != len(self.parts) or any(not np.isfinite(w) or w <= 0 for w in raw):
            raise ConfigError(f"blend weights {list(weights or [])}: give one positive weight per dataset")
        total = sum(raw)
        self.weights = tuple(w / total for w in raw)
        self.lengths = np.concatenate([p.lengths for p in self.parts])
        self.offsets = np.cumsum([0] + [p.num_documents for p in self.parts])
        self.step_tokens, self.context_length, self.seed = int(step_tokens), int(context_length), int(seed)

    @property
    def num_documents(self) -> int:
        return int(self.lengths.size)

    def start(self) -> BlendPosition:
        return BlendPosition(tuple(p.start() for p in self.parts), (0,) * len(self.parts))

    def next_part(self, taken: Sequence[int]) -> int:
        """The part furthest behind its share of the tokens taken (the first such on ties)."""
        total = sum(taken)
        deficits = [w * total - t for w, t in zip(self.weights, taken)]
        return int(np.argmax(deficits))

    def take(self, pos: BlendPosition) -> tuple[Sample, BlendPosition]:
        j = self.next_part(pos.taken)
        sample, after = self.parts[j].take(pos.parts[j])
        offset = int(self.offsets[j])
        parts = pos.parts[:j] + (after,) + pos.parts[j + 1 :]
        taken = pos.taken[:j] + (pos.taken[j] + sample.length,) + pos.taken[j + 1 :]
        return Sample(sample.doc_id + offset, sample.start, sample.end), BlendPosition(parts, taken)

    def batch(self, pos: BlendPosition) -> tuple[tuple[Sample, ...], BlendPosition]:
        return cut_step(self.take, pos, self.step_tokens)

    def part_of(self, doc_id: int) -> int:
        """Which part a (global) document id belongs to."""
        return int(np.searchsorted(self.offsets, doc_id, side="right")) - 1

    def fingerprint(self) -> dict:
        return {
            **stream_fingerprint(self),
            "blend_weights": [round(w, 12) for w in self.weights],
            "blend_documents": [p.num_documents for p in self.parts],
        }

    def check_position(self, pos: BlendPosition) -> None:
        if len(pos.parts) != len(self.parts) or len(pos.taken) != len(self.parts):
            raise ConfigError(f"loader position has {len(pos.parts)} parts, the blend {len(self.parts)}")
        for part, p in zip(self.parts, pos.parts):
            part.check_position(p)


def make_sampler(part_lengths: Sequence[Sequence[int]], weights, *, step_tokens: int, context_length: int, seed: int):
    """One part: the plain :class:`~.sampler.GlobalBatchSampler` (the stream of a single dataset,
    unchanged); several: a :class:`BlendSampler`."""
    if len(part_lengths) == 1:
        return GlobalBatchSampler(part_lengths[0], step_tokens=step_tokens, context_length=context_length, seed=seed)
    return BlendSampler(part_lengths, weights, step_tokens=step_tokens, context_length=context_length, seed=seed)


# ------------------------------------------------------------------ Megatron's syntax
def blend_from_list(words, flag: str) -> tuple[list[str], list[float] | None] | None:
    """Megatron's ``get_blend_from_list``: an even list whose odd entries all read as numbers is
    ``W1 P1 W2 P2 ...``; anything else is a list of prefixes without weights."""
    if words is None:
        return None
    if isinstance(words, str):
        words = words.split()
    words = [str(w) for w in words]
    if not words:
        raise ConfigError(f"{flag}: give at least one dataset")
    if len(words) % 2 == 0:
        try:
            weights = [float(w) for w in words[0::2]]
        except ValueError:
            weights = None
        if weights is not None:
            prefixes = [p.strip() for p in words[1::2]]
            if any(w <= 0 for w in weights):
                raise ConfigError(f"{flag} {' '.join(words)}: blend weights must be positive")
            return prefixes, weights
    return [p.strip() for p in words], None


def parse_split(text: str) -> list[float]:
    """Megatron's ``parse_and_normalize_split``: ``"969,30,1"`` -> normalised train/valid/test shares."""
    values = [float(v) for v in re.findall(r"[.0-9]+", text)]
    values = values + [0.0] * (3 - len(values))
    if len(values) != 3 or sum(values) <= 0 or any(v < 0 for v in values):
        raise ConfigError(f"--split {text!r}: give up to three non-negative shares, e.g. --split 969,30,1")
    total = sum(values)
    return [v / total for v in values]


def split_matrix(shares: list[float]) -> list[tuple[float, float] | None]:
    """Megatron's ``convert_split_vector_to_split_matrix`` for one vector: each split's
    ``[begin, end)`` fraction of a dataset, None where its share is 0."""
    bounds = [0.0]
    for share in shares:
        bounds.append(bounds[-1] + share)
    return [(bounds[i], bounds[i + 1]) if bounds[i] != bounds[i + 1] else None for i in range(3)]
