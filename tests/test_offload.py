"""Selective activation offloading on CPU: exact gradients, accounting, keep_last, thresholds,
errors, pinned-memory fallback, pool reuse, and the same on several gloo ranks."""

import contextlib
import logging
import math

import numpy as np
import pytest
import torch
from torch import nn

from megatron_bytescale.errors import BytescaleError
from megatron_bytescale.local_world import preload, run_local_world
from megatron_bytescale.planner.specs import ModelSpec
from megatron_bytescale.runtime import host_pool
from megatron_bytescale.runtime.offload import ActivationOffloader, _layout, check_ratio, transformer_layers
from megatron_bytescale.tools.layer_stack import LayerStack

preload(["megatron_bytescale.megatron.model"])  # import megatron-core once, in the forkserver

RATIOS = [0.0, 0.3, 0.5, 1.0]
TOKENS = 128


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny tensors: one torch thread is faster than two fighting over a shared CPU."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def stack():
    return LayerStack(ModelSpec.load("tiny"), 4, backend="torch", seed=0)


def _run(stack, offloader=None, ratio=0.0, seed=1, backward_inside=False):
    """Loss, gradients (parameters and input) of one micro-batch, and the offload stats."""
    torch.manual_seed(seed)
    x = torch.randn(TOKENS, 1, stack.spec.hidden_size, requires_grad=True)
    stack.zero_grad(set_to_none=True)
    if offloader is None:
        loss = stack(x * 1.0).square().mean()
        loss.backward()
        stats = None
    else:
        with offloader.micro_batch(ratio):
            loss = stack(x * 1.0).square().mean()
            if backward_inside:
                loss.backward()
        if not backward_inside:
            loss.backward()
        stats = offloader.last_stats()
    grads = [p.grad.clone() for p in stack.parameters()] + [x.grad.clone()]
    return loss.detach(), grads, stats


@pytest.fixture(scope="module")
def reference(stack):
    return _run(stack)


@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize("backward_inside", [False, True])
def test_loss_and_gradients_identical_with_offloading(stack, reference, ratio, backward_inside):
    off = ActivationOffloader(stack.layers, keep_last=2, min_tensor_bytes=0)
    try:
        loss, grads, stats = _run(stack, off, ratio, backward_inside=backward_inside)
    finally:
        off.remove()
    ref_loss, ref_grads, _ = reference
    assert torch.equal(loss, ref_loss)
    assert len(grads) == len(ref_grads)
    for got, want in zip(grads, ref_grads):
        assert torch.equal(got, want)
    assert stats.offloaded_bytes == stats.reloaded_bytes
    assert (stats.offloaded_bytes > 0) == (ratio > 0)
    assert stats.resident_bytes == 0  # backward released every saved tensor
    assert off.pool.in_use_bytes == 0


def test_resident_bytes_fall_as_ratio_grows(stack):
    off = ActivationOffloader(stack.layers, keep_last=2, min_tensor_bytes=0)
    try:
        stats = {r: _run(stack, off, r)[2] for r in RATIOS}
    finally:
        off.remove()
    peaks = [stats[r].peak_resident_bytes for r in RATIOS]
    assert all(a > b for a, b in zip(peaks, peaks[1:])), peaks
    base = stats[0.0]
    layer_bytes = base.layers[0].held_bytes
    assert all(layer.held_bytes == layer_bytes for layer in base.layers)  # identical layers
    outside = base.outside_bytes  # the loss's square() saves the last layer's output
    assert outside == TOKENS * stack.spec.hidden_size * 4
    assert base.peak_resident_bytes == 4 * layer_bytes + outside
    for r in RATIOS:
        st = stats[r]
        for layer in st.layers[:2]:  # offloadable: exactly r of the eligible bytes moved
            assert layer.eligible_bytes == base.layers[0].saved_bytes
            assert abs(layer.offloaded_bytes - r * layer.eligible_bytes) <= 4 * layer.tensors
            assert layer.reloaded_bytes == layer.offloaded_bytes
        assert st.achieved_ratio == pytest.approx(r, abs=1e-3)
        assert st.late_reloads == 0  # every reload ran one layer ahead of its backward
    # ratio 1 keeps only the two last layers' activations at the peak
    assert stats[1.0].peak_resident_bytes == 2 * layer_bytes + outside


@pytest.mark.parametrize("keep_last", [0, 1, 3, 4])
def test_keep_last_layers_stay_on_the_device(stack, keep_last):
    off = ActivationOffloader(stack.layers, keep_last=keep_last, min_tensor_bytes=0)
    try:
        _, _, st = _run(stack, off, 1.0)
    finally:
        off.remove()
    n = len(stack.layers)
    for layer in st.layers:
        kept = layer.index >= n - keep_last
        assert layer.kept_on_device == kept
        assert (layer.offloaded_bytes == 0) == kept
        assert (layer.held_bytes == 0) == (not kept)  # ratio 1: an offloaded layer holds nothing
    # the topmost offloaded layer has no layer above to trigger its prefetch
    assert (st.late_reloads > 0) == (keep_last == 0)


class ToyLayer(nn.Module):
    """Saves, knowingly: its input x and h (n*d each), the weight, and a tiny [n, 1] tensor."""

    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d, bias=False)

    def forward(self, x):
        h = self.lin(x)
        return h * torch.sigmoid(h.sum(-1, keepdim=True))


def test_tiny_tensors_and_parameters_stay():
    n, d = 64, 32
    layers = nn.ModuleList([ToyLayer(d) for _ in range(3)])
    big, tiny = n * d * 4, n * 4
    off = ActivationOffloader(layers, keep_last=1, min_tensor_bytes=tiny + 1)
    x = torch.randn(n, d, requires_grad=True)
    with off.micro_batch(1.0):
        y = x * 1.0
        for layer in layers:
            y = layer(y)
    y.sum().backward()
    st = off.last_stats()
    for layer in st.layers:
        assert layer.tensors == 3  # x, h, sigmoid output; the weight is not counted
        assert layer.saved_bytes == 2 * big + tiny
    for layer in st.layers[:2]:
        assert layer.eligible_bytes == layer.offloaded_bytes == 2 * big  # the tiny one stayed
    assert st.layers[2].eligible_bytes == 0
    # keep predicate: nothing eligible when it says keep
    off2 = ActivationOffloader(layers, keep_last=0, min_tensor_bytes=0, keep=lambda t: True)
    with off2.micro_batch(1.0):
        y = layers[2](layers[1](layers[0](x * 1.0)))
    y.sum().backward()
    assert off2.last_stats().offloaded_bytes == 0


def test_tensors_saved_outside_the_layers_are_counted_but_never_moved():
    layers = nn.ModuleList([ToyLayer(16) for _ in range(3)])
    head = nn.Linear(16, 16, bias=False)
    off = ActivationOffloader(layers, keep_last=0, min_tensor_bytes=0)
    x = torch.randn(32, 16, requires_grad=True)
    with off.micro_batch(1.0):
        y = layers[2](layers[1](layers[0](x * 1.0)))
        out = head(y)  # saves y outside the layers
    out.sum().backward()
    st = off.last_stats()
    assert st.outside_bytes == 32 * 16 * 4
    assert st.offloaded_bytes == sum(layer.saved_bytes for layer in st.layers)


@pytest.mark.parametrize("bad", [-0.1, 1.5, math.nan, "half"])
def test_bad_ratio_names_the_fix(stack, bad):
    off = ActivationOffloader(stack.layers)
    try:
        with pytest.raises(BytescaleError, match=r"outside \[0, 1\]|not a number"):
            with off.micro_batch(bad):
                pass
    finally:
        off.remove()
    assert check_ratio(0) == 0.0 and check_ratio(1) == 1.0


def test_misuse_errors(stack):
    with pytest.raises(BytescaleError, match="needs the model's transformer layers"):
        ActivationOffloader([])
    with pytest.raises(BytescaleError, match="appears twice"):
        ActivationOffloader([stack.layers[0], stack.layers[0]])
    with pytest.raises(BytescaleError, match="keep_last must be 0 or more"):
        ActivationOffloader(stack.layers, keep_last=-1)
    off = ActivationOffloader(stack.layers)
    try:
        with pytest.raises(BytescaleError, match="no micro-batch has run yet"):
            off.last_stats()
        with pytest.raises(BytescaleError, match="already active"):
            with off.micro_batch(0.5):
                with off.micro_batch(0.5):
                    pass
    finally:
        off.remove()
    with pytest.raises(BytescaleError, match="no decoder.layers"):
        transformer_layers(nn.Linear(2, 2))


def test_transformer_layers_unwraps_megatron_wrappers():
    class Decoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.decoder = Decoder()

    class Wrapper(nn.Module):  # DDP / Float16Module keep the model in .module
        def __init__(self, module):
            super().__init__()
            self.module = module

    gpt = GPT()
    assert transformer_layers(Wrapper(Wrapper(gpt))) == list(gpt.decoder.layers)


def test_pinned_memory_unavailable_falls_back_to_pageable(stack, reference, monkeypatch, caplog):
    def no_pinning(nbytes):
        raise RuntimeError("simulated: cudaHostAlloc failed")

    monkeypatch.setattr(host_pool, "allocate_pinned", no_pinning)
    off = ActivationOffloader(stack.layers, min_tensor_bytes=0, pin_memory=True)
    try:
        with caplog.at_level(logging.WARNING, logger="megatron_bytescale.runtime.host_pool"):
            loss, grads, st = _run(stack, off, 0.5)
    finally:
        off.remove()
    assert "pinned host memory is unavailable" in caplog.text and "simulated" in caplog.text
    assert not st.pinned and off.pool.pin_failure == "simulated: cudaHostAlloc failed"
    assert all(torch.equal(a, b) for a, b in zip(grads, reference[1]))
    assert caplog.text.count("pinned host memory is unavailable") == 1  # logged once, not per buffer


def test_pinning_on_a_cpu_only_build_falls_back(caplog):
    if torch.cuda.is_available():
        pytest.skip("this build can pin memory")
    pool = host_pool.HostBufferPool(pin_memory=True)
    with caplog.at_level(logging.WARNING, logger="megatron_bytescale.runtime.host_pool"):
        block = pool.acquire(10_000)
    assert not pool.pinned and block.capacity >= 10_000 and "pageable" in caplog.text


def test_host_pool_is_reused_across_micro_batches(stack):
    off = ActivationOffloader(stack.layers, min_tensor_bytes=0)
    try:
        _run(stack, off, 0.5)
        capacity, allocations = off.pool.capacity_bytes, off.pool.allocations
        assert capacity > 0 and off.pool.in_use_bytes == 0
        for seed in (2, 3):
            _, _, st = _run(stack, off, 0.5, seed=seed)
            assert st.offloaded_bytes > 0
            assert off.pool.capacity_bytes == capacity  # no growth: the same buffers again
            assert off.pool.allocations == allocations
            assert off.pool.in_use_bytes == 0
        assert off.pool.reuses >= 2 * allocations
    finally:
        off.remove()


def test_host_pool_size_classes_and_cache_limit():
    sizes = [1, 4096, 4097, 10_000, 123_457, 1 << 20, (1 << 20) + 1, 987_654_321]
    for n in sizes:
        c = host_pool.size_class(n)
        assert c >= n and c <= max(host_pool.MIN_CLASS_BYTES, n * 1.125 + 4096)
    assert host_pool.size_class(1 << 20) == 1 << 20
    pool = host_pool.HostBufferPool(pin_memory=False, max_cached_bytes=3 * 8192)
    blocks = [pool.acquire(8192) for _ in range(5)]
    assert pool.capacity_bytes == 5 * 8192 and pool.in_use_bytes == 5 * 8192
    for b in blocks:
        pool.release(b)
    assert pool.in_use_bytes == 0 and pool.capacity_bytes == 3 * 8192  # capped
    again = pool.acquire(8000)
    assert pool.reuses == 1 and again.capacity == 8192
    assert again.view(torch.float32, 2000).shape == (2000,)
    pool.release(again)
    assert pool.trim() == 3 * 8192 and pool.capacity_bytes == 0


def test_layout_classifies_saved_tensors():
    base = torch.randn(4, 6, 8)
    assert _layout(base) == ("dense", (48, 8, 1))
    assert _layout(base.permute(2, 0, 1))[0] == "dense"
    kind, stride = _layout(base[..., :4])
    assert kind == "gapped" and stride == (24, 4, 1)
    assert _layout(torch.randn(5, 1).expand(5, 3))[0] == "overlapping"


# ------------------------------------------------------ the CUDA stream protocol, on CPU
def test_cuda_copy_protocol_orders_streams_and_events(stack, reference, monkeypatch):
    """The CUDA copy engine run against recording stand-ins for streams and events: every D2H
    copy waits for the compute stream and protects its source with record_stream; every reload
    waits for its own D2H and the compute stream, and the compute stream waits for each reload
    before using it. Copies themselves are real (CPU tensors), so gradients stay exact."""
    from megatron_bytescale.runtime import offload as offload_mod

    log, ids = [], iter(range(10**6))

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            log.append(("wait_stream", self.name, other.name))

        def wait_event(self, event):
            log.append(("wait_event", self.name, event.id))

    class Event:
        def __init__(self):
            self.id = next(ids)

        def record(self, stream):
            log.append(("record", stream.name, self.id))

    compute, side = Stream("compute"), iter(["d2h", "h2d"])
    current = [compute]

    @contextlib.contextmanager
    def on(stream):
        current.append(stream)
        yield
        current.pop()

    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: Stream(next(side)))
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[-1])
    monkeypatch.setattr(
        torch.Tensor, "record_stream", lambda self, s: log.append(("record_stream", s.name)), raising=False
    )
    off = ActivationOffloader(stack.layers, min_tensor_bytes=0)
    off._engines[torch.device("cpu")] = offload_mod._CudaCopies(torch.device("cpu"))
    try:
        loss, grads, st = _run(stack, off, 0.5)
    finally:
        off.remove()
    assert all(torch.equal(a, b) for a, b in zip(grads, reference[1]))
    d2h = [i for i, e in enumerate(log) if e[:2] == ("record", "d2h")]
    h2d = [i for i, e in enumerate(log) if e[:2] == ("record", "h2d")]
    assert len(d2h) == len(h2d) == sum(layer.tensors for layer in st.layers[:2])  # every tensor split
    for i in d2h:  # each D2H: after the compute stream, source protected until the copy ran
        assert log[i - 1] == ("wait_stream", "d2h", "compute") or log[i - 2] == ("wait_stream", "d2h", "compute")
        assert log[i + 1] == ("record_stream", "d2h")
    d2h_events = {log[i][2] for i in d2h}
    waited = {}
    for i in h2d:  # each reload: after its D2H and the compute stream
        before = log[i - 3 : i]
        assert ("wait_stream", "h2d", "compute") in before
        event = next(e[2] for e in before if e[:2] == ("wait_event", "h2d"))
        assert event in d2h_events
        waited[log[i][2]] = i
    for ev, i in waited.items():  # the compute stream waits for each reload, later
        assert any(e == ("wait_event", "compute", ev) for e in log[i + 1 :])


# ------------------------------------------------------------------ several gloo ranks
def _read(seq_id, start, stop):
    return np.random.default_rng(50 + seq_id).integers(0, 512, size=stop)[start:stop]


def _gpt_offload_matches(rank, world_size, ratios):
    """Megatron GPTModel (HDP layer spec) on 4 gloo ranks, each with its own micro-batch and
    ratio: ranks 0 and 1 share a sequence over a ring (zigzag shares, ring attention P2P in
    forward and backward), ranks 2 and 3 hold whole sequences. The loss and the all-reduced
    gradients must equal those of the same step without offloading, bit for bit."""
    import torch.distributed as dist

    from megatron_bytescale.megatron import model, parallel
    from megatron_bytescale.planner.contract import MicroBatch, Piece
    from megatron_bytescale.planner.contract.zigzag import zigzag_ranges
    from megatron_bytescale.runtime.batch import build_micro_batch_data
    from megatron_bytescale.runtime.context import active_micro_batch
    from megatron_bytescale.runtime.layout import MicroBatchLayout

    parallel.init_parallel()
    gpt = model.build_gpt_model("tiny", seed=5)
    ring = (0, 1)
    pieces = {
        0: [Piece(0, 150, zigzag_ranges(150, 2)[0], ring)],
        1: [Piece(0, 150, zigzag_ranges(150, 2)[1], ring)],
        2: [Piece(1, 50, ((0, 50),), (2,)), Piece(2, 30, ((0, 30),), (2,))],
        3: [Piece(3, 70, ((0, 70),), (3,))],
    }[rank]
    mb = MicroBatch(tuple(pieces), offload_ratio=ratios[rank])
    data = build_micro_batch_data(mb, _read)
    layout = MicroBatchLayout.from_micro_batch(mb, rank)

    def step(offloader=None):
        gpt.zero_grad(set_to_none=True)
        with offloader.micro_batch(mb.offload_ratio) if offloader else contextlib.nullcontext():
            with active_micro_batch(layout, data.positions):
                losses = gpt(data.tokens[None], None, attention_mask=None, labels=data.labels[None])
            loss = (losses[0] * data.loss_mask).sum()
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in gpt.parameters()])
        dist.all_reduce(grads, group=parallel.hdp_group())
        return loss.detach(), grads

    ref_loss, ref = step()
    off = ActivationOffloader(transformer_layers(gpt), keep_last=2, min_tensor_bytes=0)
    loss, got = step(off)
    st = off.last_stats()
    parallel.destroy_parallel()
    return {
        "same_loss": bool(torch.equal(loss, ref_loss)),
        "same_grads": bool(torch.equal(got, ref)),
        "achieved": st.achieved_ratio,
        "moved": st.offloaded_bytes,
        "back": st.reloaded_bytes,
        "late": st.late_reloads,
        "outside": st.outside_bytes,
    }


def test_offloading_a_gpt_on_gloo_ranks_keeps_loss_and_gradients_exact():
    ratios = [0.3, 1.0, 0.5, 0.0]
    results = run_local_world(_gpt_offload_matches, 4, ratios, timeout_s=240, threads_per_rank=1)
    for rank, res in enumerate(results):
        assert res["same_loss"] and res["same_grads"], (rank, res)
        assert res["achieved"] == pytest.approx(ratios[rank], abs=1e-3)
        assert res["moved"] == res["back"] and (res["moved"] > 0) == (ratios[rank] > 0) and res["late"] == 0
        assert res["outside"] > 0  # embedding output and logits: counted, never moved
