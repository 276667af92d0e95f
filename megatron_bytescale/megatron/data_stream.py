"""What determines an HDP run's training data stream, recorded with each checkpoint and compared
on resume, so a resume continues the stream exactly or is refused in one line.

The HDP loader's stream is a pure function of a few settings (``data/sampler.py``): the dataset
(which documents, how long), the seed (each epoch's order), the step token budget and the
sequence length (where steps and windows are cut). Megatron records none of them in a way it
compares on load, and replaying the stream to the checkpoint's iteration under other settings
trains some data twice and skips some. So after each save the ranks write
``bytescale-data-stream.json`` into the new ``iter_*`` folder, before its manifest (so the
manifest covers it): each field below by name, and the loader's position at that iteration.

On resume every field is compared by name (``differences``). Equal: the loader continues from
the recorded position (no replay of the iterations before it). Different: refused, naming each
field as saved and as now, unless ``--hdp-accept-data-change`` asks to go on deliberately:
then a stream in the same order (another step size or sequence length) continues from the
recorded position, so no document is trained twice or skipped in that epoch, and another order
(seed, dataset) starts its stream at the beginning. A checkpoint without a record (saved before
records existed, or by an async save) replays the stream to its iteration, as before, saying so.

The training stream's spec comes from ``data_config`` (blends, ``--split``, mock data, SFT):
``dataset`` is each part's content (not its path), ``blend`` the parts' weights, ``split`` the
range of each part's documents training takes. ``FIELDS`` is the list to extend when the stream
gains a parameter: a field's ``absent`` value is what a record written before the field existed
stands for.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .. import checkpoint_manifest
from ..data.indexed import content_digest, dataset_identity
from ..errors import ConfigError

RECORD = "bytescale-data-stream.json"
VERSION = 1
ACCEPT_FLAG = "--hdp-accept-data-change"


@dataclass(frozen=True)
class Field:
    name: str  # the record's key
    flag: str  # what a user changes to change it (named in the refusal)
    value: Callable  # Megatron's args -> a JSON value
    same_order: bool  # True: the documents' order does not depend on it (the saved position stays meaningful)
    absent: object = None  # what a record written before this field existed stands for


def _train_stream(args):
    """The training stream's spec (``data_config``: its parts, their weights and split ranges)."""
    from .data_config import data_config_from_args

    return data_config_from_args(args).train


def _content(kind: str, path: str | None, mock_lengths: str | None) -> dict:
    """What one part of the stream is, independent of where it lies."""
    if kind == "mock":  # synthetic documents: their length distribution and the seed make them
        return {"mock_lengths": mock_lengths or "default"}
    if kind == "sft":  # a JSONL file of conversations
        return {"jsonl_sample_sha256": content_digest(path)}
    return dataset_identity(path)


def _dataset(args) -> list | None:
    spec = _train_stream(args)
    return None if spec is None else [_content(spec.kind, p.path, spec.mock_lengths) for p in spec.parts]


def _blend(args) -> list | None:
    spec = _train_stream(args)
    return None if spec is None or len(spec.parts) == 1 else spec.weights


def _split(args) -> list | None:
    spec = _train_stream(args)
    return None if spec is None else [list(p.split) for p in spec.parts]


FIELDS = (
    Field("step_tokens", "--hdp-step-tokens", lambda a: int(a.hdp_step_tokens), same_order=True),
    Field("seq_length", "--seq-length", lambda a: int(a.seq_length), same_order=True),
    Field("seed", "--seed", lambda a: int(a.seed), same_order=False),
    Field("dataset", "--data-path", _dataset, same_order=False),
    Field("blend", "--data-path's weights", _blend, same_order=False),
    Field("split", "--split", _split, same_order=False),
)


def record(args) -> dict:
    """The fields of this run, by name."""
    return {f.name: f.value(args) for f in FIELDS}


def _said(field: Field, before, now) -> str:
    """How a difference reads: ``--seed 1234 then, 7 now``."""
    if field.name == "dataset":

        def short(value) -> str:
            if isinstance(value, list):
                return " + ".join(short(part) for part in value)
            if not isinstance(value, dict) or "index_sha256" not in value:
                return str(value)
            index, sample = str(value.get("index_sha256"))[:12], str(value.get("bin_sample_sha256"))[:12]
            return f"index sha256 {index}, .bin sample {sample}"

        return f"the dataset ({field.flag}) then {short(before)}, now {short(now)}"
    return f"{field.flag} {before} then, {now} now"


def differences(saved: dict, now: dict) -> list[tuple[Field, object, object]]:
    """(field, saved value, value now) of each field that differs."""
    out = []
    for f in FIELDS:
        before = saved.get(f.name, f.absent)
        if before != now[f.name]:
            out.append((f, before, now[f.name]))
    return out


def write(folder: Path, args, iteration: int, loader) -> None:
    """Rank 0, after Megatron's save of ``iteration`` into ``folder``: the record, atomically.
    ``loader``: the training loader (its position is written when it stands at ``iteration``)."""
    body = {"version": VERSION, "iteration": int(iteration), "fields": record(args)}
    if loader is not None and getattr(loader, "step", None) == iteration:
        body["position"] = loader.position.to_dict()
    checkpoint_manifest.write_atomically(Path(folder) / RECORD, json.dumps(body, indent=1).encode())


def read(folder: Path) -> dict | None:
    """The record in an ``iter_*`` folder, or None where there is none."""
    path = Path(folder) / RECORD
    try:
        body = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: unreadable ({exc}); the checkpoint is damaged, restore it from a copy") from None
    if not isinstance(body, dict) or body.get("version") != VERSION or not isinstance(body.get("fields"), dict):
        raise ConfigError(f"{path}: not a data-stream record this version reads; restore the checkpoint from a copy")
    return body


START = "start"  # ResumePoint.position: the stream's beginning (where a new loader stands)


@dataclass(frozen=True)
class ResumePoint:
    position: dict | str | None  # the recorded position (to_dict()), START, or None: replay to the iteration
    line: str | None  # what rank 0 prints about it


def resume_point(folder: Path, args, iteration: int) -> ResumePoint:
    """Where the training stream continues after loading ``iteration`` from ``folder`` (its
    ``iter_*`` folder), or ConfigError naming what differs from the checkpoint's record."""
    saved = read(folder)
    where = f"--load {args.load}: iteration {iteration}"
    if saved is None:
        return ResumePoint(
            None,
            f"bytescale: {where} holds no data-stream record (saved before records existed, or asynchronously): "
            "the stream is replayed to it under this run's settings",
        )
    position = saved.get("position")
    diff = differences(saved["fields"], record(args))
    if not diff:
        return ResumePoint(position, None)
    said = "; ".join(_said(f, before, now) for f, before, now in diff)
    if not getattr(args, "hdp_accept_data_change", False):
        raise _refusal(where, said)
    if all(f.same_order for f, _, _ in diff) and position is not None:
        return ResumePoint(
            position, f"bytescale: {where}: {said}; the stream continues where the checkpoint left it ({ACCEPT_FLAG})"
        )
    return ResumePoint(START, f"bytescale: {where}: {said}; the new stream starts at its beginning ({ACCEPT_FLAG})")


def _refusal(where: str, said: str) -> ConfigError:
    return ConfigError(
        f"{where} was trained on another data stream ({said}): resume with the settings it was saved with, "
        f"or pass {ACCEPT_FLAG} to continue on the new stream deliberately"
    )


def check_before_launch(args) -> None:
    """The launcher's early look (``megatron.preflight``): ConfigError when the iteration the
    tracker of ``--load`` names recorded another data stream than this command line's. The ranks
    check again the iteration they load (an older one when that one does not verify)."""
    from .checkpoint_guard import iteration_dir, tracker_iteration

    if (
        not getattr(args, "load", None)
        or getattr(args, "finetune", False)
        or getattr(args, "hdp_accept_data_change", False)
    ):
        return
    iteration = tracker_iteration(args.load)
    if iteration is None:
        return
    try:
        saved = read(iteration_dir(args.load, iteration))
    except ConfigError:  # damaged: the ranks step back to an iteration that verifies
        return
    if saved is None:
        return
    diff = differences(saved["fields"], record(args))
    if diff:
        said = "; ".join(_said(f, before, now) for f, before, now in diff)
        raise _refusal(f"--load {args.load}: iteration {iteration}", said)
