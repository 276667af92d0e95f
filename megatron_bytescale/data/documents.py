"""What a training stream reads: one split's documents, from indexed datasets, mock data or SFT
conversations, possibly blended, and the spec that names them.

A :class:`StreamSpec` is what Megatron's data flags say about one split (train, valid or test):
its parts (a dataset prefix or JSONL file, a weight, the range of the source's elements that
``--split`` gives it) and the kind of source. :func:`open_stream` opens it as
:class:`StreamDocuments` (document lengths over all parts, token reads) and builds its sampler
(``blend.make_sampler``). Sources:

* an indexed dataset (``indexed.DocumentDataset``): elements are documents; empty documents
  (``tools/preprocess_data.py`` writes one for an empty text) are skipped;
* :class:`MockDocuments` (``--mock-data``): lengths drawn from a named distribution
  (``workloads.length_distribution``: ``byted``, ``github``, ``lognormal[:...]``) and cut to the
  context, tokens computed from the seed, nothing read;
* :class:`SFTDocuments` (``--sft``): Megatron's JSONL of ``messages``, each conversation one
  document, tokenized by Megatron's SFT tokenizer; the prompt tokens' labels are out of the loss
  (``label_mask``). Elements are the file's lines, as for Megatron's ``SFTDataset``.

Split ranges follow Megatron (``_build_megatron_dataset_splits``): elements
``[round(a * n), round(b * n))`` of a source of ``n`` elements, so the splits are disjoint.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..errors import ConfigError

KINDS = ("indexed", "mock", "sft")
SPLITS = ("train", "valid", "test")
MOCK_DOCUMENTS = 100_000  # documents per mock stream (Megatron's MockGPTLowLevelDataset.size)
IGNORE_INDEX = -100  # Megatron's SFT target of a token out of the loss


@dataclass(frozen=True)
class Part:
    """One source of a stream: ``path`` (a dataset prefix or JSONL file; None for mock data), its
    weight in the blend (None: Megatron's default, in proportion to its size) and the range of
    its elements this split takes (a row of Megatron's split matrix)."""

    path: str | None
    weight: float | None = None
    split: tuple[float, float] = (0.0, 1.0)


@dataclass(frozen=True)
class StreamSpec:
    name: str  # "train" | "valid" | "test"
    parts: tuple[Part, ...]
    kind: str = "indexed"  # "indexed" | "mock" | "sft"
    mock_lengths: str | None = None  # the mock length distribution

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ConfigError(f"unknown data kind {self.kind!r}; one of {', '.join(KINDS)}")
        if not self.parts:
            raise ConfigError(f"the {self.name} stream has no dataset")

    @property
    def weights(self) -> list[float] | None:
        given = [p.weight for p in self.parts]
        return None if any(w is None for w in given) else given

    def record(self) -> dict:
        """What determines this stream, as named fields (for a checkpoint's record)."""
        return {
            "kind": self.kind,
            "parts": [asdict(p) for p in self.parts],
            **({"mock_lengths": self.mock_lengths} if self.kind == "mock" else {}),
        }


def split_range(split: tuple[float, float], n: int) -> tuple[int, int]:
    """Elements of a source of ``n`` a split matrix row takes (Megatron's rounding)."""
    return int(round(split[0] * float(n))), int(round(split[1] * float(n)))


# --------------------------------------------------------------------------- sources
class MockDocuments:
    """``count`` synthetic documents: lengths from ``distribution`` (cut to ``context_length``),
    drawn from ``(seed, stream)``; document d's tokens an arithmetic progression modulo the
    vocabulary from ``(seed, stream, d)``, ending with EOD (a pattern a model can learn, as in
    Megatron's MockGPTLowLevelDataset). Every rank computes the same documents; nothing is read."""

    def __init__(
        self, distribution: str, *, count: int, context_length: int, seed: int, vocab_size: int, eod: int, stream=0
    ):
        from .workloads import length_distribution

        if vocab_size < 3 or not 0 <= eod < vocab_size:
            raise ConfigError(f"mock data needs a vocabulary of at least 3 ids holding EOD {eod}, got {vocab_size}")
        self.distribution = distribution
        self.seed, self.stream, self.vocab_size, self.eod = int(seed), int(stream), int(vocab_size), int(eod)
        drawn = length_distribution(distribution).draw(count, np.random.default_rng([self.seed, self.stream]))
        self.lengths = np.clip(drawn, 2, context_length).astype(np.int64)
        self.bytes_read = 0

    def __len__(self) -> int:
        return int(self.lengths.size)

    def read(self, doc_id: int, start: int, end: int) -> np.ndarray:
        length = int(self.lengths[doc_id])
        if not 0 <= start <= end <= length:
            raise ConfigError(f"mock document {doc_id}: range [{start}, {end}) outside its {length} tokens")
        first, step = np.random.default_rng([self.seed, self.stream, doc_id]).integers(0, self.vocab_size - 1, 2)
        ids = (int(first) + np.arange(start, end, dtype=np.int64) * (int(step) + 1)) % (self.vocab_size - 1)
        ids += ids >= self.eod  # every id but EOD
        if end == length:
            ids[-1] = self.eod
        return ids


def split_conversations(messages: list[dict]) -> list[list[dict]]:
    """One JSONL line's messages as conversations: a system message starts a new one (Megatron's
    ``SFTDataset._split_conversations``)."""
    out, current = [], []
    for message in messages:
        if message.get("role") == "system" and current:
            out.append(current)
            current = []
        current.append(message)
    if current:
        out.append(current)
    return out


class SFTDocuments:
    """The conversations of a JSONL file of ``{"messages": [...]}`` lines, each one document.

    ``tokenize(conversation) -> (tokens, targets)`` is Megatron's
    ``tokenizer.tokenize_conversation(conversation, return_target=True, add_generation_prompt=False)``;
    a target of ``IGNORE_INDEX`` (a system, user or tool token) or of ``pad_id`` is out of the
    loss, as in Megatron's ``SFTDataset``. ``append_eod``: end each conversation with ``eod``
    where it does not (core_v0.16.1's SFTDataset does; core_v0.19's does not). A conversation
    longer than ``context_length`` keeps its first ``context_length`` tokens (Megatron truncates
    a pack on the right)."""

    def __init__(
        self,
        path: str,
        tokenize: Callable,
        *,
        context_length: int,
        pad_id: int | None,
        eod: int | None = None,
        append_eod: bool = False,
    ):
        self.path = str(path)
        tokens, answer, lengths, line_starts = [], [], [], [0]
        try:
            lines = Path(self.path).read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise ConfigError(f"--sft data {self.path}: {exc.strerror or exc}") from None
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                messages = json.loads(line)["messages"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise ConfigError(
                    f"{self.path}:{number}: not a JSON object with a 'messages' list ({type(exc).__name__}: {exc}); "
                    'each line must be {"messages": [{"role": ..., "content": ...}, ...]}'
                ) from None
            for conversation in split_conversations(messages):
                ids, targets = tokenize(conversation)
                ids, targets = np.asarray(ids, dtype=np.int64), np.asarray(targets, dtype=np.int64)
                if append_eod and eod is not None and (ids.size == 0 or ids[-1] != eod):
                    ids, targets = np.append(ids, eod), np.append(targets, eod)
                keep = targets != IGNORE_INDEX
                if pad_id is not None:
                    keep &= targets != pad_id
                n = min(ids.size, context_length)
                if n < 1:
                    continue
                tokens.append(ids[:n])
                answer.append(keep[:n].astype(np.float32))
                lengths.append(n)
            line_starts.append(len(lengths))
        if not lengths:
            raise ConfigError(f"--sft data {self.path}: no conversation in it")
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self._starts = np.concatenate([[0], np.cumsum(self.lengths)])
        self._tokens, self._answer = np.concatenate(tokens), np.concatenate(answer)
        self._line_starts = np.asarray(line_starts, dtype=np.int64)  # conversations of line i: [s_i, s_i+1)
        self.bytes_read = 0

    @property
    def num_elements(self) -> int:
        return int(self._line_starts.size - 1)

    def element_documents(self, begin: int, end: int) -> np.ndarray:
        """The conversations of lines ``[begin, end)`` (the elements a split takes)."""
        return np.arange(self._line_starts[begin], self._line_starts[end], dtype=np.int64)

    def _range(self, doc_id: int, start: int, end: int) -> slice:
        if not 0 <= start <= end <= self.lengths[doc_id]:
            raise ConfigError(f"{self.path}: range [{start}, {end}) outside conversation {doc_id}")
        base = int(self._starts[doc_id])
        return slice(base + start, base + end)

    def read(self, doc_id: int, start: int, end: int) -> np.ndarray:
        return self._tokens[self._range(doc_id, start, end)]

    def label_mask(self, doc_id: int, start: int, end: int) -> np.ndarray:
        """1.0 where the token at that position is an answer token (a label in the loss)."""
        return self._answer[self._range(doc_id, start, end)]


def element_documents(source, begin: int, end: int) -> np.ndarray:
    """The documents of a source's elements ``[begin, end)``, empty ones left out."""
    if hasattr(source, "element_documents"):
        ids = source.element_documents(begin, end)
    else:
        ids = np.arange(begin, end, dtype=np.int64)
    return ids[source.lengths[ids] > 0]


def num_elements(source) -> int:
    return int(getattr(source, "num_elements", len(source.lengths)))


# --------------------------------------------------------------------------- a stream
class StreamDocuments:
    """The documents of a stream's parts under one id space: part j's documents follow parts
    ``0..j-1``'s (as ``blend.BlendSampler`` numbers them). Reads go to the part's source."""

    def __init__(self, spec: StreamSpec, sources: Sequence, doc_ids: Sequence[np.ndarray]):
        self.spec = spec
        self.sources, self.doc_ids = list(sources), [np.asarray(d, dtype=np.int64) for d in doc_ids]
        self.part_lengths = [s.lengths[d] for s, d in zip(self.sources, self.doc_ids)]
        self.lengths = np.concatenate(self.part_lengths)
        self.offsets = np.cumsum([0] + [d.size for d in self.doc_ids])
        self.has_label_mask = any(hasattr(s, "label_mask") for s in self.sources)

    def _locate(self, doc_id: int):
        j = int(np.searchsorted(self.offsets, doc_id, side="right")) - 1
        return self.sources[j], int(self.doc_ids[j][doc_id - self.offsets[j]])

    def read(self, doc_id: int, start: int, end: int) -> np.ndarray:
        source, doc = self._locate(doc_id)
        return source.read(doc, start, end)

    def label_mask(self, doc_id: int, start: int, end: int) -> np.ndarray:
        source, doc = self._locate(doc_id)
        if hasattr(source, "label_mask"):
            return source.label_mask(doc, start, end)
        return np.ones(end - start, dtype=np.float32)

    @property
    def bytes_read(self) -> int:
        return sum(getattr(s, "bytes_read", 0) for s in self.sources)

    def sampler(self, *, step_tokens: int, context_length: int, seed: int):
        from .blend import make_sampler

        return make_sampler(
            self.part_lengths, self.spec.weights, step_tokens=step_tokens, context_length=context_length, seed=seed
        )


def open_source(spec: StreamSpec, part: Part, *, vocab_size=None, context_length: int, seed: int, sft=None, mock=None):
    """One part's source. ``sft``: keyword arguments of :class:`SFTDocuments` but the path
    (``tokenize``, ``pad_id``, ``eod``, ``append_eod``); ``mock``: ``vocab_size`` and ``eod`` of
    the mock tokens."""
    if spec.kind == "mock":
        return MockDocuments(
            spec.mock_lengths or "lognormal",
            count=MOCK_DOCUMENTS,
            context_length=context_length,
            seed=seed,
            stream=SPLITS.index(spec.name) if spec.name in SPLITS else 0,
            **(mock or {}),
        )
    if spec.kind == "sft":
        if sft is None:
            raise ConfigError("--sft data needs Megatron's SFT tokenizer (tokenize_conversation)")
        return SFTDocuments(part.path, context_length=context_length, **sft)
    from .indexed import DocumentDataset

    return DocumentDataset(part.path, vocab_size=vocab_size, allow_empty=True)


def open_stream(spec: StreamSpec, *, context_length: int, seed: int, **source_kwargs) -> StreamDocuments:
    """The stream's documents: each part's source, cut to its split range, empty documents out."""
    sources, doc_ids = [], []
    for part in spec.parts:
        source = open_source(spec, part, context_length=context_length, seed=seed, **source_kwargs)
        begin, end = split_range(part.split, num_elements(source))
        ids = element_documents(source, begin, end)
        if ids.size == 0:
            where = part.path or "the mock data"
            raise ConfigError(
                f"{spec.name} data {where}: its split [{part.split[0]:g}, {part.split[1]:g}) holds no documents "
                f"(elements {begin}-{end} of {num_elements(source)}); change --split or give the {spec.name} "
                "split its own dataset"
            )
        sources.append(source)
        doc_ids.append(ids)
    return StreamDocuments(spec, sources, doc_ids)


def jsonl_path(path: str) -> bool:
    return Path(path).suffix in (".jsonl", ".json")
