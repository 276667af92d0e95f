"""Token and byte counts written the way people write them: 8K, 2M, 32M (binary: K = 1024)."""

import argparse
import math

from .errors import BytescaleError, excerpt

_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str | int, what: str = "size") -> int:
    """Parse ``'8K'`` -> 8192, ``'2M'`` -> 2097152, ``'1.5K'`` -> 1536, ``4096`` -> 4096."""
    if isinstance(text, int):
        value = text
    else:
        s = str(text).strip().upper()
        if s.endswith("B"):
            s = s[:-1]
        suffix = s[-1:] if s[-1:] in _SUFFIX and s[-1:] else ""
        number = s[: len(s) - len(suffix)]
        try:
            value = float(number) * _SUFFIX[suffix] if len(number) <= 40 else math.nan
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value > 2**62:
            raise BytescaleError(
                f"cannot read {what} {excerpt(text)}: write a finite number with an optional K/M/G suffix, e.g. 8K or "
                "2M"
            )
        if value != int(value):
            raise BytescaleError(f"{what} {excerpt(text)} is not a whole number of tokens/bytes")
        value = int(value)
    if value <= 0:
        raise BytescaleError(f"{what} must be positive, got {excerpt(text)}")
    return value


def format_size(n: float) -> str:
    """Inverse of parse_size for display: 8192 -> '8K', 3000 -> '2.9K'."""
    for suffix in ("T", "G", "M", "K"):
        unit = _SUFFIX[suffix]
        if abs(n) >= unit:
            q = n / unit
            return f"{q:.0f}{suffix}" if q == int(q) else f"{q:.1f}{suffix}"
    return f"{n:.0f}"


MAX_SEED = 2**32 - 1  # numpy's legacy seeding and most generators take 32 bits


def seed(text: str) -> int:
    """argparse type: a random seed, a whole number in [0, 2**32 - 1] (numpy refuses negative seeds)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {excerpt(text)}") from None
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"a seed is a whole number from 0 to {MAX_SEED}, got {value}")
    return value
