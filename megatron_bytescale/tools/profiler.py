"""``bytescale profile``: measure the cost model's coefficients on this machine (design 2.8).

For one transformer layer of the chosen model (``layer_stack``: megatron-core's
TransformerLayer as HDP training builds it, from the model's args file, or the same layer in
plain torch where megatron-core is missing):

* ``T(s) = a1*s^2 + b1*s + g``: forward+backward seconds over a sweep of sequence lengths,
  fitted by non-negative least squares on relative error (short and long runs weigh alike);
* ``Act(s) = a2*s + b2``: device bytes the layer holds for backward, counted through the
  saved-tensor hooks of ``ActivationOffloader`` (ratio 0: nothing moves, everything is counted);
* ``forward_share``: the forward's share of forward+backward, timed separately over the
  same sweep (device-to-host copies hide behind the forward only, host-to-device behind
  the backward);
* ``bw_d2h`` / ``bw_h2d``: pinned host <-> device copies on a GPU, a host memcpy on CPU;
* ``host_memory_bytes``: the pinned host memory one GPU may fill with offloaded activations:
  ``--host-memory-share`` of this host's RAM over its GPUs (pinned pages cannot be swapped,
  and the OS, data loaders and host-side optimizer state need the rest), or
  ``--host-memory-per-gpu`` as given; on a GPU a pinned probe of ``--pin-probe`` bytes checks
  that pinning works at all;
* ``bw_intra_node`` / ``p2p_latency_s``: a ping-pong between ranks 0 and 1 when launched on
  two or more ranks (torchrun), otherwise left analytic.

The profile file holds every ``CostModel`` field (what ``CostModel.from_profile`` reads); fields
not measured come from the analytic model of ``--model`` on ``--hardware``. ``source`` says
which is which and ``notes`` keeps the raw measurements.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import platform
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch

from ..errors import BytescaleError, ConfigError
from ..planner.cost_model import CostModel
from ..planner.specs import HardwareSpec, ModelSpec
from ..runtime.offload import ActivationOffloader, OffloadStats
from ..units import format_size

log = logging.getLogger(__name__)

MEASURED = "measured"
HOST_MEMORY_SHARE = 0.5  # of the host's RAM that offloaded activations may pin, all GPUs together
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


# ------------------------------------------------------------------------------------ fitting
def fit_nonnegative(columns: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares ``columns @ c ~ y`` with ``c >= 0`` (exact: every support is tried; the
    cost model rejects negative coefficients)."""
    columns = np.asarray(columns, dtype=float)
    y = np.asarray(y, dtype=float)
    scale = np.linalg.norm(columns, axis=0)
    scale[scale == 0] = 1.0
    columns = columns / scale  # s^2, s and 1 differ by orders of magnitude: condition first
    n = columns.shape[1]
    best, best_err = np.zeros(n), float(np.sum(y**2))
    for size in range(1, n + 1):
        for support in itertools.combinations(range(n), size):
            sub = columns[:, support]
            coef, *_ = np.linalg.lstsq(sub, y, rcond=None)
            if np.any(coef < 0):
                continue
            err = float(np.sum((sub @ coef - y) ** 2))
            if err < best_err - 1e-15 * max(1.0, best_err):
                best = np.zeros(n)
                best[list(support)] = coef
                best_err = err
    return best / scale


def _relative_fit(columns: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float]:
    """Non-negative fit minimising relative error; returns the coefficients and R^2."""
    y = np.asarray(y, dtype=float)
    if np.any(y <= 0):
        raise BytescaleError("measurements must be positive to fit a cost model")
    coef = fit_nonnegative(columns / y[:, None], np.ones_like(y))
    pred = columns @ coef
    total = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - float(np.sum((y - pred) ** 2)) / total if total > 0 else 1.0
    return coef, r2


def _check_sweep(seq_lens: Sequence[int], values: Sequence[float], need: int, what: str) -> None:
    if len(seq_lens) != len(values):
        raise BytescaleError(f"{what}: {len(seq_lens)} sequence lengths but {len(values)} measurements")
    if len(set(seq_lens)) < need:
        raise BytescaleError(f"{what}: needs at least {need} different sequence lengths, got {sorted(set(seq_lens))}")


def fit_layer_time(seq_lens: Sequence[int], seconds: Sequence[float]) -> tuple[float, float, float, float]:
    """``(a1, b1, g, R^2)`` of ``T(s) = a1*s^2 + b1*s + g``."""
    _check_sweep(seq_lens, seconds, 3, "layer time fit")
    s = np.asarray(seq_lens, dtype=float)
    coef, r2 = _relative_fit(np.stack([s * s, s, np.ones_like(s)], axis=1), seconds)
    return float(coef[0]), float(coef[1]), float(coef[2]), r2


def fit_activation_model(seq_lens: Sequence[int], act_bytes: Sequence[float]) -> tuple[float, float, float]:
    """``(a2, b2, R^2)`` of ``Act(s) = a2*s + b2``."""
    _check_sweep(seq_lens, act_bytes, 2, "activation fit")
    s = np.asarray(seq_lens, dtype=float)
    coef, r2 = _relative_fit(np.stack([s, np.ones_like(s)], axis=1), act_bytes)
    return float(coef[0]), float(coef[1]), r2


# ------------------------------------------------------- offload accounting -> cost model
def layer_activation_bytes(stats: OffloadStats) -> float:
    """Device bytes one layer holds for backward, from a micro-batch's offload statistics: the
    mean ``held_bytes`` of the layers that moved nothing (the kept ones, or all at ratio 0)."""
    unmoved = [layer.held_bytes for layer in stats.layers if layer.offloaded_bytes == 0 and layer.tensors]
    if not unmoved:
        raise BytescaleError(
            "every layer offloaded part of its activations, so none shows what a layer holds: "
            "measure with ratio 0 or keep_last >= 1"
        )
    return float(np.mean(unmoved))


def act_coefficients(samples: Sequence[tuple[int, OffloadStats]]) -> tuple[float, float]:
    """``(a2, b2)`` from ``(tokens, stats)`` of micro-batches of at least two sizes."""
    tokens = [t for t, _ in samples]
    a2, b2, _ = fit_activation_model(tokens, [layer_activation_bytes(st) for _, st in samples])
    return a2, b2


def check_act_coefficients(cost: CostModel, samples: Sequence[tuple[int, OffloadStats]], rtol: float = 0.15) -> float:
    """Compare the cost model's ``Act(s)`` with what the offloader measured; return the largest
    relative error, or raise when it exceeds ``rtol``."""
    if not samples:
        raise BytescaleError("no measured micro-batches to check the activation model against")
    worst, lines = 0.0, []
    for tokens, st in samples:
        measured = layer_activation_bytes(st)
        predicted = cost.act_bytes(tokens)
        err = abs(predicted - measured) / measured
        worst = max(worst, err)
        if err > rtol:
            lines.append(f"Act({tokens}) = {predicted:.0f} B predicted, {measured:.0f} B measured ({err:+.0%})")
    if lines:
        raise BytescaleError(
            "the cost model's activation bytes do not match this model: "
            + "; ".join(lines)
            + ". Run `bytescale profile` for this model and dtype and plan with its profile "
            "(a2, b2 measured), or set a2/b2 from act_coefficients()."
        )
    return worst


# ---------------------------------------------------------------------------- measurements
@dataclass(frozen=True)
class LayerSample:
    seq_len: int
    seconds: float  # forward + backward, best of the repeats
    forward_seconds: float  # forward alone, best of the repeats
    act_bytes: int  # device bytes held for backward (storage-level)
    saved_bytes: int  # elements x element size of the saved tensors


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_layer(stack, seq_lens: Sequence[int], repeats: int = 3, warmup: int = 1) -> list[LayerSample]:
    """Time forward+backward of ``stack`` (one layer) and count what it saves, per length."""
    param = next(stack.parameters())
    device, dtype, hidden = param.device, param.dtype, stack.spec.hidden_size
    offloader = ActivationOffloader(stack.layers, keep_last=len(stack.layers), min_tensor_bytes=0)
    samples = []
    try:
        for s in seq_lens:
            x = torch.randn(s, 1, hidden, device=device, dtype=dtype, requires_grad=True)
            grad = torch.randn_like(x)
            with offloader.micro_batch(0.0):
                out = stack(x)
            stats = offloader.last_stats()
            out.backward(grad)
            del out
            best = best_fwd = float("inf")
            for i in range(warmup + repeats):
                stack.zero_grad(set_to_none=True)
                _sync(device)
                start = time.perf_counter()
                out = stack(x)
                _sync(device)
                mid = time.perf_counter()
                out.backward(grad)
                _sync(device)
                if i >= warmup:
                    best = min(best, time.perf_counter() - start)
                    best_fwd = min(best_fwd, mid - start)
                del out
            layers = len(stack.layers)
            samples.append(
                LayerSample(
                    seq_len=int(s),
                    seconds=best / layers,
                    forward_seconds=best_fwd / layers,
                    act_bytes=round(sum(layer.held_bytes for layer in stats.layers) / layers),
                    saved_bytes=round(sum(layer.saved_bytes for layer in stats.layers) / layers),
                )
            )
            log.info(
                "layer at %s tokens: %.3f ms, %s B held", format_size(s), best / layers * 1e3, samples[-1].act_bytes
            )
    finally:
        offloader.remove()
    return samples


def measure_copy_bandwidth(device: torch.device, nbytes: int, repeats: int = 3) -> tuple[float, float, bool]:
    """``(d2h, h2d, pinned)`` bytes/s. GPU: device <-> pinned host; CPU: host memcpy both ways."""
    device = torch.device(device)
    if device.type == "cuda":
        src = torch.empty(nbytes, dtype=torch.uint8, device=device)
        try:
            host, pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), True
        except RuntimeError as exc:
            log.warning("pinned memory unavailable (%s): measuring pageable copies", exc)
            host, pinned = torch.empty(nbytes, dtype=torch.uint8), False
        pairs = [(host, src), (src, host)]
    else:
        a, b = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
        pairs, pinned = [(b, a), (a, b)], False
    rates = []
    for dst, source in pairs:
        dst.copy_(source, non_blocking=True)  # warm-up (first touch, page faults)
        _sync(device)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            dst.copy_(source, non_blocking=True)
            _sync(device)
            best = min(best, time.perf_counter() - start)
        rates.append(nbytes / best)
    return rates[0], rates[1], pinned


def measure_p2p(nbytes: int, repeats: int = 5, device: torch.device | None = None) -> tuple[float, float] | None:
    """``(bytes/s, latency_s)`` between ranks 0 and 1 by ping-pong; call on every rank (ranks
    above 1 just wait). ``None`` when fewer than two ranks exist."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    rank = dist.get_rank()
    device = device or torch.device("cpu")

    def round_trip(n: int) -> float:
        buf = torch.zeros(max(1, n), dtype=torch.uint8, device=device)
        best = float("inf")
        for i in range(repeats + 1):
            dist.barrier()
            start = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            elif rank == 1:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            _sync(device)
            if i:  # the first is a warm-up
                best = min(best, time.perf_counter() - start)
        return best / 2  # one way

    latency = round_trip(1)
    one_way = round_trip(nbytes)
    bandwidth = nbytes / max(one_way - latency, 1e-9)
    result = torch.tensor([bandwidth, latency], dtype=torch.float64, device=device)  # NCCL: a device tensor
    dist.broadcast(result, 0)  # rank 0's timings are the ones written
    return float(result[0]), float(result[1])


def host_ram_bytes() -> int:
    """Physical RAM of this host (bytes)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def host_memory_per_gpu(gpus: int, share: float = HOST_MEMORY_SHARE, ram: int | None = None) -> float:
    """``share`` of the host's RAM divided over its ``gpus`` GPUs."""
    if not 0.0 < share <= 1.0:
        raise ConfigError(f"--host-memory-share must be in (0, 1], got {share}")
    if gpus < 1:
        raise ConfigError(f"GPUs per host must be at least 1, got {gpus}")
    return share * (host_ram_bytes() if ram is None else ram) / gpus


def probe_pinning(nbytes: int) -> bool:
    """Can ``nbytes`` of page-locked host memory be allocated (GPU hosts only)?"""
    try:
        buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    except RuntimeError as exc:
        log.warning("pinning %s of host memory failed (%s)", format_size(nbytes), exc)
        return False
    del buf
    return True


def forward_share_of(samples: Sequence[LayerSample]) -> float:
    """The forward's share of forward+backward: time-weighted over the sweep (the long runs
    that dominate a step weigh most), clamped to (0, 1)."""
    total = sum(x.seconds for x in samples)
    share = sum(x.forward_seconds for x in samples) / total if total > 0 else 1.0 / 3.0
    return min(max(share, 0.05), 0.95)


# -------------------------------------------------------------------------------- profile
def build_profile(
    model: str,
    hardware: str,
    seq_lens: Sequence[int],
    device: str = "auto",
    dtype: str = "auto",
    backend: str = "auto",
    repeats: int = 3,
    copy_bytes: int | None = None,
    p2p_bytes: int = 64 << 20,
    measure_on_this_rank: bool = True,
    pp: int = 1,
    host_memory: int | None = None,
    host_memory_share: float = HOST_MEMORY_SHARE,
    pin_probe: int = 1 << 30,
) -> dict:
    """Measure and return the profile mapping (CostModel fields + ``source`` + ``notes``)."""
    from .layer_stack import LayerStack, default_backend

    spec = ModelSpec.load(model)
    hw = HardwareSpec.load(hardware)
    analytic = CostModel.analytic(spec, hw, pp=pp)  # layers per stage; the layer is measured at TP 1
    dev = torch.device(
        "cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device)
    )
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for but torch sees no GPU: use --device cpu")
    dtype_name = dtype if dtype != "auto" else ("bf16" if dev.type == "cuda" else "fp32")
    if dtype_name not in DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}: choose one of auto, {', '.join(DTYPES)}")
    backend = default_backend() if backend == "auto" else backend
    if repeats < 1:
        raise ConfigError(f"--repeats must be at least 1, got {repeats}")
    if len(set(seq_lens)) < 3:
        raise ConfigError(f"--seq-lens needs at least three different lengths to fit T(s), got {list(seq_lens)}")
    copy_bytes = copy_bytes or (256 << 20 if dev.type == "cuda" else 64 << 20)

    values = asdict(analytic)
    source = {f.name: f"analytic ({spec.name} on {hw.name})" for f in fields(CostModel)}
    notes: dict = {
        "model": spec.name,
        "hardware": hw.name,
        "device": str(dev),
        "dtype": dtype_name,
        "backend": backend,
        "torch": torch.__version__,
        "host": platform.node(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "layer": "one transformer layer, forward + backward, batch 1, causal attention",
        "threads": torch.get_num_threads(),
        "tensor_parallel": 1,
        "pipeline_stages": pp,
    }
    if backend == "megatron":  # every rank: building megatron's parallel state is collective
        from .layer_stack import ensure_megatron_parallel

        ensure_megatron_parallel()
    p2p = measure_p2p(p2p_bytes, device=dev if dev.type == "cuda" else None)
    if p2p is not None:
        values["bw_intra_node"], values["p2p_latency_s"] = p2p
        source["bw_intra_node"] = source["p2p_latency_s"] = MEASURED
        notes["p2p_bytes"] = p2p_bytes
    if not measure_on_this_rank:
        return {**values, "source": source, "notes": notes}

    torch.manual_seed(0)
    stack = LayerStack(model, 1, backend=backend, dtype=DTYPES[dtype_name], device=dev)
    samples = measure_layer(stack, seq_lens, repeats=repeats)
    lens = [x.seq_len for x in samples]
    a1, b1, g, r2_time = fit_layer_time(lens, [x.seconds for x in samples])
    a2, b2, r2_act = fit_activation_model(lens, [x.act_bytes for x in samples])
    if r2_time < 0.9:
        log.warning(
            "layer timings fit T(s) poorly (R^2 = %.3f): the machine is probably busy; rerun with more "
            "--repeats, longer --seq-lens or on an idle machine",
            r2_time,
        )
    d2h, h2d, pinned = measure_copy_bandwidth(dev, copy_bytes, repeats=repeats)
    values.update(a1=a1, b1=b1, g=g, a2=a2, b2=b2, bw_d2h=d2h, bw_h2d=h2d, forward_share=forward_share_of(samples))
    for name in ("a1", "b1", "g", "a2", "b2", "bw_d2h", "bw_h2d", "forward_share"):
        source[name] = MEASURED
    if host_memory is not None:
        values["host_memory_bytes"] = float(host_memory)
        source["host_memory_bytes"] = "given (--host-memory-per-gpu)"
    else:
        gpus = torch.cuda.device_count() if dev.type == "cuda" else hw.gpus_per_node
        values["host_memory_bytes"] = host_memory_per_gpu(gpus, host_memory_share)
        source["host_memory_bytes"] = f"{MEASURED}: {host_memory_share:g} of host RAM over {gpus} GPUs"
        if dev.type == "cuda" and not probe_pinning(min(pin_probe, int(values["host_memory_bytes"]))):
            values["host_memory_bytes"] = 0.0  # nothing can be pinned: the planner must not offload
            source["host_memory_bytes"] = f"{MEASURED}: pinning {format_size(pin_probe)} failed"
        notes["host_ram_bytes"] = host_ram_bytes()
    notes.update(
        seq_lens=lens,
        layer_seconds=[x.seconds for x in samples],
        forward_seconds=[x.forward_seconds for x in samples],
        act_bytes=[x.act_bytes for x in samples],
        saved_bytes=[x.saved_bytes for x in samples],
        fit_r2={"layer_time": r2_time, "act": r2_act},
        copy_bytes=copy_bytes,
        copies="pinned host <-> device"
        if pinned
        else ("host memcpy" if dev.type == "cpu" else "pageable host <-> device"),
        analytic={"a1": analytic.a1, "b1": analytic.b1, "g": analytic.g, "a2": analytic.a2, "b2": analytic.b2},
    )
    return {**values, "source": source, "notes": notes}


def write_profile(profile: dict, path: str | Path) -> CostModel:
    """Write ``profile`` as JSON and read it back through ``CostModel.from_profile``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile, indent=2) + "\n")
    return CostModel.from_profile(path)
