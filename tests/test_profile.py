"""`bytescale profile`: fits, measured activation bytes fed back to the cost model, the profile
file's round trip through CostModel.from_profile, P2P on two ranks, and the GPU offload
check's shared logic run on CPU."""

import json
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_bytescale.errors import BytescaleError, ConfigError
from megatron_bytescale.local_world import run_local_world
from megatron_bytescale.planner.cost_model import CostModel
from megatron_bytescale.planner.specs import HardwareSpec, ModelSpec
from megatron_bytescale.runtime.offload import ActivationOffloader
from megatron_bytescale.tools import offload_bench, profiler
from megatron_bytescale.tools.layer_stack import LayerStack

from gpu_scripts import load_gpu_script


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny tensors: one torch thread is faster than two fighting over a shared CPU."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ------------------------------------------------------------------------------- fits
@settings(max_examples=30, deadline=None)
@given(
    a1=st.floats(1e-12, 1e-6),
    b1=st.floats(1e-9, 1e-3),
    g=st.floats(0.0, 1e-2),
)
def test_layer_time_fit_recovers_coefficients(a1, b1, g):
    s = [256, 512, 1024, 4096, 16384]
    t = [a1 * x * x + b1 * x + g for x in s]
    fa1, fb1, fg, r2 = profiler.fit_layer_time(s, t)
    fitted = [fa1 * x * x + fb1 * x + fg for x in s]
    assert fitted == pytest.approx(t, rel=1e-7)
    assert r2 == pytest.approx(1.0)
    # each coefficient is recovered wherever its term is visible in the measurements; the fit's
    # round-off (~1e-7 of t) reaches a coefficient amplified by 1 / its term's share of t
    for got, want, term in ((fa1, a1, [a1 * x * x for x in s]), (fb1, b1, [b1 * x for x in s]), (fg, g, [g] * 5)):
        visible = max(p / q for p, q in zip(term, t))
        if visible > 1e-3:
            assert got == pytest.approx(want, rel=max(1e-5, 1e-6 / visible))


def test_fits_never_return_negative_coefficients():
    # a decreasing-then-flat curve would need g < 0 by plain least squares
    s = np.array([100, 200, 400, 800])
    t = 1e-6 * s - 5e-5
    coef = profiler.fit_nonnegative(np.stack([s * s, s, np.ones(4)], 1).astype(float), t)
    assert np.all(coef >= 0) and coef[2] == 0.0
    assert profiler.fit_activation_model([1, 2, 3], [10.0, 20.0, 30.0])[:2] == pytest.approx((10.0, 0.0), abs=1e-9)
    with pytest.raises(BytescaleError, match="at least 3 different sequence lengths"):
        profiler.fit_layer_time([128, 128, 256], [1.0, 1.0, 2.0])
    with pytest.raises(BytescaleError, match="must be positive"):
        profiler.fit_activation_model([1, 2], [0.0, 1.0])


# ---------------------------------------------- offload accounting -> Act(s) coefficients
@pytest.fixture(scope="module")
def act_samples():
    stack = LayerStack(ModelSpec.load("tiny"), 3, backend="torch", seed=0)
    off = ActivationOffloader(stack.layers, keep_last=1, min_tensor_bytes=0)
    samples = []
    for tokens, ratio in ((64, 0.0), (128, 0.5), (256, 1.0)):
        x = torch.randn(tokens, 1, 64, requires_grad=True)
        with off.micro_batch(ratio):
            out = stack(x)
        out.sum().backward()
        samples.append((tokens, off.last_stats()))
    off.remove()
    return samples


def test_act_coefficients_from_offload_stats_and_check(act_samples):
    a2, b2 = profiler.act_coefficients(act_samples)
    per_token = [profiler.layer_activation_bytes(stats) / tokens for tokens, stats in act_samples]
    assert a2 == pytest.approx(per_token[0], rel=1e-9) and b2 == pytest.approx(0.0, abs=1e-6)
    assert per_token[0] == per_token[1] == per_token[2]  # linear in tokens, whatever the ratio
    analytic = CostModel.analytic(ModelSpec.load("tiny"), HardwareSpec.load("h200"))
    measured = replace(analytic, a2=a2, b2=b2)
    assert profiler.check_act_coefficients(measured, act_samples) == pytest.approx(0.0, abs=1e-9)
    # the analytic model assumes bf16 and fused norms: far from this fp32 layer
    with pytest.raises(BytescaleError, match=r"Act\(64\) = .* predicted.*bytescale profile"):
        profiler.check_act_coefficients(analytic, act_samples)


def test_act_needs_a_layer_that_kept_everything():
    stack = LayerStack(ModelSpec.load("tiny"), 2, backend="torch", seed=0)
    off = ActivationOffloader(stack.layers, keep_last=0, min_tensor_bytes=0)
    with off.micro_batch(0.5):
        out = stack(torch.randn(32, 1, 64, requires_grad=True))
    out.sum().backward()
    with pytest.raises(BytescaleError, match="measure with ratio 0 or keep_last >= 1"):
        profiler.layer_activation_bytes(off.last_stats())


# -------------------------------------------------------------------- the profile file
def test_profile_round_trips_through_cost_model(tmp_path):
    prof = profiler.build_profile(
        "tiny", "h800", [32, 64, 128, 256], backend="torch", repeats=1, copy_bytes=1 << 20, pp=2
    )
    cost = profiler.write_profile(prof, tmp_path / "p.json")
    assert asdict(cost) == {k: v for k, v in prof.items() if k not in ("source", "notes")}
    assert cost.a2 > 0 and cost.bw_d2h > 0 and cost.bw_h2d > 0  # (timings on a shared CPU: no claim)
    assert len(prof["notes"]["layer_seconds"]) == 4 and min(prof["notes"]["layer_seconds"]) > 0
    src = prof["source"]
    assert {k for k, v in src.items() if v == "measured"} == {
        "a1",
        "b1",
        "g",
        "a2",
        "b2",
        "bw_d2h",
        "bw_h2d",
        "forward_share",
    }
    assert 0 < cost.forward_share < 1
    # the host RAM share: half of this host's RAM over the H800 spec's 8 GPUs (no GPU here)
    assert src["host_memory_bytes"].startswith("measured: 0.5 of host RAM over 8 GPUs")
    assert cost.host_memory_bytes == pytest.approx(0.5 * profiler.host_ram_bytes() / 8)
    assert src["bw_inter_node"].startswith("analytic") and "H800" in src["bw_inter_node"]
    assert cost.num_layers == 2  # tiny's 4 layers over 2 pipeline stages
    assert (
        cost.kv_bytes_per_token
        == CostModel.analytic(ModelSpec.load("tiny"), HardwareSpec.load("h800")).kv_bytes_per_token
    )
    # Act(s) measured equals the held bytes the sweep recorded
    for s, act in zip(prof["notes"]["seq_lens"], prof["notes"]["act_bytes"]):
        assert cost.act_bytes(s) == pytest.approx(act, rel=1e-6)


def test_host_memory_per_gpu_and_forward_share():
    assert profiler.host_memory_per_gpu(8, 0.5, ram=2 * 10**12) == pytest.approx(125e9)
    assert profiler.host_memory_per_gpu(4, 0.25, ram=10**12) == pytest.approx(62.5e9)
    with pytest.raises(ConfigError, match="--host-memory-share must be in"):
        profiler.host_memory_per_gpu(8, 1.5)
    # time-weighted: 1 ms of 3 and 10 ms of 25 -> 11 / 28
    samples = [profiler.LayerSample(64, 3e-3, 1e-3, 0, 0), profiler.LayerSample(128, 25e-3, 10e-3, 0, 0)]
    assert profiler.forward_share_of(samples) == pytest.approx(11 / 28)
    prof = profiler.build_profile(
        "tiny", "h200", [32, 64, 96], backend="torch", repeats=1, copy_bytes=1 << 16, host_memory=64 << 30
    )
    assert prof["host_memory_bytes"] == float(64 << 30)
    assert prof["source"]["host_memory_bytes"].startswith("given")


def test_malformed_profiles_are_rejected(tmp_path):
    prof = profiler.build_profile("tiny", "h200", [32, 64, 96], backend="torch", repeats=1, copy_bytes=1 << 16)
    path = tmp_path / "p.json"
    bad = dict(prof)
    del bad["a1"]
    path.write_text(json.dumps(bad))
    with pytest.raises(ConfigError, match="required field 'a1' is missing"):
        CostModel.from_profile(path)
    bad = dict(prof, a2=-1.0)
    path.write_text(json.dumps(bad))
    with pytest.raises(ConfigError, match="field 'a2' must be positive"):
        CostModel.from_profile(path)
    path.write_text("[1, 2, 3]")
    with pytest.raises(ConfigError, match="expected a mapping"):
        CostModel.from_profile(path)


def test_profile_input_errors():
    with pytest.raises(ConfigError, match="at least three different lengths"):
        profiler.build_profile("tiny", "h200", [64, 64, 128], backend="torch")
    with pytest.raises(ConfigError, match="unknown dtype"):
        profiler.build_profile("tiny", "h200", [32, 64, 128], dtype="int8", backend="torch")
    with pytest.raises(ConfigError, match="mixture of experts"):
        profiler.build_profile("mistral-8x7b", "h200", [32, 64, 128], backend="torch")
    with pytest.raises(ConfigError, match="pipeline stages"):
        profiler.build_profile("tiny", "h200", [32, 64, 128], backend="torch", pp=3)
    with pytest.raises(ConfigError, match="unknown model"):
        profiler.build_profile("gpt-9", "h200", [32, 64, 128], backend="torch")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="sees no GPU"):
            profiler.build_profile("tiny", "h200", [32, 64, 128], device="cuda", backend="torch")


def _cli_profile(rank, world_size, out):
    """`bytescale profile` end to end on megatron-core layers (each rank a gloo process)."""
    from megatron_bytescale.cli import main

    code = main(
        ["profile", "--model", "tiny", "--seq-lens", "32,64,128", "--repeats", "1", "--copy-bytes", "1M", "--out", out]
    )
    return code


def test_profile_command_writes_a_profile_the_planner_reads(tmp_path):
    out = str(tmp_path / "tiny.json")
    assert run_local_world(_cli_profile, 1, out, timeout_s=180) == [0]
    data = json.loads(Path(out).read_text())
    assert data["notes"]["backend"] == "megatron"
    cost = CostModel.from_profile(out)
    assert cost.a2 == pytest.approx(data["a2"]) and cost.num_layers == 4


def test_profile_command_reports_bad_lengths(capsys):
    from megatron_bytescale.cli import main

    assert main(["profile", "--seq-lens", "64,lots", "--backend", "torch"]) == 2
    assert "cannot read sequence length 'lots'" in capsys.readouterr().err


def _p2p(rank, world_size):
    return profiler.measure_p2p(1 << 20, repeats=2)


def test_p2p_bandwidth_between_two_ranks():
    (bw0, lat0), (bw1, lat1) = run_local_world(_p2p, 2, timeout_s=120, threads_per_rank=1)
    assert bw0 == bw1 > 0 and lat0 == lat1 > 0  # rank 0's measurement, broadcast
    assert profiler.measure_p2p(1024) is None  # no second rank in this process


# ------------------------------------------------ GPU offload check: shared logic on CPU
def test_offload_check_logic_on_cpu():
    report = offload_bench.run_offload_check(
        model="tiny",
        tokens_list=[128, 256],
        ratios=[0.5, 1.0],
        layers=4,
        device="cpu",
        dtype=torch.float32,
        backend="torch",
        min_tensor_bytes=0,
        repeats=1,
        warmup=0,
    )
    rows = report["rows"]
    assert [(r["tokens"], r["ratio"]) for r in rows] == [(t, r) for t in (128, 256) for r in (0.0, 0.5, 1.0)]
    for t in (128, 256):
        saved = [r["resident_saved"] for r in rows if r["tokens"] == t]
        assert saved[0] == 0.0 and 0.2 < saved[1] < saved[2]  # keep_last=2 of 4: at most about half
        assert all(r["late_reloads"] == 0 and r["offloaded_bytes"] == r["reloaded_bytes"] for r in rows)
    assert report["act_bytes_per_token_per_layer"] > 0 and report["skipped"] == []


def test_layers_that_fit():
    fit = offload_bench.layers_that_fit
    assert fit(100.0, 1000, keep_last=2, max_layers=8, device_budget=8e5, host_budget=1e9) == 8
    assert fit(100.0, 1000, keep_last=2, max_layers=8, device_budget=5.5e5, host_budget=1e9) == 5
    assert fit(100.0, 1000, keep_last=2, max_layers=8, device_budget=1e9, host_budget=2e5) == 4
    assert fit(100.0, 1000, keep_last=2, max_layers=8, device_budget=2e5, host_budget=1e9) == 0


def test_gpu_check_script_is_importable_and_refuses_without_a_gpu(capsys):
    module = load_gpu_script("check_offload")
    args = module.parse_args(["--tokens", "4K,16K"])
    assert args.model == "llama-7b" and args.keep_last == 2
    if not torch.cuda.is_available():
        assert module.main([]) == 2
        assert "no GPU" in capsys.readouterr().err
