"""Sequence-length workloads: synthetic Byted-like / GitHub-like mixes and length files.

A global batch is a list of sequence lengths holding exactly ``total_tokens`` tokens: lengths
are drawn one after another, each cut to the context, until the batch is full; the last one
is cut so the batch holds exactly ``total_tokens`` (every strategy then sees the same
number of tokens).

The synthetic mixes live in ``configs/workloads/<name>.yaml`` as segments: within
``[lo, hi]`` the length density is proportional to ``s^-alpha`` (``lo == hi``: a point
mass), and ``token_share`` is the share of all tokens the segment holds. A segment's share
of *samples* follows as ``token_share / mean`` (normalised), so the files state the design
design's token statistics directly. Each file also lists the design's statistics as
``targets``; ``check_targets`` measures them on a drawn batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import BytescaleError, ConfigError
from ..planner.specs import CONFIG_DIR, _resolve, load_mapping
from ..units import parse_size

WORKLOAD_DIR = CONFIG_DIR / "workloads"

Rng = np.random.Generator | int | None


def as_rng(rng: Rng) -> np.random.Generator:
    return rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)


@dataclass(frozen=True)
class Segment:
    lo: int
    hi: int
    alpha: float
    token_share: float

    def mean(self) -> float:
        """Mean length of the segment's density ``~ s^-alpha`` on ``[lo, hi]``."""
        if self.lo == self.hi:
            return float(self.lo)
        return _moment(self.lo, self.hi, 1 - self.alpha) / _moment(self.lo, self.hi, -self.alpha)

    def draw(self, u: np.ndarray) -> np.ndarray:
        """Inverse CDF of the segment at uniform ``u`` in [0, 1)."""
        lo, hi, a = float(self.lo), float(self.hi), self.alpha
        if lo == hi:
            return np.full(u.shape, lo)
        if abs(a - 1.0) < 1e-12:
            return lo * (hi / lo) ** u
        e = 1.0 - a
        return (lo**e + u * (hi**e - lo**e)) ** (1.0 / e)


def _moment(lo: float, hi: float, k: float) -> float:
    """Integral of s^k over [lo, hi]."""
    if abs(k + 1) < 1e-12:
        return math.log(hi / lo)
    return (hi ** (k + 1) - lo ** (k + 1)) / (k + 1)


@dataclass(frozen=True)
class Target:
    """One statistic the design states: the share of samples or tokens in a length range."""

    kind: str  # "samples" | "tokens"
    value: float
    tol: float
    min: int | None = None  # s >= min
    above: int | None = None  # s > above
    max: int | None = None  # s <= max

    def describe(self) -> str:
        parts = []
        if self.min is not None:
            parts.append(f">= {self.min}")
        if self.above is not None:
            parts.append(f"> {self.above}")
        if self.max is not None:
            parts.append(f"<= {self.max}")
        return f"share of {self.kind} with length {' and '.join(parts)}"

    def measure(self, lengths: np.ndarray) -> float:
        mask = np.ones(lengths.shape, dtype=bool)
        if self.min is not None:
            mask &= lengths >= self.min
        if self.above is not None:
            mask &= lengths > self.above
        if self.max is not None:
            mask &= lengths <= self.max
        if self.kind == "samples":
            return float(mask.mean())
        return float(lengths[mask].sum() / lengths.sum())


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    segments: tuple[Segment, ...]
    targets: tuple[Target, ...]

    @property
    def sample_shares(self) -> np.ndarray:
        weights = np.array([s.token_share / s.mean() for s in self.segments])
        return weights / weights.sum()

    @property
    def mean_length(self) -> float:
        return float(np.dot(self.sample_shares, [s.mean() for s in self.segments]))

    def draw(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """``n`` lengths (int64, not cut to any context)."""
        which = rng.choice(len(self.segments), size=n, p=self.sample_shares)
        u = rng.random(n)
        out = np.empty(n)
        for k, seg in enumerate(self.segments):
            sel = which == k
            out[sel] = seg.draw(u[sel])
        return np.clip(np.rint(out), 1, None).astype(np.int64)

    @classmethod
    def load(cls, name_or_path: str) -> Workload:
        path = _resolve(name_or_path, WORKLOAD_DIR, ".yaml", "dataset")
        data = load_mapping(path)
        where = f"workload {path}"
        try:
            segments = tuple(
                Segment(
                    lo=parse_size(seg["lo"], "segment lo"),
                    hi=parse_size(seg["hi"], "segment hi"),
                    alpha=float(seg.get("alpha", 1.0)),
                    token_share=float(seg["token_share"]),
                )
                for seg in data["segments"]
            )
            targets = tuple(
                Target(
                    kind=str(t["kind"]),
                    value=float(t["value"]),
                    tol=float(t["tol"]),
                    **{k: parse_size(t[k], k) for k in ("min", "above", "max") if k in t},
                )
                for t in data.get("targets", [])
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(
                f"{where}: malformed ({type(exc).__name__}: {exc}); see configs/workloads/byted.yaml"
            ) from None
        if not segments:
            raise ConfigError(f"{where}: no segments")
        for seg in segments:
            if seg.lo > seg.hi or seg.token_share <= 0:
                raise ConfigError(f"{where}: segment {seg} needs lo <= hi and a positive token_share")
        total = sum(s.token_share for s in segments)
        if abs(total - 1.0) > 1e-3:
            raise ConfigError(f"{where}: token shares sum to {total:.4f}; they must sum to 1")
        for t in targets:
            if t.kind not in ("samples", "tokens"):
                raise ConfigError(f"{where}: target kind {t.kind!r}; use 'samples' or 'tokens'")
        return cls(
            name=str(data.get("name", path.stem)),
            description=str(data.get("description", "")),
            segments=segments,
            targets=targets,
        )


LOGNORMAL = "lognormal"
# Megatron's dynamic-CP benchmark draws its mock lengths so (examples/dynamic_context_parallel,
# VARLEN_DATASET_JSON: min 128, max 8192, mean 1024, sigma 1.5)
LOGNORMAL_DEFAULTS = {"mean": 1024, "sigma": 1.5, "min": 128, "max": 8192}


@dataclass(frozen=True)
class LogNormal:
    """Lengths ``exp(N(mu, sigma))`` with ``mu = ln(mean) - sigma^2 / 2`` (so the mean before
    clipping is ``mean``), clipped to ``[min, max]`` and truncated to integers: the draw of
    Megatron's mock variable-length datasets (``generate_lognormal_samples``)."""

    mean: float = LOGNORMAL_DEFAULTS["mean"]
    sigma: float = LOGNORMAL_DEFAULTS["sigma"]
    min: int = LOGNORMAL_DEFAULTS["min"]
    max: int = LOGNORMAL_DEFAULTS["max"]

    @property
    def name(self) -> str:
        return f"{LOGNORMAL}:mean={self.mean:g},sigma={self.sigma:g},min={self.min},max={self.max}"

    def draw(self, n: int, rng: np.random.Generator) -> np.ndarray:
        mu = math.log(self.mean) - self.sigma**2 / 2
        return np.clip(rng.lognormal(mu, self.sigma, n), self.min, self.max).astype(np.int64)

    @property
    def mean_length(self) -> float:
        return float(self.draw(20000, np.random.default_rng(0)).mean())

    @classmethod
    def parse(cls, spec: str) -> LogNormal:
        """``lognormal`` or ``lognormal:mean=1K,sigma=1.5,min=128,max=8K`` (any of the four)."""
        _, _, rest = spec.partition(":")
        values: dict = dict(LOGNORMAL_DEFAULTS)
        for item in filter(None, (part.strip() for part in rest.split(","))):
            key, sep, value = item.partition("=")
            if not sep or key not in values:
                raise ConfigError(
                    f"{spec!r}: write lognormal:KEY=VALUE,... with keys {', '.join(LOGNORMAL_DEFAULTS)} "
                    f"(e.g. {LOGNORMAL}:mean=1K,sigma=1.5,min=128,max=8K)"
                )
            values[key] = float(value) if key == "sigma" else parse_size(value, f"lognormal {key}")
        if not (0 < values["min"] <= values["max"]) or values["mean"] <= 0 or values["sigma"] <= 0:
            raise ConfigError(f"{spec!r}: needs 0 < min <= max, a positive mean and a positive sigma")
        return cls(**values)


def length_distribution(spec: str) -> Workload | LogNormal:
    """A named length distribution: ``byted``, ``github`` (or a workload YAML) or ``lognormal[:...]``;
    each has ``draw(n, rng)`` and ``mean_length``."""
    if spec == LOGNORMAL or spec.startswith(LOGNORMAL + ":"):
        return LogNormal.parse(spec)
    return Workload.load(spec)


def check_targets(workload: Workload, lengths) -> list[tuple[Target, float, bool]]:
    """(target, measured value, within tolerance) for each of the workload's statistics."""
    arr = np.asarray(lengths, dtype=np.int64)
    return [(t, m, abs(m - t.value) <= t.tol) for t in workload.targets for m in [t.measure(arr)]]


def fill_batch(draw: Callable[[int], np.ndarray], total_tokens: int, context: int, mean_hint: float) -> list[int]:
    """Draw lengths (cut to ``context``) until they hold ``total_tokens``; the last is cut to fit."""
    if total_tokens <= 0 or context <= 0:
        raise BytescaleError(f"a batch needs positive total tokens and context, got {total_tokens}, {context}")
    out: list[np.ndarray] = []
    have = 0
    while have < total_tokens:
        n = int((total_tokens - have) / max(1.0, mean_hint) * 1.1) + 16
        chunk = np.minimum(draw(n), context)
        csum = have + np.cumsum(chunk)
        full = int(np.searchsorted(csum, total_tokens))  # first index reaching the total
        if full < len(chunk):
            chunk = chunk[: full + 1].copy()
            chunk[-1] -= int(csum[full]) - total_tokens
            out.append(chunk)
            have = total_tokens
        else:
            out.append(chunk)
            have = int(csum[-1])
    return [int(s) for s in np.concatenate(out)]


def sample_lengths(dataset: str, total_tokens: int, context: int, rng: Rng = None) -> list[int]:
    """One global batch of sequence lengths from a named workload (``byted``, ``github``, a path
    to a workload YAML, or ``lognormal[:...]``, an SFT-like mix): drawn until the batch holds
    exactly ``total_tokens``, each cut to ``context``."""
    workload = length_distribution(dataset)
    gen = as_rng(rng)
    return fill_batch(lambda n: workload.draw(n, gen), total_tokens, context, workload.mean_length)


def read_lengths_file(path: str | Path) -> np.ndarray:
    """Token lengths, one positive integer per line (blank lines and ``#`` comments skipped)."""
    from ..lengths_file import read_lengths_file as read

    return np.array(read(path), dtype=np.int64)


def lengths_from_file(lengths: np.ndarray, total_tokens: int, context: int, rng: Rng = None) -> list[int]:
    """One global batch resampled (uniformly, with replacement) from a file's lengths
    (``read_lengths_file``), drawn until it holds exactly ``total_tokens``, each cut to ``context``."""
    gen = as_rng(rng)
    pool = np.asarray(lengths, dtype=np.int64)
    return fill_batch(
        lambda n: pool[gen.integers(0, len(pool), n)], total_tokens, context, float(np.minimum(pool, context).mean())
    )


def training_batches(data_path, step_tokens: int, context: int, seed: int):
    """The sequence lengths of the global batches training on ``data_path`` would see, step by
    step (the HDP loaders' sampler: documents in the seeded epoch order, cut at ``context``,
    ``step_tokens`` per step), and a description of the data. ``data_path``: a prefix, or
    Megatron's blend syntax (``W1 P1 W2 P2 ...`` as a list or one string: the blend's stream,
    each prefix whole; training with --data-path also holds back --split's validation and test
    shares)."""
    from .blend import blend_from_list, make_sampler
    from .indexed import DocumentDataset

    prefixes, weights = blend_from_list(data_path, "--data-path")
    parts = [DocumentDataset(p, allow_empty=True).lengths for p in prefixes]
    parts = [lengths[lengths > 0] for lengths in parts]  # as training skips empty documents
    sampler = make_sampler(parts, weights, step_tokens=step_tokens, context_length=context, seed=seed)
    lengths = np.concatenate(parts)
    info = {
        "prefix": " + ".join(prefixes)
        if weights is None
        else " + ".join(f"{w:g} x {p}" for p, w in zip(prefixes, weights)),
        "documents": int(lengths.size),
        "tokens": int(lengths.sum()),
        "longest_document": int(lengths.max()),
        "documents_over_context": int((lengths > context).sum()),
    }

    def steps():
        position = sampler.start()
        while True:
            samples, position = sampler.batch(position)
            yield [s.length for s in samples]

    return steps(), info
