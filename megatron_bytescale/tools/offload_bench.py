"""Memory saved and throughput kept by activation offloading, per token count and ratio.

The logic of ``scripts/gpu/check_offload.py`` (GPU) lives here so that the CPU tests run it on
a tiny model. On a GPU, memory is ``torch.cuda.max_memory_allocated`` (all of it: weights,
gradients, activations, workspace); everywhere, the offloader's own accounting
(``peak_resident_bytes``: saved activations held on the device) is reported alongside.
"""

from __future__ import annotations

import gc
import logging
import math
import time
from collections.abc import Sequence

import torch

from ..local_world import available_memory
from ..planner.contract import resident_fraction
from ..planner.specs import ModelSpec
from ..runtime.offload import ActivationOffloader
from .layer_stack import LayerStack

log = logging.getLogger(__name__)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_offload(
    stack: LayerStack,
    offloader: ActivationOffloader,
    tokens: int,
    ratio: float,
    num_layers: int | None = None,
    repeats: int = 2,
    warmup: int = 1,
) -> dict:
    """Forward+backward of ``tokens`` tokens through the first ``num_layers`` layers of
    ``stack`` with ``offloader`` at ``ratio``: best time, peak memory, offload statistics."""
    param = next(stack.parameters())
    device, dtype = param.device, param.dtype
    cuda = device.type == "cuda"
    x = torch.randn(tokens, 1, stack.spec.hidden_size, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)
    best, peak, baseline = math.inf, 0, 0
    for i in range(warmup + repeats):
        stack.zero_grad(set_to_none=False)  # gradients stay allocated: part of the baseline
        x.grad = None
        _sync(device)
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
            baseline = torch.cuda.memory_allocated(device)
        start = time.perf_counter()
        with offloader.micro_batch(ratio):
            out = stack(x, num_layers)
        out.backward(grad)
        del out
        _sync(device)
        elapsed = time.perf_counter() - start
        if i >= warmup:
            best = min(best, elapsed)
            if cuda:
                peak = max(peak, torch.cuda.max_memory_allocated(device))
    stats = offloader.last_stats()
    return {
        "tokens": tokens,
        "ratio": ratio,
        "layers": len(offloader.layers),
        "seconds": best,
        "tokens_per_s": tokens / best,
        "peak_memory_bytes": peak if cuda else None,
        "baseline_memory_bytes": baseline if cuda else None,
        "peak_resident_bytes": stats.peak_resident_bytes,
        "offloaded_bytes": stats.offloaded_bytes,
        "reloaded_bytes": stats.reloaded_bytes,
        "achieved_ratio": stats.achieved_ratio,
        "late_reloads": stats.late_reloads,
        "pinned": stats.pinned,
        "host_pool_bytes": offloader.pool.capacity_bytes,
    }


def compare_to_baseline(rows: Sequence[dict]) -> list[dict]:
    """Add savings relative to ratio 0 at the same token count (rows must include ratio 0)."""
    base = {r["tokens"]: r for r in rows if r["ratio"] == 0.0}
    out = []
    for row in rows:
        b = base.get(row["tokens"])
        row = dict(row)
        if b is not None:
            row["resident_saved"] = 1.0 - row["peak_resident_bytes"] / b["peak_resident_bytes"]
            row["throughput_change"] = row["tokens_per_s"] / b["tokens_per_s"] - 1.0
            if row["peak_memory_bytes"] is not None:
                row["memory_saved"] = 1.0 - row["peak_memory_bytes"] / b["peak_memory_bytes"]
                act, act0 = (r["peak_memory_bytes"] - r["baseline_memory_bytes"] for r in (row, b))
                row["activation_memory_saved"] = 1.0 - act / act0 if act0 > 0 else 0.0
        # what the same ratio keeps on a full pipeline stage (design 2.4's D(s) formula)
        row["full_model_resident_fraction"] = (
            resident_fraction(row["achieved_ratio"], row["model_layers"]) if "model_layers" in row else None
        )
        out.append(row)
    return out


def act_bytes_per_token(stack: LayerStack, tokens: int = 1024) -> float:
    """Device bytes one layer of ``stack`` holds for backward per token (a short forward)."""
    probe = ActivationOffloader(stack.layers[:1], keep_last=1, min_tensor_bytes=0)
    param = next(stack.parameters())
    x = torch.randn(tokens, 1, stack.spec.hidden_size, device=param.device, dtype=param.dtype, requires_grad=True)
    try:
        with probe.micro_batch(0.0):
            out = stack(x, 1)
        held = probe.last_stats().layers[0].held_bytes
        del out
    finally:
        probe.remove()
    return held / tokens


def layers_that_fit(
    act_per_token: float, tokens: int, keep_last: int, max_layers: int, device_budget: float, host_budget: float
) -> int:
    """The most layers (at least ``keep_last + 1``) whose activations fit the device at ratio
    0 and whose offloadable part fits host memory at ratio 1; 0 when not even that fits."""
    per_layer = act_per_token * tokens
    for n in range(max_layers, keep_last, -1):
        if n * per_layer <= device_budget and (n - keep_last) * per_layer <= host_budget:
            return n
    return 0


def run_offload_check(
    model: str = "llama-7b",
    tokens_list: Sequence[int] = (16384, 65536, 131072),
    ratios: Sequence[float] = (0.0, 0.5, 1.0),
    layers: int | None = None,
    max_layers: int = 8,
    device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    backend: str = "torch",
    keep_last: int = 2,
    min_tensor_bytes: int = 1 << 20,
    repeats: int = 2,
    warmup: int = 1,
    device_budget: float | None = None,
    host_budget: float | None = None,
) -> dict:
    """Measure every (tokens, ratio); ``layers=None`` picks per token count the most layers
    (up to ``max_layers``) that fit the device at ratio 0 and the host at ratio 1."""
    spec = ModelSpec.load(model)
    dev = torch.device(device)
    if 0.0 not in ratios:
        ratios = (0.0, *ratios)
    n_build = layers or max_layers
    t0 = time.perf_counter()
    stack = LayerStack(spec, n_build, backend=backend, dtype=dtype, device=dev)
    log.info("built %d %s layers of %s in %.1f s", n_build, backend, spec.name, time.perf_counter() - t0)
    per_token = act_bytes_per_token(stack)
    weights = sum(p.numel() * p.element_size() for p in stack.parameters())
    if device_budget is None:
        total = torch.cuda.get_device_properties(dev).total_memory if dev.type == "cuda" else 8 << 30
        device_budget = 0.8 * (total - 2 * weights)  # weights + gradients stay; workspace needs room
    if host_budget is None:
        host_budget = 0.35 * (available_memory() or 16 << 30)  # torch's pinned allocator rounds up to powers of two
    rows, skipped = [], []
    for tokens in tokens_list:
        n = layers or layers_that_fit(per_token, tokens, keep_last, max_layers, device_budget, host_budget)
        while True:
            if n <= keep_last:
                skipped.append(
                    {
                        "tokens": tokens,
                        "reason": f"{keep_last + 1} layers of {per_token * tokens / 2**30:.1f} "
                        "GiB activations each do not fit the memory budgets",
                    }
                )
                break
            try:
                rows.extend(
                    _measure_ratios(stack, spec, tokens, ratios, n, keep_last, min_tensor_bytes, repeats, warmup)
                )
                break
            except torch.cuda.OutOfMemoryError:  # the estimate missed some workspace: one layer fewer
                log.warning("%d tokens on %d layers ran out of device memory; retrying with %d", tokens, n, n - 1)
            gc.collect()  # the failed attempt's tensors, freed with its traceback
            torch.cuda.empty_cache()
            n -= 1
    return {
        "model": spec.name,
        "backend": backend,
        "device": str(dev) if dev.type != "cuda" else torch.cuda.get_device_name(dev),
        "dtype": str(dtype).removeprefix("torch."),
        "keep_last": keep_last,
        "act_bytes_per_token_per_layer": per_token,
        "weights_bytes": weights,
        "torch": torch.__version__,
        "rows": compare_to_baseline(rows),
        "skipped": skipped,
        "paper": "at 64K tokens, r=0.5 saved about 32% of memory with no throughput loss (ByteScale, 2.4)",
    }


def _measure_ratios(stack, spec, tokens, ratios, n, keep_last, min_tensor_bytes, repeats, warmup) -> list[dict]:
    rows = []
    offloader = ActivationOffloader(stack.layers[:n], keep_last=keep_last, min_tensor_bytes=min_tensor_bytes)
    try:
        for ratio in ratios:
            row = measure_offload(stack, offloader, tokens, ratio, num_layers=n, repeats=repeats, warmup=warmup)
            offloader.pool.trim()  # each ratio splits tensors differently: its buffers are not reused
            row["model_layers"] = spec.num_layers
            rows.append(row)
            log.info(
                "%6d tokens, r=%.2f, %d layers: %.3f s, peak %s, resident peak %.2f GiB",
                tokens,
                ratio,
                n,
                row["seconds"],
                f"{row['peak_memory_bytes'] / 2**30:.2f} GiB" if row["peak_memory_bytes"] else "n/a",
                row["peak_resident_bytes"] / 2**30,
            )
    finally:
        offloader.remove()
        offloader.pool.trim()
    return rows
