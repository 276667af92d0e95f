"""Selective activation offloading (design 2.4).

Activations are used first-in-last-out across layers: layer 0's are saved first and needed
last. So during forward a fraction ``r`` of each layer's saved tensors is copied to host memory
and freed on the device, and during backward it comes back one layer ahead of use, on a side
stream, while the layer above computes. The ratio is chosen per micro-batch by the planner
(``MicroBatch.offload_ratio``).

How it works. ``saved_tensors_hooks`` see every tensor autograd saves for backward; forward
pre/post hooks on the transformer layers say which layer is running, so each saved tensor is
attributed to a layer. A tensor is *eligible* to move when all of these hold, otherwise it stays:

* it was saved inside one of the layers, and not inside the last ``keep_last`` of them (their
  backward starts right after forward ends: a copy could not hide behind anything);
* it is not a parameter or a view of one (weights stay resident anyway);
* it holds at least ``min_tensor_bytes`` (below that, copy launch overhead beats the saving);
* its elements do not overlap (an expanded tensor would grow when copied);
* ``keep(tensor)`` is not true (a hook for model-specific exceptions).

What is cheaper to recompute than to copy stays *by not being saved at all*: Megatron's
activation recomputation (selective recompute modules, full-layer checkpointing) runs those
regions without saving (reentrant checkpoint) or under its own saved-tensor hooks, which take
precedence over these; the offloader never copies what is recomputed, and a profile measured
with the same settings leaves it out of Act(s). (Under HDP a recomputed core attention
re-runs its ring exchange in backward; layers recomputed whole keep only their input, so
offloading serves the layers that are not recomputed.)

Exact ratio. Per layer, ``r`` is applied to the bytes of its eligible tensors with a running
quota: at each eligible tensor the bytes still owed are ``r * (eligible bytes so far) -
(bytes moved so far)``, and the tensor is split at an element boundary: its first ``k``
elements in memory order move to host and the rest is cloned into a smaller device tensor of
its own (so the original storage can be freed). With every tensor split, each layer moves
``r`` of its eligible bytes to within one element per tensor. A tensor with gaps (a slice of a
fused output, such as V of a fused QKV projection or one half of SwiGLU's fc1 output) holds its
whole base storage alive; it is first compacted on the device (a fast device-to-device copy)
so that moving part of it frees memory in proportion, and the base can go.

Reloaded tensors have the original shape, and dense ones the original strides (compacted ones
come back dense in the same dimension order), so backward computes with the same values:
gradients are bit-identical with and without offloading.

Device copies (CUDA): the device-to-host copy is queued on a dedicated stream after the compute
stream (``wait_stream``) into a pooled pinned buffer (``host_pool``), and the source's memory is
kept from reuse until the copy ran (``record_stream``). When backward reaches layer ``L`` (a
gradient hook on the layer's output; failing that, its first saved tensor being unpacked), layer
``L-1``'s tensors are reloaded on a second stream into freshly allocated device tensors; the
compute stream waits on each tensor's event only when backward unpacks it. The host buffer goes
back to the pool as soon as the reload is queued, with the reload's event attached, so the next
micro-batch reuses it without racing the copy. On CPU the same bookkeeping runs with real,
synchronous copies into a separate host pool, so the logic and the accounting are testable there.

Accounting. ``offloaded_bytes`` / ``reloaded_bytes`` count the bytes copied each way (elements
times element size). ``peak_resident_bytes`` is the most device memory held at once by saved
activations, counted by storage (a saved view holds its whole base storage alive), parameters
excluded. Per layer, ``saved_bytes`` counts the elements of its distinct saved tensors and
``held_bytes`` the storages they held on the device when forward ended.
"""

from __future__ import annotations

import logging
import math
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from ..errors import BytescaleError
from .host_pool import HostBlock, HostBufferPool

log = logging.getLogger(__name__)

DEFAULT_MIN_TENSOR_BYTES = 1 << 20  # 1 MiB


def check_ratio(ratio: float) -> float:
    """An offload ratio must lie in [0, 1]."""
    try:
        value = float(ratio)
    except (TypeError, ValueError):
        raise BytescaleError(f"offload ratio {ratio!r} is not a number: give a fraction between 0 and 1") from None
    if math.isnan(value) or not 0.0 <= value <= 1.0:
        raise BytescaleError(
            f"offload ratio {ratio!r} is outside [0, 1]: use 0 (keep every activation on the device) up to 1 "
            "(move every eligible activation of the offloadable layers); the planner's MicroBatch.offload_ratio "
            "is always in range"
        )
    return value


# ------------------------------------------------------------------------------ statistics
@dataclass(frozen=True)
class LayerOffloadStats:
    index: int
    kept_on_device: bool  # one of the last keep_last layers
    tensors: int  # distinct saved tensors (parameters excluded)
    saved_bytes: int  # their elements times element size
    held_bytes: int  # device storage they held when forward ended
    eligible_bytes: int
    offloaded_bytes: int
    reloaded_bytes: int

    @property
    def ratio(self) -> float:
        """Share of the eligible bytes that moved."""
        return self.offloaded_bytes / self.eligible_bytes if self.eligible_bytes else 0.0


@dataclass(frozen=True)
class OffloadStats:
    ratio: float  # requested
    offloaded_bytes: int
    reloaded_bytes: int
    peak_resident_bytes: int  # device bytes held by saved activations at the peak
    resident_bytes: int  # held now (0 after a backward that released the graph)
    saved_bytes: int  # all distinct saved activations, layers and outside
    outside_bytes: int  # saved outside the layers (embedding, output layer, loss): never moved
    layers: tuple[LayerOffloadStats, ...]
    pinned: bool  # host buffers were page-locked
    late_reloads: int  # tensors reloaded only when backward asked for them (not one layer ahead)

    @property
    def achieved_ratio(self) -> float:
        """Moved bytes over the eligible bytes of the offloadable layers."""
        eligible = sum(layer.eligible_bytes for layer in self.layers)
        return self.offloaded_bytes / eligible if eligible else 0.0


# ----------------------------------------------------------------------------- copy engines
class _HostCopies:
    """CPU: synchronous copies; events are None."""

    def offload(self, dst: torch.Tensor, src: torch.Tensor, pending: object) -> object:
        dst.copy_(src)
        return None

    def reload(
        self,
        dst: torch.Tensor,
        host: torch.Tensor | None,
        after: object,
        tail_dst: torch.Tensor | None,
        tail_src: torch.Tensor | None,
    ) -> object:
        if host is not None:
            dst.copy_(host)
        if tail_dst is not None:
            tail_dst.copy_(tail_src)
        return None

    def wait(self, event: object) -> None:
        pass


class _CudaCopies:
    """CUDA: D2H and H2D copies on two side streams, ordered by events."""

    def __init__(self, device: torch.device):
        self.device = device
        self.d2h = torch.cuda.Stream(device=device)
        self.h2d = torch.cuda.Stream(device=device)

    def offload(self, dst: torch.Tensor, src: torch.Tensor, pending: object) -> object:
        self.d2h.wait_stream(torch.cuda.current_stream(self.device))  # src was produced there
        if pending is not None:
            self.d2h.wait_event(pending)  # the buffer's last reader (a reload) must be done
        with torch.cuda.stream(self.d2h):
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.d2h)
        src.record_stream(self.d2h)  # the allocator must not reuse src before the copy ran
        return done

    def reload(
        self,
        dst: torch.Tensor,
        host: torch.Tensor | None,
        after: object,
        tail_dst: torch.Tensor | None,
        tail_src: torch.Tensor | None,
    ) -> object:
        # dst was just allocated on the compute stream; the tail was written there in forward
        self.h2d.wait_stream(torch.cuda.current_stream(self.device))
        if after is not None:
            self.h2d.wait_event(after)
        with torch.cuda.stream(self.h2d):
            if host is not None:
                dst.copy_(host, non_blocking=True)
            if tail_dst is not None:
                tail_dst.copy_(tail_src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.h2d)
        dst.record_stream(self.h2d)
        if tail_src is not None:
            tail_src.record_stream(self.h2d)
        return done

    def wait(self, event: object) -> None:
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)


# --------------------------------------------------------------------------- tensor layout
def _storage_key(t: torch.Tensor) -> tuple:
    return (t.device.type, t.device.index, t.untyped_storage().data_ptr())


def _layout(t: torch.Tensor) -> tuple[str, tuple[int, ...]]:
    """('dense' | 'gapped' | 'overlapping', strides of a dense tensor with the same dim order)."""
    shape, stride = t.shape, t.stride()
    order = sorted(range(t.dim()), key=lambda d: (-stride[d], d))  # outermost first
    dense_stride = [0] * t.dim()
    extent = 1
    for d in reversed(order):
        dense_stride[d] = extent
        extent *= shape[d]
    kind = "dense"
    extent = 1
    for d in reversed(order):
        if shape[d] == 1:
            continue
        if stride[d] < extent:
            return "overlapping", tuple(dense_stride)
        if stride[d] != extent:
            kind = "gapped"
        extent = stride[d] * shape[d]
    return kind, (tuple(stride) if kind == "dense" else tuple(dense_stride))


# ------------------------------------------------------------------------------ saved tensor
class _Saved:
    """What autograd stores instead of a saved tensor while it may be off the device."""

    __slots__ = (
        "state",
        "layer",
        "shape",
        "stride",
        "dtype",
        "device",
        "numel",
        "moved",
        "tensor",
        "tail",
        "block",
        "d2h_event",
        "h2d_event",
        "held",
        "__weakref__",
    )

    def __init__(self, state: _MicroBatchState, layer: int | None, t: torch.Tensor):
        self.state = state
        self.layer = layer
        self.shape, self.dtype, self.device = t.shape, t.dtype, t.device
        self.stride = t.stride()
        self.numel = t.numel()
        self.moved = 0  # elements on the host
        self.tensor: torch.Tensor | None = t  # what unpack returns; None while offloaded
        self.tail: torch.Tensor | None = None  # device copy of the elements that stayed
        self.block: HostBlock | None = None
        self.d2h_event = self.h2d_event = None
        self.held: list[tuple] = []  # storage keys counted as resident

    def __del__(self):  # autograd released the saved tensor: give back what it held
        try:
            self.state._release(self)
        except Exception:  # noqa: BLE001 - never raise from a finaliser (e.g. at shutdown)
            pass


# --------------------------------------------------------------------- one micro-batch's state
class _LayerCounters:
    __slots__ = ("tensors", "saved", "eligible", "offloaded", "reloaded", "held", "records")

    def __init__(self):
        self.tensors = self.saved = self.eligible = self.offloaded = self.reloaded = self.held = 0
        self.records: list[weakref.ref] = []


class _MicroBatchState:
    """Hooks, records and counters of one micro-batch; lives as long as its autograd graph."""

    def __init__(self, offloader: ActivationOffloader, ratio: float):
        self.off = offloader
        self.ratio = ratio
        n = len(offloader.layers)
        self.layers = [_LayerCounters() for _ in range(n)]
        self.outside = _LayerCounters()
        self.lock = threading.RLock()
        self.held: dict[tuple, list[int]] = {}  # storage key -> [bytes, holders]
        self.resident = self.peak = 0
        self.offloaded = self.reloaded = self.late = 0
        self.started: set[int] = set()  # layers whose backward has started
        self.dedup: WeakIdKeyDictionary | None = WeakIdKeyDictionary()
        self.param_storages = offloader._parameter_storages()
        self.device = offloader._device()

    # ---- residency (storage-level, refcounted: several saved views may share a storage)
    def _hold(self, rec: _Saved, t: torch.Tensor) -> None:
        key = _storage_key(t)
        with self.lock:
            entry = self.held.get(key)
            if entry is None:
                nbytes = t.untyped_storage().nbytes()
                self.held[key] = [nbytes, 1]
                self.resident += nbytes
                self.peak = max(self.peak, self.resident)
            else:
                entry[1] += 1
        rec.held.append(key)

    def _unhold(self, key: tuple) -> None:
        with self.lock:
            entry = self.held[key]
            entry[1] -= 1
            if entry[1] == 0:
                del self.held[key]
                self.resident -= entry[0]

    def _release(self, rec: _Saved) -> None:
        for key in rec.held:
            self._unhold(key)
        rec.held = []
        if rec.block is not None:
            self.off.pool.release(rec.block)
            rec.block = None
        rec.tensor = rec.tail = None

    # ---- pack
    def _is_parameter(self, t: torch.Tensor) -> bool:
        if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):  # e.g. W.t() saved by linear
            return True
        try:
            return _storage_key(t) in self.param_storages
        except RuntimeError:  # tensors without storage (subclasses)
            return False

    def pack(self, t: torch.Tensor):
        if self._is_parameter(t):
            return t  # weights are resident anyway: neither moved nor counted
        if self.dedup is not None:
            rec = self.dedup.get(t)
            if rec is not None:
                return rec  # the same tensor saved twice: one record, one copy
        layer = self.off._current_layer
        rec = _Saved(self, layer, t)
        counters = self.outside if layer is None else self.layers[layer]
        nbytes = t.numel() * t.element_size()
        with self.lock:
            counters.tensors += 1
            counters.saved += nbytes
            counters.records.append(weakref.ref(rec))
        plain = type(t) in (torch.Tensor, nn.Parameter) and t.layout == torch.strided
        on_device = plain and t.device == self.device
        if on_device:
            self._hold(rec, t)
        if self.dedup is not None:
            self.dedup[t] = rec
        if on_device and layer is not None and self.off._offloadable(layer):
            if nbytes >= self.off.min_tensor_bytes and not (self.off.keep and self.off.keep(t)):
                kind, dense_stride = _layout(t)
                if kind != "overlapping":
                    self._offload(rec, t, counters, kind, dense_stride)
        return rec

    def _offload(
        self, rec: _Saved, t: torch.Tensor, counters: _LayerCounters, kind: str, dense_stride: tuple[int, ...]
    ) -> None:
        size = t.element_size()
        numel = t.numel()
        with self.lock:
            counters.eligible += numel * size
            owed = self.ratio * counters.eligible - counters.offloaded
            k = min(numel, max(0, round(owed / size)))
            counters.offloaded += k * size
            self.offloaded += k * size
        if k == 0:
            return
        if kind == "gapped":  # compact first: a view with gaps pins its whole base storage
            t = torch.empty_strided(t.shape, dense_stride, dtype=t.dtype, device=t.device).copy_(t)
        engine = self.off._engine(t.device)
        block = self.off.pool.acquire(k * size)
        flat = t.as_strided((numel,), (1,), t.storage_offset())  # memory order
        rec.d2h_event = engine.offload(block.view(t.dtype, k), flat[:k], block.pending)
        block.pending = None
        if k < numel:
            rec.tail = flat[k:].clone()  # a storage of its own, so t's can be freed
        rec.block, rec.moved, rec.stride = block, k, dense_stride
        for key in rec.held:
            self._unhold(key)
        rec.held = []
        rec.tensor = None
        if rec.tail is not None:
            self._hold(rec, rec.tail)

    # ---- backward
    def reached(self, layer: int) -> None:
        """Backward has started on ``layer``: bring back the layer below, one ahead."""
        with self.lock:
            if layer in self.started:
                return
            self.started.add(layer)
        if layer > 0:
            self._prefetch(layer - 1)

    def _prefetch(self, layer: int) -> None:
        # backward unpacks a layer's tensors roughly in reverse order of saving: reload in that order
        for ref in reversed(self.layers[layer].records):
            rec = ref()
            if rec is not None and rec.tensor is None and rec.block is not None:
                self._load(rec)

    def _load(self, rec: _Saved) -> None:
        engine = self.off._engine(rec.device)
        full = torch.empty_strided(rec.shape, rec.stride, dtype=rec.dtype, device=rec.device)
        flat = full.as_strided((rec.numel,), (1,))
        k = rec.moved
        host = rec.block.view(rec.dtype, k)
        tail = rec.tail
        rec.h2d_event = engine.reload(flat[:k], host, rec.d2h_event, flat[k:] if tail is not None else None, tail)
        self.off.pool.release(rec.block, pending=rec.h2d_event)
        rec.block = None
        tail_keys, rec.held = rec.held, []
        rec.tensor, rec.tail = full, None
        self._hold(rec, full)
        for key in tail_keys:  # the tail's elements now live in ``full``
            self._unhold(key)
        nbytes = k * full.element_size()
        with self.lock:
            self.reloaded += nbytes
            self.layers[rec.layer].reloaded += nbytes

    def unpack(self, rec):
        if isinstance(rec, torch.Tensor):
            return rec
        if rec.layer is not None:
            self.reached(rec.layer)
        if rec.tensor is None:  # not prefetched (e.g. the topmost offloaded layer with keep_last=0)
            with self.lock:
                self.late += 1
            self._load(rec)
        if rec.h2d_event is not None:
            self.off._engine(rec.device).wait(rec.h2d_event)
        return rec.tensor

    # ---- statistics
    def end_forward(self) -> None:
        self.dedup = None
        seen: set[tuple] = set()
        for counters in (*self.layers, self.outside):
            for ref in counters.records:
                rec = ref()
                if rec is None:
                    continue
                for key in rec.held:
                    if key not in seen:
                        seen.add(key)
                        entry = self.held.get(key)
                        counters.held += entry[0] if entry else 0

    def stats(self) -> OffloadStats:
        with self.lock:
            layers = tuple(
                LayerOffloadStats(
                    index=i,
                    kept_on_device=not self.off._offloadable(i),
                    tensors=c.tensors,
                    saved_bytes=c.saved,
                    held_bytes=c.held,
                    eligible_bytes=c.eligible,
                    offloaded_bytes=c.offloaded,
                    reloaded_bytes=c.reloaded,
                )
                for i, c in enumerate(self.layers)
            )
            return OffloadStats(
                ratio=self.ratio,
                offloaded_bytes=self.offloaded,
                reloaded_bytes=self.reloaded,
                peak_resident_bytes=self.peak,
                resident_bytes=self.resident,
                saved_bytes=sum(c.saved for c in self.layers) + self.outside.saved,
                outside_bytes=self.outside.saved,
                layers=layers,
                pinned=self.off.pool.pinned,
                late_reloads=self.late,
            )


class MicroBatchOffload:
    """Handle of one micro-batch, yielded by ``ActivationOffloader.micro_batch``."""

    def __init__(self, state: _MicroBatchState):
        self._state = state

    @property
    def ratio(self) -> float:
        return self._state.ratio

    def stats(self) -> OffloadStats:
        return self._state.stats()


# ------------------------------------------------------------------------------ the offloader
class ActivationOffloader:
    """Offload a per-micro-batch fraction of the saved activations of ``layers`` to host memory.

    ``layers`` are the model's transformer layers in forward order (Megatron GPTModel:
    ``model.decoder.layers``; see ``transformer_layers``). Use::

        offloader = ActivationOffloader(transformer_layers(model))
        with offloader.micro_batch(mb.offload_ratio):
            loss = forward(...)
        loss.backward()                # inside or after the block
        offloader.last_stats()
    """

    def __init__(
        self,
        layers: Sequence[nn.Module],
        keep_last: int = 2,
        min_tensor_bytes: int = DEFAULT_MIN_TENSOR_BYTES,
        keep: Callable[[torch.Tensor], bool] | None = None,
        pin_memory: bool | None = None,
        max_cached_host_bytes: int | None = None,
    ):
        self.layers = list(layers)
        if not self.layers:
            raise BytescaleError("ActivationOffloader needs the model's transformer layers; got none")
        if len({id(m) for m in self.layers}) != len(self.layers):
            raise BytescaleError("ActivationOffloader: a layer appears twice in the list; pass each layer once")
        if keep_last < 0:
            raise BytescaleError(f"keep_last must be 0 or more (layers kept on the device), got {keep_last}")
        if min_tensor_bytes < 0:
            raise BytescaleError(f"min_tensor_bytes must be 0 or more, got {min_tensor_bytes}")
        self.keep_last = keep_last
        self.min_tensor_bytes = min_tensor_bytes
        self.keep = keep
        if pin_memory is None:  # pinning only pays for accelerator copies
            pin_memory = self._device().type == "cuda"
        self.pool = HostBufferPool(pin_memory=pin_memory, max_cached_bytes=max_cached_host_bytes)
        if not pin_memory:
            log.info("activation offloading uses pageable host memory (no accelerator): copies are synchronous")
        self._engines: dict[torch.device, object] = {}
        self._current_layer: int | None = None
        self._active: _MicroBatchState | None = None
        self._last: _MicroBatchState | None = None
        self._handles = []
        for i, layer in enumerate(self.layers):
            self._handles.append(layer.register_forward_pre_hook(self._make_pre_hook(i)))
            self._handles.append(layer.register_forward_hook(self._make_post_hook(i)))

    # ---- layer hooks
    def _make_pre_hook(self, index: int):
        def pre_hook(module, args):
            if self._active is not None:
                self._current_layer = index

        return pre_hook

    def _make_post_hook(self, index: int):
        def post_hook(module, args, output):
            state = self._active
            if state is None:
                return
            self._current_layer = None
            out = _first_grad_tensor(output)
            if out is not None and torch.is_grad_enabled():
                # the gradient of a layer's output arrives when its backward starts
                out.register_hook(lambda grad, s=state, i=index: s.reached(i))

        return post_hook

    def _offloadable(self, layer: int) -> bool:
        return layer < len(self.layers) - self.keep_last

    def _device(self) -> torch.device:
        for layer in self.layers:
            for p in layer.parameters():
                return p.device
        return torch.device("cpu")

    def _parameter_storages(self) -> set:
        keys = set()
        for layer in self.layers:
            for p in layer.parameters():
                keys.add(_storage_key(p))
        return keys

    def _engine(self, device: torch.device):
        engine = self._engines.get(device)
        if engine is None:
            engine = _CudaCopies(device) if device.type == "cuda" else _HostCopies()
            self._engines[device] = engine
        return engine

    # ---- public API
    @contextmanager
    def micro_batch(self, ratio: float) -> Iterator[MicroBatchOffload]:
        """Run one micro-batch's forward inside; ``ratio`` of each offloadable layer's eligible
        saved bytes moves to host. Backward may run inside or after the block."""
        ratio = check_ratio(ratio)
        if self._active is not None:
            raise BytescaleError(
                "offloader.micro_batch() is already active: finish one micro-batch's forward before starting the next"
            )
        state = _MicroBatchState(self, ratio)
        self._active = state
        self._current_layer = None
        try:
            with torch.autograd.graph.saved_tensors_hooks(state.pack, state.unpack):
                yield MicroBatchOffload(state)
        finally:
            self._active = None
            self._current_layer = None
            state.end_forward()
            self._last = state

    def last_stats(self) -> OffloadStats:
        """Statistics of the most recent micro-batch (complete once its backward has run)."""
        if self._last is None:
            raise BytescaleError("no micro-batch has run yet: run the forward inside offloader.micro_batch(ratio)")
        return self._last.stats()

    def remove(self) -> None:
        """Detach the layer hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _first_grad_tensor(output) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output if output.requires_grad else None
    if isinstance(output, (tuple, list)):
        for item in output:
            found = _first_grad_tensor(item)
            if found is not None:
                return found
    return None


def transformer_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer layers of a Megatron GPTModel, through DDP / Float16Module wrappers."""
    inner = model
    while not hasattr(inner, "decoder") and hasattr(inner, "module"):
        inner = inner.module
    decoder = getattr(inner, "decoder", None)
    if decoder is None or not hasattr(decoder, "layers"):
        raise BytescaleError(
            f"{type(model).__name__} has no decoder.layers: pass the transformer layers to ActivationOffloader yourself"
        )
    return list(decoder.layers)
