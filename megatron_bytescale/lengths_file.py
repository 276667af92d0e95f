"""Sequence-length files: one positive integer (a token count) per line.

The one reader behind ``plan``, ``simulate`` and ``verify``'s ``--lengths-file``: blank lines
and ``#`` comments are skipped; a file that is not UTF-8, a line that is not a whole number
(quoted by a short prefix only: a bad line may be megabytes), a length that is not positive
or beyond any context (2^40 tokens) is a one-line ``ConfigError`` naming file and line.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path

from .errors import ConfigError, excerpt

MAX_LENGTH = 1 << 40
_MAX_DIGITS = len(str(MAX_LENGTH))


def _open_lengths_file(path: str | Path):
    """``path`` opened for reading in binary mode, a failure to open it as a one-line error. The
    open file is handed back to the caller, which closes it (``with``); only the open itself is
    guarded here, not the reading."""
    try:
        return open(path, "rb")
    except FileNotFoundError:
        raise ConfigError(f"lengths file {path}: no such file") from None
    except OSError as exc:
        raise ConfigError(f"lengths file {path}: cannot read it ({exc.strerror or exc})") from None


def iter_lengths_file(path: str | Path, progress: Callable[[int], None] | None = None) -> Iterator[int]:
    """The lengths of ``path`` one at a time, read line by line (a file of millions of lengths is
    never held whole); ``progress(n)`` is told the bytes of each line read."""
    f = _open_lengths_file(path)
    offset, found = 0, False
    with f:
        for number, raw in enumerate(f, start=1):
            if progress is not None:
                progress(len(raw))
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ConfigError(
                    f"lengths file {path}: not UTF-8 text (byte {offset + exc.start}); "
                    "write one positive token length per line"
                ) from None
            offset += len(raw)
            body = line.split("#", 1)[0].strip()
            if not body:
                continue
            if not re.fullmatch(r"[+-]?[0-9]+", body):
                raise ConfigError(
                    f"lengths file {path}, line {number}: {excerpt(body)} is not a whole number; "
                    "write one positive token length per line"
                )
            if len(body.lstrip("+-")) > _MAX_DIGITS or int(body) > MAX_LENGTH:
                raise ConfigError(
                    f"lengths file {path}, line {number}: length {excerpt(body)} exceeds {MAX_LENGTH:,} tokens; "
                    "write token counts, one per line"
                )
            value = int(body)
            if value <= 0:
                raise ConfigError(f"lengths file {path}, line {number}: length {value} must be positive")
            found = True
            yield value
    if not found:
        raise ConfigError(f"lengths file {path}: holds no lengths; write one positive token length per line")


def read_lengths_file(path: str | Path) -> list[int]:
    return list(iter_lengths_file(path))
