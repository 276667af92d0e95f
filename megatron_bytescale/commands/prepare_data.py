"""``bytescale prepare-data``: write a Megatron indexed dataset (PREFIX.bin/.idx) from source
trees or text files (``data/prepare.py`` writes it; this parses the flags and prints the summary)."""

from __future__ import annotations

import argparse
import shlex

from ..data.corpus import DEFAULT_MAX_FILE_BYTES


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
        default=DEFAULT_MAX_FILE_BYTES,
        help="skip source files larger than this (generated data, not code)",
    )
    parser.add_argument("--quiet", action="store_true", help="print only the summary")


def main(args) -> int:
    from ..data.prepare import prepare

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
