"""Checkpoint files that survive a kill mid-write and refuse to load when corrupted.

A checkpoint is one file: a header line ``BYTESCALE-CHECKPOINT 1 sha256=<hex> bytes=<n>``, then
``torch.save``'s bytes. It is written to a temporary file in the same folder, fsynced, renamed
over its final name (atomic on POSIX) and the folder fsynced, so a reader sees either the whole
old state or the whole new one, never a prefix. The digest is checked before ``torch.load``:
zeroed or truncated bytes are reported, not trained on.

``newest_valid`` picks the newest file named exactly ``step_<N>.pt`` whose header, digest and
contents check out, and says which newer ones it skipped and why; other names (``step_4
(copy).pt``, ``notes.txt``, leftover temporaries) are not checkpoints and are ignored.
"""

from __future__ import annotations

import hashlib
import io
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .checkpoint_manifest import write_atomically
from .errors import ConfigError

MAGIC = b"BYTESCALE-CHECKPOINT 1"
NAME = re.compile(r"^step_(\d+)\.pt$")
_HEADER_MAX = 200


class CheckpointError(Exception):
    """A file is not a valid checkpoint; the message says why in a few words."""


def checkpoint_name(step: int) -> str:
    return f"step_{step}.pt"


def save(path: str | Path, state: Any) -> Path:
    """Write ``state`` atomically to ``path`` with a digest header."""
    import torch

    path = Path(path)
    buf = io.BytesIO()
    torch.save(state, buf)
    body = buf.getvalue()
    header = MAGIC + f" sha256={hashlib.sha256(body).hexdigest()} bytes={len(body)}\n".encode()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, header, body)
    except OSError as exc:  # a full disk, a read-only folder: the previous checkpoint is untouched
        raise ConfigError(
            f"cannot write checkpoint {path} ({exc.strerror or exc}); the previous checkpoint is intact: "
            "free space or make the folder writable, then run again to resume"
        ) from None
    return path


def load(path: str | Path) -> Any:
    """Read a checkpoint written by ``save``; ``CheckpointError`` when it is not one or is damaged."""
    import torch

    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise CheckpointError(f"cannot read it ({exc.strerror or exc})") from None
    if not data:
        raise CheckpointError("empty file (a write was interrupted)")
    end = data.find(b"\n", 0, _HEADER_MAX)
    header = data[:end] if end >= 0 else b""
    if not header.startswith(MAGIC + b" "):
        raise CheckpointError("no checkpoint header (not written by bytescale, or overwritten)")
    try:
        fields = dict(item.split("=", 1) for item in header[len(MAGIC) + 1 :].decode("ascii").split())
        digest, size = fields["sha256"], int(fields["bytes"])
    except (ValueError, KeyError, UnicodeDecodeError):
        raise CheckpointError("malformed checkpoint header") from None
    body = data[end + 1 :]
    if len(body) != size:
        raise CheckpointError(f"truncated: {len(body)} of {size} bytes")
    if hashlib.sha256(body).hexdigest() != digest:
        raise CheckpointError("checksum mismatch (the file is corrupted)")
    try:
        return torch.load(io.BytesIO(body), weights_only=False)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means "not loadable"
        raise CheckpointError(f"torch cannot load it ({type(exc).__name__})") from None


@dataclass
class Found:
    path: Path | None = None
    state: Any = None
    step: int = 0
    skipped: list[tuple[Path, str]] = field(default_factory=list)

    def report(self) -> list[str]:
        lines = [f"skipped {p.name}: {why}" for p, why in self.skipped]
        if self.path is not None:
            lines.append(f"resuming from {self.path} (step {self.step})")
        return lines


def candidates(folder: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of the files named like checkpoints, newest first."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := NAME.match(p.name)) and p.is_file()]
    return sorted(found, key=lambda t: t[0], reverse=True)


def newest_valid(folder: str | Path) -> Found:
    """The newest loadable checkpoint in ``folder`` (``path`` None when there is none)."""
    result = Found()
    for step, path in candidates(folder):
        try:
            state = load(path)
        except CheckpointError as exc:
            result.skipped.append((path, str(exc)))
            continue
        if not isinstance(state, dict) or state.get("step") != step:
            got = state.get("step") if isinstance(state, dict) else type(state).__name__
            result.skipped.append((path, f"holds step {got}, not {step}"))
            continue
        result.path, result.state, result.step = path, state, step
        break
    return result
