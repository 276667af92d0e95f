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
  iteration that verifies, naming each one skipped and why; Megatron then loads that one.
"""

from __future__ import annotations

import atexit
import functools
import os
import re
from collections.abc import Callable
from pathlib import Path

from .. import checkpoint_manifest as manifest
from ..errors import ConfigError
from ..folder_lock import HeartbeatLock
from . import rank_guard

TRACKER = "latest_checkpointed_iteration.txt"
ITERATION_DIR = re.compile(r"^iter_(\d{7})$")
_lock: HeartbeatLock | None = None


def iteration_dir(folder: str | Path, iteration: int) -> Path:
    return Path(folder) / f"iter_{iteration:07d}"


def tracker_iteration(folder: str | Path) -> int | None:
    """The iteration Megatron's tracker names (None: no tracker, a release checkpoint, or unreadable)."""
    try:
        text = (Path(folder) / TRACKER).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


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
        reason = "no manifest (the save did not finish)" if entries is None else manifest.check_sizes(folder, entries)
    except ValueError as exc:
        reason = str(exc)
    if reason is None:
        reason = manifest.check_digests(folder, entries, manifest.share(sorted(entries), rank, size))
    reasons = [r for r in _gather(reason) if r]
    return reasons[0] if reasons else None


# ------------------------------------------------------------------ hooks
def manifested_save(save_checkpoint: Callable, megatron_args: Callable) -> Callable:
    """Wrap Megatron's ``save_checkpoint``: under HDP, each persistent synchronous save gets its manifest."""
    if getattr(save_checkpoint, "_hdp_manifest", False):
        return save_checkpoint

    @functools.wraps(save_checkpoint)
    def save(iteration, *rest, **kwargs):
        result = save_checkpoint(iteration, *rest, **kwargs)
        args = megatron_args()
        if (
            args is not None
            and args.save
            and not getattr(args, "async_save", False)
            and not kwargs.get("non_persistent_ckpt")
            and not kwargs.get("release")
            and getattr(args, "ckpt_format", "torch_dist") != "torch_dcp"
        ):
            write_manifest(iteration_dir(args.save, iteration))
        return result

    save._hdp_manifest = True
    return save


def choose_iteration(folder: str | Path) -> tuple[int | None, list[str]]:
    """(iteration to load, the lines to print). None with no lines: leave the load to Megatron
    (no tracker, a release checkpoint, or a folder saved before manifests existed)."""
    newest = tracker_iteration(folder)
    if newest is None:
        return None, []
    # the tracker's iteration first, also when its folder is gone (then: "no manifest")
    candidates = sorted({newest, *(i for i in saved_iterations(folder) if i <= newest)}, reverse=True)
    if not any((iteration_dir(folder, i) / manifest.MANIFEST).exists() for i in saved_iterations(folder)):
        return None, [
            f"bytescale: {folder} has no checkpoint manifests (saved without them): iteration {newest} "
            "is loaded unverified"
        ]
    lines, skipped = [], []
    for i in candidates:
        reason = verify_iteration(iteration_dir(folder, i))
        if reason is None:
            lines.append(f"bytescale: checkpoint iter_{i:07d} in {folder} verified against its manifest")
            return i, lines
        skipped.append(f"iter_{i:07d}: {reason}")
        lines.append(f"bytescale: skipped checkpoint iter_{i:07d} in {folder}: {reason}")
    raise ConfigError(
        f"--load {folder}: no checkpoint verifies ({'; '.join(skipped) or 'no iter_* folders'}); "
        "restore the folder from a copy, or drop --load to start from scratch"
    )


def verified_load(load_checkpoint: Callable, megatron_args: Callable) -> Callable:
    """Wrap Megatron's ``load_checkpoint``: under HDP, load the newest iteration that verifies."""
    if getattr(load_checkpoint, "_hdp_manifest", False):
        return load_checkpoint

    @functools.wraps(load_checkpoint)
    def load(*positional, **kwargs):
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
        args.ckpt_step = iteration
        try:
            return load_checkpoint(*positional, **kwargs)
        finally:
            args.ckpt_step = None

    load._hdp_manifest = True
    return load
