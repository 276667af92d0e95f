"""``bytescale prepare-data``: write a Megatron indexed dataset (PREFIX.bin/.idx) from
source trees or text files, byte-level tokenized, one document per package / repository /
JSON line / file / line. The result feeds both our loaders and Megatron's ``pretrain_gpt.py``
(``--data-path PREFIX --tokenizer-type NullTokenizer --vocab-size 512``, the vocabulary it was
written for; see tokenizer.py)."""

from __future__ import annotations

import argparse
import shlex
import time

import numpy as np

from ..errors import ConfigError
from . import corpus
from .tokenizer import ByteTokenizer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--output", required=True, help="dataset prefix: writes PREFIX.bin, PREFIX.idx, PREFIX.bytescale.json"
    )
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--site-packages",
        nargs="?",
        const="",
        metavar="DIR",
        help="one document per installed distribution (default DIR: this interpreter's site-packages)",
    )
    src.add_argument("--repos", metavar="DIR", help="one document per subdirectory (repository) of DIR")
    src.add_argument("--jsonl", nargs="+", metavar="FILE", help="one document per JSON line (see --json-key)")
    src.add_argument("--text-files", nargs="+", metavar="FILE", help="one document per text file")
    src.add_argument("--text-lines", nargs="+", metavar="FILE", help="one document per non-empty line")
    parser.add_argument("--packages", nargs="+", metavar="NAME", help="with --site-packages: only these distributions")
    parser.add_argument("--json-key", default="text", help="JSON field holding the text (default: text)")
    parser.add_argument(
        "--vocab-size", type=int, default=512, help="tokenizer vocabulary (bytes + EOD + PAD fit in 258+)"
    )
    parser.add_argument(
        "--max-file-bytes",
        type=int,
        default=corpus.DEFAULT_MAX_FILE_BYTES,
        help="skip source files larger than this (generated data, not code)",
    )
    parser.add_argument("--quiet", action="store_true", help="print only the summary")


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


def main(args) -> int:
    summary = prepare(args)
    print(
        f"wrote {summary['prefix']}.bin/.idx: {summary['documents']:,} documents, {summary['tokens']:,} tokens "
        f"(document length min {summary['length_min']:,} / median {summary['length_median']:,} / "
        f"max {summary['length_max']:,}) in {summary['seconds']} s"
    )
    skipped = {k: summary[f"files_skipped_{k}"] for k in ("binary", "large", "not_utf8", "unreadable")}
    if summary["files_used"] or any(skipped.values()):
        print(
            f"files: {summary['files_used']:,} text files used, {skipped['binary']:,} binary, "
            f"{skipped['large']:,} over --max-file-bytes, {skipped['not_utf8']:,} not UTF-8 and "
            f"{skipped['unreadable']:,} unreadable skipped"
        )
    if summary["skipped_empty_documents"]:
        print(f"skipped {summary['skipped_empty_documents']:,} documents without text")
    # the vocabulary the dataset was written for (the loader refuses a smaller --vocab-size), and
    # the prefix quoted so the line can be pasted into a shell
    print(
        f"train with Megatron: pretrain_gpt.py --data-path {shlex.quote(str(summary['prefix']))} "
        f"--tokenizer-type NullTokenizer --vocab-size {args.vocab_size}"
    )
    return 0
