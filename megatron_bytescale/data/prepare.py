"""``bytescale prepare-data``: write a Megatron indexed dataset (PREFIX.bin/.idx) from
source trees or text files, byte-level tokenized, one document per package / repository /
JSON line / file / line. The result feeds both our loaders and Megatron's ``pretrain_gpt.py``
(``--data-path PREFIX --tokenizer-type NullTokenizer --vocab-size 512``, the vocabulary it was
written for; see tokenizer.py)."""

from __future__ import annotations

import time

import numpy as np

from ..errors import ConfigError
from . import corpus
from .tokenizer import ByteTokenizer


def documents_from_args(args, stats: corpus.CorpusStats):
    """(documents, description of the source, keep document names?)"""
    if args.max_file_bytes <= 0:
        raise ConfigError(
            f"--max-file-bytes {args.max_file_bytes}: give the largest file size to read, in bytes (e.g. 4194304)"
        )
    if args.vocab_size <= 0:
        raise ConfigError(f"--vocab-size {args.vocab_size}: must be positive (bytes + EOD + PAD need at least 258)")
    if args.packages and args.site_packages is None:
        raise ConfigError("--packages only applies to --site-packages")
    if args.site_packages is not None:
        site = args.site_packages or corpus.default_site_packages()
        docs = corpus.site_packages_documents(site, args.packages, args.max_file_bytes, stats)
        return docs, f"site-packages {site}", True
    if args.repos:
        return (
            corpus.repository_documents(args.repos, args.max_file_bytes, stats),
            f"repositories in {args.repos}",
            True,
        )
    if args.jsonl:
        return corpus.jsonl_documents(args.jsonl, args.json_key), f"JSON lines {' '.join(args.jsonl)}", False
    if args.text_files:
        return corpus.text_file_documents(args.text_files, args.max_file_bytes, stats), "text files", True
    return corpus.text_line_documents(args.text_lines), f"text lines {' '.join(args.text_lines)}", False


def prepare(args) -> dict:
    from .indexed import DocumentDataset, write_indexed_dataset

    stats = corpus.CorpusStats()
    docs, source, keep_names = documents_from_args(args, stats)
    tokenizer = ByteTokenizer(vocab_size=args.vocab_size)
    t0 = time.perf_counter()
    progress = None if args.quiet else (lambda name, n: print(f"  {name}: {n:,} tokens", flush=True))
    info = write_indexed_dataset(args.output, docs, tokenizer, keep_names=keep_names, source=source, progress=progress)
    seconds = time.perf_counter() - t0
    lengths = DocumentDataset(info.prefix, vocab_size=args.vocab_size).lengths
    return {
        "prefix": info.prefix,
        "documents": info.num_documents,
        "tokens": info.num_tokens,
        "skipped_empty_documents": info.skipped_empty,
        "length_min": int(lengths.min()),
        "length_median": int(np.median(lengths)),
        "length_max": int(lengths.max()),
        "files_used": stats.files_used,
        "files_skipped_binary": stats.files_skipped_binary,
        "files_skipped_large": stats.files_skipped_large,
        "files_skipped_not_utf8": stats.files_skipped_not_utf8,
        "files_skipped_unreadable": stats.files_skipped_unreadable,
        "seconds": round(seconds, 2),
    }
