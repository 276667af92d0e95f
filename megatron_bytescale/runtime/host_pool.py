"""Reusable host buffers for offloaded activations (design 2.4: "cached pinned buffers").

Pinned (page-locked) host memory is what lets a device-to-host copy run asynchronously on a
side stream; allocating it is slow (it maps and locks pages), so buffers are kept and reused
across micro-batches instead of being allocated per tensor. Requests are rounded up to size
classes (eight per power of two, at most 12.5% slack), and a released buffer goes back to its
class's free list, so micro-batches of the same shape reuse exactly the same buffers and the
pool stops growing after the first one.

Where pinned memory cannot be had (a CPU-only build, or the pin fails) the pool logs why once
and falls back to pageable memory: copies then still happen, only synchronously.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

MIN_CLASS_BYTES = 4096
_CLASSES_PER_OCTAVE_LOG2 = 3  # 8 size classes per power of two


def size_class(nbytes: int) -> int:
    """The buffer size a request of ``nbytes`` is served from."""
    if nbytes <= MIN_CLASS_BYTES:
        return MIN_CLASS_BYTES
    step = 1 << max(12, (nbytes - 1).bit_length() - 1 - _CLASSES_PER_OCTAVE_LOG2)
    return -(-nbytes // step) * step


def empty_host_cache() -> None:
    """Return torch's cached, unused pinned host memory to the system (a no-op without one)."""
    release = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
    release = release or getattr(torch._C, "_host_emptyCache", None)
    if release is not None:
        try:
            release()
        except RuntimeError:  # no accelerator allocator initialised
            pass


def allocate_pinned(nbytes: int) -> torch.Tensor:
    """Page-locked uint8 host buffer; raises RuntimeError where pinning is unavailable."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


@dataclass(eq=False)
class HostBlock:
    """One pooled host buffer. ``pending`` is a device event that must complete before the
    buffer is written again (the last copy that read it); ``None`` on CPU."""

    buffer: torch.Tensor  # uint8, size = size class
    pending: object = None

    @property
    def capacity(self) -> int:
        return self.buffer.numel()

    def view(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """The first ``numel`` elements of the buffer as a 1-D tensor of ``dtype``."""
        return self.buffer[: numel * dtype.itemsize].view(dtype)


class HostBufferPool:
    """Thread-safe pool of host buffers, pinned when possible.

    ``max_cached_bytes`` bounds the memory kept in free lists (not what is in use): when
    releasing a buffer would push the pool past it, free buffers are dropped.
    """

    def __init__(self, pin_memory: bool, max_cached_bytes: int | None = None):
        self._want_pinned = pin_memory
        self._pinned = pin_memory
        self.pin_failure: str | None = None
        self.max_cached_bytes = max_cached_bytes
        self._free: dict[int, list[HostBlock]] = {}
        self._lock = threading.Lock()
        self.capacity_bytes = 0  # bytes of all buffers the pool owns (free or in use)
        self.in_use_bytes = 0
        self.allocations = 0  # fresh buffers ever allocated
        self.reuses = 0  # requests served from a free list

    @property
    def pinned(self) -> bool:
        """Whether the buffers handed out now are page-locked."""
        return self._pinned

    def _allocate(self, nbytes: int) -> torch.Tensor:
        if self._pinned:
            try:
                return allocate_pinned(nbytes)
            except RuntimeError as exc:
                self._pinned = False
                self.pin_failure = str(exc)
                log.warning(
                    "pinned host memory is unavailable (%s); offloading falls back to pageable memory, "
                    "so its copies run synchronously. Run on a CUDA build of torch with a GPU to overlap them.",
                    exc,
                )
        return torch.empty(nbytes, dtype=torch.uint8)

    def acquire(self, nbytes: int) -> HostBlock:
        size = size_class(nbytes)
        with self._lock:
            free = self._free.get(size)
            if free:
                block = free.pop()
                self.reuses += 1
                self.in_use_bytes += size
                return block
        buffer = self._allocate(size)  # outside the lock: pinning can take milliseconds
        with self._lock:
            self.allocations += 1
            self.capacity_bytes += size
            self.in_use_bytes += size
        return HostBlock(buffer)

    def release(self, block: HostBlock, pending: object = None) -> None:
        """Return ``block``; ``pending`` (a device event) must complete before its next write."""
        block.pending = pending
        with self._lock:
            self.in_use_bytes -= block.capacity
            self._free.setdefault(block.capacity, []).append(block)
            if self.max_cached_bytes is not None and self.capacity_bytes > self.max_cached_bytes:
                self._drop_free(self.capacity_bytes - self.max_cached_bytes)

    def trim(self) -> int:
        """Drop every free buffer; return the bytes released. Pinned buffers go back to the
        operating system (torch's own pinned-memory cache is emptied too)."""
        with self._lock:
            dropped = self._drop_free(self.capacity_bytes)
        if self._want_pinned and self.pin_failure is None:
            empty_host_cache()
        return dropped

    def _drop_free(self, target: int) -> int:
        dropped = 0
        for size in sorted(self._free, reverse=True):  # largest first: fewest frees
            blocks = self._free[size]
            while blocks and dropped < target:
                blocks.pop()
                dropped += size
            if not blocks:
                del self._free[size]
            if dropped >= target:
                break
        self.capacity_bytes -= dropped
        return dropped

    def __repr__(self) -> str:
        kind = "pinned" if self._pinned else "pageable"
        return (
            f"HostBufferPool({kind}, capacity={self.capacity_bytes} B, in use={self.in_use_bytes} B, "
            f"allocations={self.allocations}, reuses={self.reuses})"
        )
