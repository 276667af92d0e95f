"""Megatron's data flags as one object: what each split (train, valid, test) of an HDP run reads.

:func:`data_config_from_args` reads ``--data-path`` / ``--data-args-path`` (one blend for every
split, cut by ``--split``), ``--train-data-path`` / ``--valid-data-path`` / ``--test-data-path`` /
``--per-split-data-args-path`` (a blend per split), ``--mock-data`` and ``--sft``, with the
precedence of Megatron's ``get_blend_and_blend_per_split`` and the blend syntax of its
``get_blend_from_list`` (``W1 P1 W2 P2 ...`` or ``P1 P2 ...``; tests compare both with Megatron's
own functions). :class:`DataConfig` holds the result, with the seed, the step token budget and
the context length: everything that determines the data stream, as named fields
(:meth:`DataConfig.record`), for a checkpoint's record of it.

No torch and no Megatron import: the launcher's checks (``preflight``) build the same object.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..data.blend import blend_from_list, parse_split, split_matrix
from ..data.documents import SPLITS, Part, StreamSpec
from ..errors import ConfigError

LEGACY_SPLIT = "969, 30, 1"  # what Megatron's validate_args sets with --data-path and no --split


@dataclass(frozen=True)
class DataConfig:
    """What every split of the run reads (None: that split has no data), and what the stream
    depends on besides: seed, step token budget, context length."""

    train: StreamSpec | None
    valid: StreamSpec | None
    test: StreamSpec | None
    split: str | None  # --split as it applied (with --data-path or --mock-data), None with per-split paths
    seed: int
    step_tokens: int | None
    context_length: int | None

    def stream(self, name: str) -> StreamSpec | None:
        return getattr(self, name)

    def paths(self) -> list[tuple[str, str]]:
        """(flag, path) of every file a split reads (none for mock data)."""
        out = []
        for name in SPLITS:
            spec = self.stream(name)
            if spec is not None and spec.kind != "mock":
                out += [(f"{name} data", part.path) for part in spec.parts]
        return list(dict.fromkeys(out))

    def record(self) -> dict:
        """Everything that determines the data streams, as named fields."""
        return {
            "seed": self.seed,
            "step_tokens": self.step_tokens,
            "context_length": self.context_length,
            "split": self.split,
            **{name: (spec.record() if spec is not None else None) for name in SPLITS for spec in [self.stream(name)]},
        }


def _read_text(path: str, flag: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: {exc.strerror or exc}") from None


def _blends(args):
    """(one blend for all splits, or None; a blend per split, or None), as Megatron's
    ``get_blend_and_blend_per_split`` picks them."""
    data_path, data_args = getattr(args, "data_path", None), getattr(args, "data_args_path", None)
    if data_path is not None or data_args is not None:
        if data_args is not None:
            if data_path is not None:
                raise ConfigError("--data-path and --data-args-path: give one of them")
            return blend_from_list(_read_text(data_args, "--data-args-path").split(), "--data-args-path"), None
        return blend_from_list(data_path, "--data-path"), None
    per_split = [getattr(args, f"{name}_data_path", None) for name in SPLITS]
    per_split_args = getattr(args, "per_split_data_args_path", None)
    if per_split_args is not None:
        try:
            table = json.loads(_read_text(per_split_args, "--per-split-data-args-path"))
            per_split = [table[name] for name in SPLITS]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ConfigError(
                f"--per-split-data-args-path {per_split_args}: a JSON object with train, valid and test lists of "
                f"weights and prefixes ({type(exc).__name__}: {exc})"
            ) from None
        return None, [blend_from_list(p, f"--per-split-data-args-path {name}") for p, name in zip(per_split, SPLITS)]
    if any(p is not None for p in per_split):
        return None, [blend_from_list(p, f"--{name}-data-path") for p, name in zip(per_split, SPLITS)]
    return None, None


def data_config_from_args(args) -> DataConfig:
    """The run's :class:`DataConfig` from Megatron's flags (before or after Megatron's validate_args)."""
    seed = int(getattr(args, "seed", 1234))
    step_tokens, context = getattr(args, "hdp_step_tokens", None), getattr(args, "seq_length", None)
    kind = "sft" if getattr(args, "sft", False) else "indexed"
    if getattr(args, "mock_data", False):
        split = getattr(args, "split", None) or LEGACY_SPLIT
        rows = split_matrix(parse_split(split))
        mock = getattr(args, "hdp_mock_lengths", None)
        streams = [
            StreamSpec(name, (Part(None),), kind="mock", mock_lengths=mock) if row is not None else None
            for name, row in zip(SPLITS, rows)
        ]
        return DataConfig(*streams, split=split, seed=seed, step_tokens=step_tokens, context_length=context)
    blend, per_split = _blends(args)
    if blend is not None:
        split = getattr(args, "split", None) or LEGACY_SPLIT
        prefixes, weights = blend
        streams = [
            StreamSpec(
                name,
                tuple(Part(p, None if weights is None else w, row) for p, w in zip(prefixes, weights or prefixes)),
                kind=kind,
            )
            if row is not None
            else None
            for name, row in zip(SPLITS, split_matrix(parse_split(split)))
        ]
        return DataConfig(*streams, split=split, seed=seed, step_tokens=step_tokens, context_length=context)
    if per_split is not None:
        streams = [
            None
            if b is None
            else StreamSpec(name, tuple(Part(p, None if b[1] is None else w) for p, w in zip(b[0], b[1] or b[0])), kind)
            for name, b in zip(SPLITS, per_split)
        ]
        return DataConfig(*streams, split=None, seed=seed, step_tokens=step_tokens, context_length=context)
    return DataConfig(None, None, None, split=None, seed=seed, step_tokens=step_tokens, context_length=context)
