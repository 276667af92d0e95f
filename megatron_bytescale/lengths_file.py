"""Sequence-length files: one positive integer (a token count) per line.

The one reader behind ``plan``, ``simulate`` and ``verify``'s ``--lengths-file``: blank lines
and ``#`` comments are skipped; a file that is not UTF-8, a line that is not a whole number
(quoted by a short prefix only: a bad line may be megabytes), a length that is not positive
or beyond any context (2^40 tokens) is a one-line ``ConfigError`` naming file and line.
"""

from __future__ import annotations

import re
from pathlib import Path

from .errors import ConfigError, excerpt

MAX_LENGTH = 1 << 40
_MAX_DIGITS = len(str(MAX_LENGTH))


def read_lengths_file(path: str | Path) -> list[int]:
    try:
        text = Path(path).read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(f"lengths file {path}: no such file") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"lengths file {path}: not UTF-8 text (byte {exc.start}); write one positive token length per line"
        ) from None
    except OSError as exc:
        raise ConfigError(f"lengths file {path}: cannot read it ({exc.strerror or exc})") from None
    lengths = []
    for number, line in enumerate(text.splitlines(), start=1):
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
        lengths.append(value)
    if not lengths:
        raise ConfigError(f"lengths file {path}: holds no lengths; write one positive token length per line")
    return lengths
