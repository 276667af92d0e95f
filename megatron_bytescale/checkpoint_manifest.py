"""A manifest of a checkpoint folder: each file's size and SHA-256, written last and atomically.

A folder with a manifest that verifies holds exactly the bytes that were saved; one without a
manifest was not finished (or predates manifests); one whose files differ from it was truncated,
overwritten or corrupted. Megatron's checkpoints (``iter_NNNNNNN/``: ``*.distcp`` shards,
``.metadata``, ``common.pt``, or ``mp_rank_*/model_optim_rng.pt``) are folders of many files
written by many ranks, so hashing is split: ``share`` gives each of N workers every N-th file,
and whoever gathers the digests writes the manifest.

Why SHA-256 and not a cheaper checksum: with the CPU's SHA extensions it runs at 1.3 GB/s per
core here, against 2.0 GB/s for zlib's CRC-32 (measured on 256 MiB), so the cheaper sum saves
little, while the ranks hash in parallel and the files are still in the page cache right after
a save; and SHA-256 is what the demo's checkpoints use (checkpoint_io.py).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

MANIFEST = "bytescale-manifest.json"
VERSION = 1
NO_MANIFEST = "no manifest (its save, or the manifest after it, was interrupted)"
_CHUNK = 8 << 20


def files_of(folder: str | Path) -> list[str]:
    """Every file under ``folder`` (relative POSIX paths, sorted), the manifest itself excluded."""
    folder = Path(folder)
    out = []
    for root, _dirs, names in os.walk(folder):
        for name in names:
            rel = (Path(root) / name).relative_to(folder).as_posix()
            if rel != MANIFEST and not name.startswith(f".{MANIFEST}"):
                out.append(rel)
    return sorted(out)


def share(files: list[str], index: int, count: int) -> list[str]:
    """The files worker ``index`` of ``count`` hashes."""
    return files[index::count]


def digest(path: str | Path) -> dict:
    """{"bytes": size, "sha256": hex} of one file."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return {"bytes": size, "sha256": h.hexdigest()}


def digests(folder: str | Path, files: list[str]) -> dict[str, dict]:
    return {rel: digest(Path(folder) / rel) for rel in files}


def write_atomically(path: str | Path, *chunks: bytes) -> Path:
    """Write ``chunks`` (one after the other) to ``path`` so a reader sees the old file or the new one, never a prefix:
    a temporary file in the same folder, fsynced, renamed over ``path``, then the folder fsynced."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return path


def write(folder: str | Path, entries: dict[str, dict]) -> Path:
    """Write the manifest of ``folder`` atomically."""
    body = json.dumps({"version": VERSION, "files": dict(sorted(entries.items()))}, indent=1)
    return write_atomically(Path(folder) / MANIFEST, body.encode())


def read(folder: str | Path) -> dict[str, dict] | None:
    """The manifest's entries; None when there is none; ValueError when it is unreadable."""
    path = Path(folder) / MANIFEST
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ValueError(f"manifest unreadable ({exc})") from None
    if not isinstance(data, dict) or data.get("version") != VERSION or not isinstance(data.get("files"), dict):
        raise ValueError("manifest malformed")
    return data["files"]


def check_sizes(folder: str | Path, entries: dict[str, dict]) -> str | None:
    """Why the files in ``folder`` do not match the manifest's list and sizes (cheap: no reading), or None."""
    folder = Path(folder)
    for rel, entry in entries.items():
        try:
            size = (folder / rel).stat().st_size
        except FileNotFoundError:
            return f"{rel} is missing"
        if size != entry["bytes"]:
            return f"{rel} is truncated or overwritten: {size} of {entry['bytes']} bytes"
    extra = sorted(set(files_of(folder)) - set(entries))
    if extra:
        return f"{extra[0]} is not in the manifest (written by another run?)"
    return None


def check_digests(folder: str | Path, entries: dict[str, dict], files: list[str]) -> str | None:
    """Why one of ``files`` does not match its SHA-256 in the manifest, or None."""
    for rel in files:
        if digest(Path(folder) / rel)["sha256"] != entries[rel]["sha256"]:
            return f"{rel} does not match its checksum (corrupted)"
    return None


def verify(folder: str | Path) -> str | None:
    """Why ``folder`` does not verify against its manifest (no manifest counts), or None. One process."""
    try:
        entries = read(folder)
    except ValueError as exc:
        return str(exc)
    if entries is None:
        return NO_MANIFEST
    return check_sizes(folder, entries) or check_digests(folder, entries, sorted(entries))
