"""The cost model of a CPU run: the shipped CPU profile, carried to the run's model.

``configs/profiles/tiny-cpu.json`` was measured by ``bytescale profile`` on a CPU (fp32, one
thread per rank, gloo between local processes) for the tiny model. A CPU run's planner
should predict CPU seconds, not an H100's: for the profiled model the profile is used as it
is; for another model its measured rates carry over in proportion to the analytic counts
(seconds per attention pair per FLOP of a pair, seconds per token per FLOP of the linear
layers, activation and KV bytes per token), the per-layer overhead, copy and P2P bandwidths
as measured (two-level attention stays off, as in the profile: one CPU "node"). A run that
wants better passes its own profile (``--hdp-profile``).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from .cost_model import CostModel
from .specs import HardwareSpec, ModelSpec

CPU_PROFILE = Path(__file__).resolve().parent.parent / "configs" / "profiles" / "tiny-cpu.json"
PROFILED_MODEL = "tiny"  # what CPU_PROFILE measured (its notes.model)
# the analytic counts are hardware-independent ratios here; any spec gives the same ones
_REFERENCE_HARDWARE = "h200"


def cpu_cost_model(model: ModelSpec, tp: int = 1, pp: int = 1, ranks_per_core: float = 1.0) -> CostModel:
    """The CPU profile's cost model for ``model`` split over ``tp`` x ``pp`` (the profile
    itself for the profiled model at TP 1, PP 1). The profile gave each rank a core of its
    own; where ``ranks_per_core`` > 1 ranks share the cores (4 ranks on 2 cores), and every
    second of compute takes that many."""
    measured = CostModel.from_profile(CPU_PROFILE)
    hw = HardwareSpec.load(_REFERENCE_HARDWARE)
    profiled = CostModel.analytic(ModelSpec.load(PROFILED_MODEL), hw)
    target = CostModel.analytic(model, hw, tp=tp, pp=pp)

    def scaled(name: str) -> float:
        return getattr(measured, name) * getattr(target, name) / getattr(profiled, name)

    share = max(1.0, float(ranks_per_core))
    return replace(
        measured,
        a1=scaled("a1") * share,
        b1=scaled("b1") * share,
        g=measured.g * share,
        a2=scaled("a2"),
        kv_bytes_per_token=scaled("kv_bytes_per_token"),
        grad_bytes_per_token=scaled("grad_bytes_per_token"),
        num_layers=target.num_layers,
        flops_per_token_linear=target.flops_per_token_linear,
        flops_per_token_pair=target.flops_per_token_pair,
        grad_bytes_per_gpu=target.grad_bytes_per_gpu,
        moe_a2a_bytes_per_token=target.moe_a2a_bytes_per_token * 2,  # fp32 on CPU, the analytic count is bf16
    )
