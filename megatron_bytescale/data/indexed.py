"""Megatron indexed datasets (``PREFIX.bin`` / ``PREFIX.idx``) of whole documents.

Written with megatron-core's ``IndexedDatasetBuilder`` and read with its ``IndexedDataset``,
so the files are exactly what Megatron's ``pretrain_gpt.py --data-path PREFIX`` reads.
Each source file of a document is one Megatron *sequence* (item) and the document ends with
``end_document()``, so document boundaries are kept; EOD is the last token of each document.
A small sidecar ``PREFIX.bytescale.json`` records the tokenizer and document names.

:class:`DocumentDataset` opens a dataset after checking everything that would otherwise be
an assertion deep inside megatron-core or silent garbage: both files present, the index
header, its size, the dtype, that the .bin matches the index byte for byte, no empty
documents, and that token ids fit the model's vocabulary. Document lengths come from the
index alone; :meth:`DocumentDataset.read` reads just the requested tokens.

The index says how long the .bin is, not what it holds: a .bin of another build with the same
byte size would pass every check above. So the sidecar records a digest of a fixed sample of
the .bin's bytes (``content_digest``: its size and 64 blocks of 4 KiB spread over it, about as
cheap to check as the header), and opening refuses a .bin whose sample differs.
``dataset_identity`` (the whole index's SHA-256 and the .bin's sample) is what a checkpoint
records of the data it was trained on.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import ConfigError
from .corpus import SourceDocument
from .tokenizer import ByteTokenizer

INDEX_MAGIC = b"MMIDIDX\x00\x00"  # megatron-core's _INDEX_HEADER
INDEX_HEADER_BYTES = 9 + 8 + 1 + 8 + 8  # magic, version, dtype code, sequence count, document count
SIDECAR_SUFFIX = ".bytescale.json"
PREPARE_HINT = "rebuild it (Megatron's tools/preprocess_data.py, or `bytescale prepare-data --output PREFIX ...`)"
SAMPLE_BLOCKS, SAMPLE_BLOCK_BYTES = 64, 4096


def dataset_prefix(path: str | Path) -> str:
    """Accept ``PREFIX``, ``PREFIX.bin`` or ``PREFIX.idx``."""
    text = str(path)
    for suffix in (".bin", ".idx"):
        if text.endswith(suffix):
            return text[: -len(suffix)]
    return text


def _paths(prefix: str) -> tuple[Path, Path, Path]:
    return Path(prefix + ".bin"), Path(prefix + ".idx"), Path(prefix + SIDECAR_SUFFIX)


@dataclass(frozen=True)
class DatasetInfo:
    prefix: str
    num_documents: int
    num_tokens: int
    skipped_empty: int
    max_token_id: int


# --------------------------------------------------------------------------- identity
def content_digest(path: str | Path) -> str:
    """SHA-256 of a file's size and ``SAMPLE_BLOCKS`` blocks of ``SAMPLE_BLOCK_BYTES`` at evenly
    spaced offsets (first and last included): another file of the same size differs here unless
    it agrees with this one in every sampled block."""
    h = hashlib.sha256()
    size = os.path.getsize(path)
    h.update(str(size).encode())
    with open(path, "rb") as f:
        span = max(0, size - SAMPLE_BLOCK_BYTES)
        for i in range(SAMPLE_BLOCKS):
            f.seek(span * i // (SAMPLE_BLOCKS - 1))
            h.update(f.read(SAMPLE_BLOCK_BYTES))
    return h.hexdigest()


_index_digests: dict[tuple, str] = {}


def _index_digest(path: Path) -> str:
    """SHA-256 of the whole index (remembered per size and modification time: it is read once per process)."""
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key not in _index_digests:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(8 << 20):
                h.update(chunk)
        _index_digests[key] = h.hexdigest()
    return _index_digests[key]


def dataset_identity(path: str | Path) -> dict:
    """What a dataset is, independent of where it lies: its index's SHA-256 and its .bin's
    ``content_digest``."""
    bin_path, idx_path, _ = _paths(dataset_prefix(path))
    return {"index_sha256": _index_digest(idx_path), "bin_sample_sha256": content_digest(bin_path)}


# --------------------------------------------------------------------------- writing
def write_indexed_dataset(
    prefix: str | Path,
    documents: Iterable[SourceDocument],
    tokenizer: ByteTokenizer | None = None,
    *,
    keep_names: bool = True,
    source: str = "",
    progress=None,
) -> DatasetInfo:
    """Tokenize ``documents`` and write ``PREFIX.bin/.idx`` (+ sidecar). Documents without
    content are skipped (counted in the result); files appear only once complete."""
    import torch
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    tok = tokenizer or ByteTokenizer()
    prefix = dataset_prefix(prefix)
    bin_path, idx_path, meta_path = _paths(prefix)
    if bin_path.parent and not bin_path.parent.exists():
        bin_path.parent.mkdir(parents=True, exist_ok=True)
    dtype = DType.optimal_dtype(tok.vocab_size)
    tmp_bin, tmp_idx = Path(f"{bin_path}.tmp{os.getpid()}"), Path(f"{idx_path}.tmp{os.getpid()}")
    builder = IndexedDatasetBuilder(str(tmp_bin), dtype=dtype)
    names, lengths, skipped, max_id = [], [], 0, -1
    eod = np.array([tok.eod], dtype=dtype)
    try:
        for doc in documents:
            pending, doc_tokens = None, 0
            for chunk in doc.chunks():
                ids = tok.encode(chunk)
                if ids.size == 0:
                    continue
                if pending is not None:
                    builder.add_item(torch.from_numpy(pending))
                pending = ids.astype(dtype)
                doc_tokens += ids.size
                max_id = max(max_id, int(ids.max()))
            if pending is None:
                skipped += 1
                continue
            builder.add_item(torch.from_numpy(np.concatenate([pending, eod])))
            builder.end_document()
            lengths.append(doc_tokens + 1)
            names.append(doc.name)
            if progress is not None:
                progress(doc.name, doc_tokens + 1)
        if not lengths:
            raise ConfigError(
                f"no document with text content found{f' in {source}' if source else ''}; "
                "point the source at text files (binary and empty files are skipped)"
            )
        builder.finalize(str(tmp_idx))
        max_id = max(max_id, tok.eod)
        sidecar = {
            "format": "megatron-indexed-dataset",
            "tokenizer": tok.to_dict(),
            "num_documents": len(lengths),
            "num_tokens": int(sum(lengths)),
            "max_token_id": max_id,
            "skipped_empty_documents": skipped,
            "source": source,
            "document_names": names if keep_names else None,
            "bin_sample_sha256": content_digest(tmp_bin),
        }
        os.replace(tmp_bin, bin_path)
        os.replace(tmp_idx, idx_path)
        meta_path.write_text(json.dumps(sidecar, indent=1))
    finally:
        builder.data_file.close()
        for tmp in (tmp_bin, tmp_idx):
            tmp.unlink(missing_ok=True)
    return DatasetInfo(prefix, len(lengths), int(sum(lengths)), skipped, max_id)


# --------------------------------------------------------------------------- checking
def _check_index(prefix: str) -> tuple[np.dtype, int, int]:
    """Validate header and size of PREFIX.idx before megatron-core asserts on it."""
    from megatron.core.datasets.indexed_dataset import DType

    bin_path, idx_path, _ = _paths(prefix)
    missing = [str(p) for p in (idx_path, bin_path) if not p.is_file()]
    if missing:
        raise ConfigError(
            f"indexed dataset {prefix!r}: missing {' and '.join(missing)}. Pass the common prefix of an existing "
            f"PREFIX.bin/PREFIX.idx pair (without the extension), or create one with "
            f"`bytescale prepare-data --output {prefix} --site-packages`"
        )
    size = idx_path.stat().st_size
    with idx_path.open("rb") as f:
        head = f.read(INDEX_HEADER_BYTES)
    if len(head) < INDEX_HEADER_BYTES or head[:9] != INDEX_MAGIC:
        raise ConfigError(f"{idx_path} is not a Megatron indexed-dataset index (bad or short header); {PREPARE_HINT}")
    version, code, n_seq, n_doc = struct.unpack("<QBQQ", head[9:])
    if version != 1:
        raise ConfigError(f"{idx_path}: index version {version}, megatron-core reads version 1; {PREPARE_HINT}")
    try:
        dtype = np.dtype(DType.dtype_from_code(code))
    except (ValueError, KeyError):
        raise ConfigError(
            f"{idx_path}: unknown token dtype code {code}; the index is corrupt, {PREPARE_HINT}"
        ) from None
    if dtype.kind not in "iu":
        raise ConfigError(
            f"{idx_path}: tokens are stored as {dtype}, not integers; token ids must be integers, {PREPARE_HINT}"
        )
    expected = INDEX_HEADER_BYTES + n_seq * (4 + 8) + n_doc * 8
    if size not in (expected, expected + n_seq):  # + n_seq: the multimodal variant's modes
        raise ConfigError(
            f"{idx_path}: {size} bytes, but its header describes {n_seq} sequences and {n_doc - 1} documents "
            f"({expected} bytes): the file is truncated or corrupt; {PREPARE_HINT}"
        )
    if n_doc < 1:
        raise ConfigError(f"{idx_path}: no document table; {PREPARE_HINT}")
    return dtype, n_seq, n_doc


# --------------------------------------------------------------------------- reading
class DocumentDataset:
    """Documents of an indexed dataset: lengths from the index, token ranges on demand.

    ``vocab_size``: the model's vocabulary; datasets whose ids do not fit are refused (from
    the sidecar when present, and on every read). ``allow_empty``: keep empty documents (length
    0; Megatron's ``tools/preprocess_data.py`` writes one for an empty text) for a caller that
    skips them (``documents.py``); otherwise they are refused. Pickles as its path (for Ray actors).
    """

    def __init__(self, path: str | Path, vocab_size: int | None = None, allow_empty: bool = False):
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        self.prefix = dataset_prefix(path)
        self.vocab_size = vocab_size
        bin_path, idx_path, meta_path = _paths(self.prefix)
        self.bin_path, self.idx_path = bin_path, idx_path
        dtype, n_seq, n_doc = _check_index(self.prefix)
        try:
            self._ds = IndexedDataset(self.prefix, multimodal=False, mmap=True)
        except (AssertionError, ValueError, OSError) as exc:
            raise ConfigError(f"{idx_path}: megatron-core cannot read it ({exc}); {PREPARE_HINT}") from None
        index = self._ds.index
        seq_lens = np.asarray(index.sequence_lengths, dtype=np.int64)
        doc_idx = np.asarray(index.document_indices, dtype=np.int64)
        self.dtype = dtype
        self.itemsize = dtype.itemsize
        if doc_idx[0] != 0 or doc_idx[-1] != n_seq or np.any(np.diff(doc_idx) < 0):
            raise ConfigError(
                f"{idx_path}: document table is not a non-decreasing cover of the sequences; {PREPARE_HINT}"
            )
        if np.any(seq_lens < 0):
            raise ConfigError(f"{idx_path}: negative sequence lengths; the index is corrupt, {PREPARE_HINT}")
        starts = np.zeros(n_seq + 1, dtype=np.int64)
        np.cumsum(seq_lens, out=starts[1:])
        pointers = np.asarray(index.sequence_pointers, dtype=np.int64)
        if not np.array_equal(pointers, starts[:-1] * self.itemsize):
            raise ConfigError(
                f"{idx_path}: sequence pointers are not contiguous in {bin_path.name}; only contiguous datasets "
                f"(as IndexedDatasetBuilder writes them) are supported, {PREPARE_HINT}"
            )
        bin_bytes = bin_path.stat().st_size
        if bin_bytes != starts[-1] * self.itemsize:
            raise ConfigError(
                f"{bin_path}: {bin_bytes} bytes, but {idx_path.name} describes {starts[-1]} tokens of {dtype} "
                f"({starts[-1] * self.itemsize} bytes): the .bin and .idx do not belong together or one is truncated; "
                f"{PREPARE_HINT}"
            )
        self.lengths = starts[doc_idx[1:]] - starts[doc_idx[:-1]]  # tokens per document
        self._first_seq = doc_idx[:-1]  # each document's first Megatron sequence (item)
        self.allow_empty = allow_empty
        empty = np.flatnonzero(self.lengths == 0)
        if empty.size and not allow_empty:
            raise ConfigError(
                f"{idx_path}: {empty.size} empty documents (first: document {int(empty[0])}); every document must "
                f"hold at least one token - {PREPARE_HINT} (it skips empty documents)"
            )
        self.meta = self._read_sidecar(meta_path)
        self.bytes_read = 0

    def _read_sidecar(self, meta_path: Path) -> dict:
        if not meta_path.is_file():
            return {}
        try:
            meta = json.loads(meta_path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{meta_path}: not valid JSON ({exc}); delete it or {PREPARE_HINT}") from None
        if meta.get("num_documents") != len(self.lengths) or meta.get("num_tokens") != int(self.lengths.sum()):
            raise ConfigError(
                f"{meta_path} describes {meta.get('num_documents')} documents / {meta.get('num_tokens')} tokens, "
                f"the index {len(self.lengths)} / {int(self.lengths.sum())}: the files come from different builds; "
                f"{PREPARE_HINT}"
            )
        # (a sidecar written before this digest existed has none: nothing to compare)
        if "bin_sample_sha256" in meta and content_digest(self.bin_path) != meta["bin_sample_sha256"]:
            raise ConfigError(
                f"{self.bin_path}: its content does not match {self.idx_path.name} (a sample of its bytes differs from "
                f"the one {meta_path.name} recorded when the dataset was built): the .bin comes from another build or "
                f"was overwritten; {PREPARE_HINT}"
            )
        if self.vocab_size is not None:
            tok_vocab = int(meta.get("tokenizer", {}).get("vocab_size", 0))
            max_id = int(meta.get("max_token_id", -1))
            if max_id >= self.vocab_size or tok_vocab > self.vocab_size:
                raise ConfigError(
                    f"{meta_path}: the dataset was tokenized for a vocabulary of {tok_vocab} (largest id {max_id}), "
                    f"but the model's vocab size is {self.vocab_size}; use --vocab-size >= {tok_vocab} or re-tokenize"
                )
        return meta

    # ------------------------------------------------------------------ queries
    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def document_names(self) -> list[str] | None:
        return self.meta.get("document_names")

    def read(self, doc_id: int, start: int, end: int) -> np.ndarray:
        """Tokens ``[start, end)`` of document ``doc_id``, read from the .bin alone."""
        if not 0 <= doc_id < len(self.lengths):
            raise ConfigError(f"{self.bin_path}: document {doc_id} does not exist ({len(self.lengths)} documents)")
        if not 0 <= start <= end <= self.lengths[doc_id]:
            raise ConfigError(
                f"{self.bin_path}: range [{start}, {end}) is outside document {doc_id} of {self.lengths[doc_id]} tokens"
            )
        count = end - start
        # A document's items are contiguous in the .bin (checked on open), so one read from
        # its first item covers any range of the document.
        ids = self._ds.get(int(self._first_seq[doc_id]), offset=int(start), length=int(count))
        self.bytes_read += count * self.itemsize
        if self.vocab_size is not None and count and int(ids.max()) >= self.vocab_size:
            raise ConfigError(
                f"{self.bin_path}: document {doc_id} holds token id {int(ids.max())}, outside the model's vocab size "
                f"{self.vocab_size}; the data was tokenized for a larger vocabulary - re-tokenize or raise --vocab-size"
            )
        return ids

    def __getstate__(self):
        return {"path": self.prefix, "vocab_size": self.vocab_size, "allow_empty": self.allow_empty}

    def __setstate__(self, state):
        self.__init__(state["path"], state["vocab_size"], state.get("allow_empty", False))
