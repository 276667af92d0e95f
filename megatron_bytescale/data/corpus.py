"""Repository-level documents from source trees on this machine (no network, deterministic).

A *document* is a name plus its content as a stream of byte chunks. For a source tree the
document is one whole package or repository: its text files concatenated in sorted path
order, each preceded by a header line ``==> relative/path <==`` (the convention of ``head``
on several files). Document lengths then vary as real code does: from a few hundred bytes
(a one-module package) to tens of millions (torch).

Sources:
* :func:`site_packages_documents` - one document per installed distribution, its files
  taken from the distribution's own RECORD (``importlib.metadata``);
* :func:`repository_documents` - one document per immediate subdirectory of a folder of
  repositories (and one per top-level text file);
* :func:`jsonl_documents` / :func:`text_file_documents` / :func:`text_line_documents` -
  documents a user already has (one per JSON line / file / text line).

A file counts as text when it has no NUL byte and decodes as UTF-8; larger files than
``max_file_bytes`` are skipped (generated data, not code). Hidden directories and
``__pycache__`` are skipped. Order is sorted everywhere, so the same tree gives the same
documents byte for byte.
"""

from __future__ import annotations

import importlib.metadata as metadata
import json
import os
import sysconfig
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError

DEFAULT_MAX_FILE_BYTES = 4 << 20
SKIP_DIRS = {"__pycache__", "node_modules"}


@dataclass(frozen=True)
class SourceDocument:
    name: str
    chunks: Callable[[], Iterator[bytes]]  # called once, when the document is written


@dataclass
class CorpusStats:
    """What a source yielded; filled while its documents are consumed."""

    files_used: int = 0
    files_skipped_binary: int = 0
    files_skipped_large: int = 0
    files_skipped_not_utf8: int = 0  # text in another encoding (Latin-1, ...): not binary, not ours to guess
    files_skipped_unreadable: int = 0  # permissions, I/O errors
    skipped_examples: list[str] = field(default_factory=list)

    def note_skip(self, path: str, large: bool = False, why: str = "binary") -> None:
        if large:
            self.files_skipped_large += 1
        elif why == "not-utf8":
            self.files_skipped_not_utf8 += 1
        elif why == "unreadable":
            self.files_skipped_unreadable += 1
        else:
            self.files_skipped_binary += 1
        if len(self.skipped_examples) < 5:
            self.skipped_examples.append(path)


def read_text_file(path: Path, max_file_bytes: int, stats: CorpusStats | None = None) -> bytes | None:
    """The file's bytes if it is a text file within the size limit, else None."""
    try:
        if not path.is_file() or path.is_symlink():
            return None
        if path.stat().st_size > max_file_bytes:
            if stats:
                stats.note_skip(str(path), large=True)
            return None
        data = path.read_bytes()
    except OSError:
        if stats:
            stats.note_skip(str(path), why="unreadable")
        return None
    if b"\x00" in data:
        if stats:
            stats.note_skip(str(path), large=False)
        return None
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        if stats:
            stats.note_skip(str(path), why="not-utf8")
        return None
    if stats:
        stats.files_used += 1
    return data


def _file_chunks(files: list[tuple[str, Path]], max_file_bytes: int, stats: CorpusStats) -> Iterator[bytes]:
    for rel, path in files:
        data = read_text_file(path, max_file_bytes, stats)
        if data is not None:
            yield f"==> {rel} <==\n".encode() + data + (b"" if data.endswith(b"\n") else b"\n")


def _walk_sorted(root: Path) -> list[tuple[str, Path]]:
    found = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in SKIP_DIRS)
        for name in sorted(filenames):
            path = Path(dirpath) / name
            found.append((path.relative_to(root).as_posix(), path))
    return sorted(found)


def default_site_packages() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def site_packages_documents(
    site_dir: str | Path | None = None,
    packages: Iterable[str] | None = None,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    stats: CorpusStats | None = None,
) -> list[SourceDocument]:
    """One document per distribution installed in ``site_dir`` (default: this interpreter's).

    ``packages`` keeps only the named distributions (names compare case- and
    punctuation-insensitively, as pip does); an unknown name is an error.
    """
    site = Path(site_dir) if site_dir is not None else default_site_packages()
    if not site.is_dir():
        raise ConfigError(f"site-packages directory {site} does not exist; pass an existing directory")
    stats = stats if stats is not None else CorpusStats()
    root = site.resolve()
    dists = {}
    for dist in metadata.distributions(path=[str(site)]):
        name = dist.metadata["Name"] or ""
        key = _canonical(name)
        if key and dist.files is not None and key not in dists:
            dists[key] = dist
    if packages is not None:
        wanted = {_canonical(p): p for p in packages}
        missing = sorted(p for k, p in wanted.items() if k not in dists)
        if missing:
            raise ConfigError(
                f"no installed distribution named {', '.join(missing)} in {site}; "
                f"choose among: {', '.join(sorted(dists))[:400]}"
            )
        dists = {k: d for k, d in dists.items() if k in wanted}
    if not dists:
        raise ConfigError(f"{site} holds no installed distributions (no *.dist-info with a RECORD)")

    documents = []
    for key in sorted(dists):
        dist = dists[key]
        files = []
        for f in dist.files:
            rel = f.as_posix()
            if rel.endswith(".dist-info/RECORD") or "__pycache__" in rel:
                continue
            path = Path(os.path.normpath(root / rel))
            if path == root or root not in path.parents:
                continue  # scripts installed outside site-packages (../../bin)
            files.append((rel, path))
        files.sort()
        documents.append(
            SourceDocument(
                name=f"{dist.metadata['Name']}=={dist.version}",
                chunks=lambda files=files: _file_chunks(files, max_file_bytes, stats),
            )
        )
    return documents


def repository_documents(
    root: str | Path, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES, stats: CorpusStats | None = None
) -> list[SourceDocument]:
    """One document per immediate subdirectory of ``root`` (a folder of repositories), plus
    one per top-level text file."""
    base = Path(root)
    if not base.is_dir():
        raise ConfigError(f"{base} is not a directory; pass a folder whose subdirectories are repositories")
    stats = stats if stats is not None else CorpusStats()
    documents = []
    for entry in sorted(base.iterdir()):
        if entry.name.startswith(".") or entry.name in SKIP_DIRS or entry.is_symlink():
            continue
        if entry.is_dir():
            files = [(f"{entry.name}/{rel}", path) for rel, path in _walk_sorted(entry)]
        elif entry.is_file():
            files = [(entry.name, entry)]
        else:
            continue
        documents.append(
            SourceDocument(name=entry.name, chunks=lambda files=files: _file_chunks(files, max_file_bytes, stats))
        )
    return documents


def jsonl_documents(paths: Iterable[str | Path], key: str = "text") -> Iterator[SourceDocument]:
    """One document per line of each JSON-lines file: the string under ``key``."""
    for path in paths:
        path = Path(path)
        _require_file(path)
        with path.open("rb") as stream:
            for lineno, line in enumerate(stream, 1):
                if not line.strip():
                    continue
                try:
                    line.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise ConfigError(
                        f"{path}:{lineno}: not UTF-8 text (byte {exc.start} of the line); JSON lines must be UTF-8, "
                        "convert the file (e.g. iconv -f latin1 -t utf-8)"
                    ) from None
                try:
                    record = json.loads(line)
                    text = record[key]
                except (json.JSONDecodeError, KeyError, TypeError) as exc:
                    raise ConfigError(
                        f"{path}:{lineno}: not a JSON object with a string {key!r} field ({type(exc).__name__}: "
                        f"{exc}); "
                        f"fix the line or pass --json-key with the field that holds the text"
                    ) from None
                if not isinstance(text, str):
                    raise ConfigError(f"{path}:{lineno}: field {key!r} is {type(text).__name__}, not a string")
                data = text.encode("utf-8")
                yield SourceDocument(name=f"{path.name}:{lineno}", chunks=lambda data=data: iter((data,)))


def text_file_documents(
    paths: Iterable[str | Path], max_file_bytes: int = DEFAULT_MAX_FILE_BYTES, stats: CorpusStats | None = None
) -> list[SourceDocument]:
    """One document per text file."""
    stats = stats if stats is not None else CorpusStats()
    docs = []
    for path in paths:
        path = Path(path)
        _require_file(path)
        docs.append(SourceDocument(name=path.name, chunks=lambda path=path: _whole_file(path, max_file_bytes, stats)))
    return docs


def text_line_documents(paths: Iterable[str | Path]) -> Iterator[SourceDocument]:
    """One document per non-empty line of each UTF-8 text file (the newline is dropped)."""
    for path in paths:
        path = Path(path)
        _require_file(path)
        with path.open("rb") as stream:
            for lineno, line in enumerate(stream, 1):
                line = line.rstrip(b"\r\n")
                if not line:
                    continue
                try:
                    line.decode("utf-8")
                except UnicodeDecodeError:
                    raise ConfigError(f"{path}:{lineno}: not UTF-8 text; convert the file to UTF-8") from None
                yield SourceDocument(name=f"{path.name}:{lineno}", chunks=lambda line=line: iter((line,)))


def _whole_file(path: Path, max_file_bytes: int, stats: CorpusStats) -> Iterator[bytes]:
    data = read_text_file(path, max_file_bytes, stats)
    if data is not None:
        yield data


def _require_file(path: Path) -> None:
    if not path.is_file():
        raise ConfigError(f"input file {path} does not exist; check the path")


def _canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")
