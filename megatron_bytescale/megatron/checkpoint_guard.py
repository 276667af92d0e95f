"""Megatron checkpoints of an HDP run: one writer per ``--save`` folder, a verified manifest per
saved iteration, and loads that fall back to the newest iteration that verifies.

Everything Megatron-specific about checkpoints is here: the folder names (``iter_NNNNNNN``, the
tracker file ``latest_checkpointed_iteration.txt``, checkpointing.py:162 and :277 at
core_v0.16.1), the signatures of ``save_checkpoint(iteration, ...)`` and
``load_checkpoint(model, optimizer, scheduler, load_arg='load', ...)``, and ``args.ckpt_step``,
which ``_load_base_checkpoint`` (checkpointing.py:1188) reads in place of the tracker.

* ``hold_save_lock(args)``: global rank 0 takes ``folder_lock.HeartbeatLock`` on ``--save``
  before the ranks initialise, and holds it (heartbeat thread) until it exits.
* ``manifested_save(save_checkpoint)``: after Megatron's save (all ranks, synchronous saves), the
  ranks hash the new ``iter_*`` folder's files in parallel (every N-th file each) and rank 0
  writes ``bytescale-manifest.json`` last, atomically. Async saves (``--async-save``) finish
  after the call returns and get no manifest (docs/cluster.md).
* ``verified_load(load_checkpoint)``: before Megatron's load, the ranks verify the tracker's
  iteration against its manifest (sizes, then checksums, in parallel) and step back to the newest
  iteration that verifies, naming each one skipped and why; Megatron then loads that one. A
  tracker that is missing or holds no iteration, beside ``iter_*`` folders, is one more damaged
  piece: the newest iteration that verifies is loaded, saying so (Megatron would start from
  random weights and overwrite those folders, or exit 0 on a garbled tracker). While it loads,
  every read of the tracker (``read_metadata``, also the legacy format's second read for the
  distributed optimizer) answers the chosen iteration.
* ``check_overwrite(args)``: a ``--save`` folder that holds checkpoints is written only by a run
  that resumes from it; otherwise one line (the launcher and every rank check it).
"""

from __future__ import annotations

import atexit
import functools
import os
import re
from collections.abc import Callable
from pathlib import Path

from .. import checkpoint_manifest as manifest
from ..errors import ConfigError, excerpt
from ..folder_lock import HeartbeatLock
from . import rank_guard

TRACKER = "latest_checkpointed_iteration.txt"
ITERATION_DIR = re.compile(r"^iter_(\d{7})$")
# written into --save before its first manifested save: a checkpoint here without a manifest was
# interrupted, not saved before manifests existed
MARKER = "bytescale-checkpoints.json"
_lock: HeartbeatLock | None = None
_chosen: tuple[str, int] | None = None  # (folder, iteration) verified_load is loading: its tracker's reads answer it


def iteration_dir(folder: str | Path, iteration: int) -> Path:
    return Path(folder) / f"iter_{iteration:07d}"


def tracker_text(folder: str | Path) -> str | None:
    """What Megatron's tracker holds (stripped), or None where there is none (or it cannot be read)."""
    try:
        return (Path(folder) / TRACKER).read_text(errors="replace").strip()
    except OSError:
        return None


def tracker_iteration(folder: str | Path) -> int | None:
    """The iteration Megatron's tracker names (None: no tracker, a release checkpoint, or unreadable)."""
    text = tracker_text(folder)
    return int(text) if text is not None and text.isdigit() else None


def saved_iterations(folder: str | Path) -> list[int]:
    """The iterations with an ``iter_*`` folder, newest first."""
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    return sorted((int(m.group(1)) for n in names if (m := ITERATION_DIR.match(n))), reverse=True)


# ------------------------------------------------------------------ one writer
def hold_save_lock(args) -> None:
    """Global rank 0 of an HDP run with ``--save`` takes the folder's lock (ConfigError if a live
    run holds it) and says so when it took over a stale one."""
    global _lock
    if _lock is not None or not getattr(args, "save", None) or getattr(args, "rank", 0) != 0:
        return
    lock = HeartbeatLock(args.save, what="training run")
    lock.acquire()
    _lock = lock
    atexit.register(lock.release)  # a run that ends normally leaves no lock; a killed one leaves a stale one
    if lock.took_over:
        print(f"bytescale: took over the lock of --save {args.save} from a dead run ({lock.took_over})", flush=True)


def _same_folder(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.abspath(a) == os.path.abspath(b)


def check_overwrite(args) -> None:
    """ConfigError when ``--save`` holds checkpoints this run would overwrite: it does not resume
    from that folder (no ``--load``, another one, or ``--finetune``, which starts at iteration 0)."""
    save = getattr(args, "save", None)
    iterations = saved_iterations(save) if save else []
    if not iterations:
        return
    load = getattr(args, "load", None)
    if load and _same_folder(load, save) and not getattr(args, "finetune", False):
        return
    how = (
        "it starts at iteration 0 (--finetune)"
        if getattr(args, "finetune", False)
        else "it loads from another folder"
        if load
        else "it starts from scratch (no --load)"
    )
    raise ConfigError(
        f"--save {save} already holds checkpoints (newest iter_{iterations[0]:07d}) that this run would overwrite: "
        f"{how}; resume them with --load {save}, or choose an empty --save"
    )


# ------------------------------------------------------------------ distributed hashing
def _world():
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist, dist.get_rank(), dist.get_world_size()
    return None, 0, 1


def _gather(value):
    dist, _, size = _world()
    if dist is None:
        return [value]
    out = [None] * size
    dist.all_gather_object(out, value)
    return out


def write_manifest(folder: Path) -> None:
    """All ranks: hash a share of ``folder``'s files each; rank 0 writes the manifest."""
    dist, rank, size = _world()
    if dist is not None:
        dist.barrier()  # every rank's files are complete
    files = manifest.files_of(folder)
    entries: dict = {}
    for part in _gather(manifest.digests(folder, manifest.share(files, rank, size))):
        entries.update(part)
    if rank == 0:
        manifest.write(folder, entries)


def verify_iteration(folder: Path) -> str | None:
    """All ranks, the same answer: why ``folder`` does not verify, or None."""
    _, rank, size = _world()
    try:
        entries = manifest.read(folder)
        reason = manifest.NO_MANIFEST if entries is None else manifest.check_sizes(folder, entries)
    except ValueError as exc:
        reason = str(exc)
    if reason is None:
        reason = manifest.check_digests(folder, entries, manifest.share(sorted(entries), rank, size))
    reasons = [r for r in _gather(reason) if r]
    return reasons[0] if reasons else None


# ------------------------------------------------------------------ hooks
def manifested_save(
    save_checkpoint: Callable, megatron_args: Callable, before_manifest: Callable | None = None
) -> Callable:
    """Wrap Megatron's ``save_checkpoint``: under HDP, each persistent synchronous save gets its
    manifest; ``before_manifest(folder, args, iteration)`` (rank 0) adds files the manifest covers."""
    if getattr(save_checkpoint, "_hdp_manifest", False):
        return save_checkpoint

    @functools.wraps(save_checkpoint)
    def save(iteration, *rest, **kwargs):
        args = megatron_args()
        manifested = (
            args is not None
            and args.save
            and not getattr(args, "async_save", False)
            and not kwargs.get("non_persistent_ckpt")
            and not kwargs.get("release")
            and getattr(args, "ckpt_format", "torch_dist") != "torch_dcp"
        )
        if manifested and _world()[1] == 0 and not (Path(args.save) / MARKER).exists():
            Path(args.save).mkdir(parents=True, exist_ok=True)
            manifest.write_atomically(Path(args.save) / MARKER, b'{"manifests": 1}\n')
        result = save_checkpoint(iteration, *rest, **kwargs)
        if manifested:
            folder = iteration_dir(args.save, iteration)
            if before_manifest is not None and _world()[1] == 0:
                before_manifest(folder, args, iteration)  # covered by the manifest
            write_manifest(folder)
        return result

    save._hdp_manifest = True
    return save


def _manifested(folder: str | Path, iterations: list[int]) -> bool:
    """Whether this folder's saves write manifests (the marker, or any manifest)."""
    return (Path(folder) / MARKER).exists() or any(
        (iteration_dir(folder, i) / manifest.MANIFEST).exists() for i in iterations
    )


def choose_iteration(folder: str | Path) -> tuple[int | None, list[str]]:
    """(iteration to load, the lines to print). None with no lines: leave the load to Megatron
    (an empty folder, a release checkpoint, a tracker's iteration in a folder saved before
    manifests existed). ConfigError when nothing there can be loaded."""
    text = tracker_text(folder)
    if text == "release":
        return None, []
    iterations = saved_iterations(folder)
    newest = int(text) if text is not None and text.isdigit() else None
    tracker_said = "is missing" if text is None else f"holds {excerpt(text)}, not an iteration"
    if newest is None and not iterations:
        if text is None:
            return None, []  # nothing saved yet: Megatron starts at iteration 0
        raise ConfigError(
            f"--load {folder}: {TRACKER} {tracker_said}, and no iter_* folder is there; write the iteration to "
            "resume into it, or delete it to start from scratch"
        )
    if not _manifested(folder, iterations):  # saved before manifests existed: nothing to verify against
        if newest is None:
            raise ConfigError(
                f"--load {folder}: {TRACKER} {tracker_said}, and its iter_* folders (newest iter_{iterations[0]:07d}) "
                f"have no manifests to choose one by; write the iteration to resume into {folder}/{TRACKER}"
            )
        present = [i for i in iterations if i <= newest]
        if not present:
            raise ConfigError(f"--load {folder}: {TRACKER} names iteration {newest}, which is not there")
        note = "" if present[0] == newest else f"; iter_{newest:07d}, which the tracker names, is missing"
        return (None if present[0] == newest else present[0]), [
            f"bytescale: {folder} has no checkpoint manifests (saved without them): iteration {present[0]} "
            f"is loaded unverified{note}"
        ]
    if newest is None:
        candidates = iterations
        lines = [f"bytescale: {folder}/{TRACKER} {tracker_said}: resuming from the newest checkpoint that verifies"]
    else:  # the tracker's iteration first, also when its folder is gone (then: "missing")
        candidates, lines = sorted({newest, *(i for i in iterations if i <= newest)}, reverse=True), []
    skipped = []
    for i in candidates:
        reason = (
            verify_iteration(iteration_dir(folder, i)) if iteration_dir(folder, i).is_dir() else "its folder is missing"
        )
        if reason is None:
            lines.append(f"bytescale: checkpoint iter_{i:07d} in {folder} verified against its manifest")
            return i, lines
        skipped.append((i, reason))
        lines.append(f"bytescale: skipped checkpoint iter_{i:07d} in {folder}: {reason}")
    if newest is not None and skipped[0] == (newest, manifest.NO_MANIFEST):
        # Megatron names an iteration in its tracker only once every rank finished saving it:
        # what was lost is the manifest, written after
        lines.remove(f"bytescale: skipped checkpoint iter_{newest:07d} in {folder}: {manifest.NO_MANIFEST}")
        return None, [
            *lines,
            f"bytescale: checkpoint iter_{newest:07d} in {folder} has no manifest (a kill came after Megatron's save "
            "and before the manifest) and no older one verifies: it is loaded unverified",
        ]
    raise ConfigError(
        f"--load {folder}: no checkpoint verifies ({'; '.join(f'iter_{i:07d}: {r}' for i, r in skipped)}); "
        "restore the folder from a copy, or drop --load to start from scratch"
    )


def verified_load(load_checkpoint: Callable, megatron_args: Callable) -> Callable:
    """Wrap Megatron's ``load_checkpoint``: under HDP, load the newest iteration that verifies."""
    if getattr(load_checkpoint, "_hdp_manifest", False):
        return load_checkpoint

    @functools.wraps(load_checkpoint)
    def load(*positional, **kwargs):
        global _chosen
        args = megatron_args()
        load_arg = kwargs.get("load_arg", positional[3] if len(positional) > 3 else "load")
        folder = getattr(args, load_arg, None) if args is not None else None
        if not folder or getattr(args, "ckpt_step", None) or getattr(args, "pretrained_checkpoint", None):
            return load_checkpoint(*positional, **kwargs)
        try:
            iteration, lines = choose_iteration(folder)
        except ConfigError as exc:
            rank_guard.report(str(exc))
        if _world()[1] == 0:
            for line in lines:
                print(line, flush=True)
        if iteration is None or iteration == tracker_iteration(folder):
            return load_checkpoint(*positional, **kwargs)
        args.ckpt_step, _chosen = iteration, (str(folder), iteration)
        try:
            return load_checkpoint(*positional, **kwargs)
        finally:
            args.ckpt_step, _chosen = None, None

    load._hdp_manifest = True
    return load


def chosen_tracker(read_metadata: Callable) -> Callable:
    """Wrap Megatron's ``read_metadata(tracker_filename)``: while ``verified_load`` loads another
    iteration than the tracker's (or the tracker is missing or garbled), the loaded folder's
    tracker reads as that iteration: Megatron reads it before ``args.ckpt_step`` (and exits 0 on
    a garbled one), and the legacy format reads it again for the distributed optimizer's state."""
    if getattr(read_metadata, "_hdp_manifest", False):
        return read_metadata

    @functools.wraps(read_metadata)
    def read(tracker_filename, *rest, **kwargs):
        if _chosen is not None and _same_folder(os.path.dirname(str(tracker_filename)) or ".", _chosen[0]):
            return _chosen[1], False
        return read_metadata(tracker_filename, *rest, **kwargs)

    read._hdp_manifest = True
    return read
