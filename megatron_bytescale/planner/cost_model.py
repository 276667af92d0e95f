"""The cost model every planning and simulation decision is made with (design 2.4, 2.8).

Per transformer layer on one rank (one TP shard):

    T(s)   = a1*s^2 + b1*s + g     forward+backward seconds for s tokens of one causal sequence
    Act(s) = a2*s + b2             activation bytes kept for backward

plus what a ring pass moves per token and layer (KV heads only, GQA), the PCIe copy
bandwidths for offloading, and the P2P bandwidths. Coefficients come analytically from a
ModelSpec and HardwareSpec, or from a profile file measured by ``bytescale profile``.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from ..errors import ConfigError
from .specs import HardwareSpec, ModelSpec, _typed_fields, load_mapping

BF16_BYTES = 2
FP32_BYTES = 4
FORWARD_SHARE = 1.0 / 3.0  # backward costs about twice the forward


@dataclass(frozen=True)
class CostModel:
    a1: float  # s / token^2 (causal attention, forward+backward)
    b1: float  # s / token (projections, MLP, norms)
    g: float  # s per layer per micro-batch (launches, small ops)
    a2: float  # activation bytes / token
    b2: float  # activation bytes per layer per micro-batch
    num_layers: int  # layers on one pipeline stage (l)
    kv_bytes_per_token: float  # K and V of the KV heads, per layer: what a ring hop carries forward
    grad_bytes_per_token: float  # dK and dV accumulators (fp32), per layer: what a backward hop adds
    bw_d2h: float  # bytes/s
    bw_h2d: float
    bw_intra_node: float  # P2P bytes/s between GPUs of one node
    bw_inter_node: float  # P2P bytes/s between nodes
    p2p_latency_s: float = 2e-5
    # pinned host bytes one GPU may fill with offloaded activations (inf: no budget given)
    host_memory_bytes: float = math.inf
    # share of a layer's forward+backward time spent in the forward: device-to-host copies
    # hide behind the forward only, host-to-device copies behind the backward only
    forward_share: float = FORWARD_SHARE
    flops_per_token_linear: float = 0.0  # informational: FLOPs/token/layer outside attention
    flops_per_token_pair: float = 0.0  # informational: FLOPs per causal query-key pair per layer

    # ------------------------------------------------------------- formulas
    def layer_time(self, tokens: float, attention_pairs: float | None = None) -> float:
        """Seconds for one layer, forward+backward. ``attention_pairs`` defaults to one causal
        sequence of ``tokens`` (s^2 in the a1 term); pass sum(s_i^2) for a pack, s^2/N for a
        zigzag share of a ring of N."""
        pairs = tokens * tokens if attention_pairs is None else attention_pairs
        return self.a1 * pairs + self.b1 * tokens + self.g

    def act_bytes(self, tokens: float) -> float:
        return self.a2 * tokens + self.b2

    def hop_time(self, tokens: float, inter_node: bool, backward: bool = False) -> float:
        """One ring hop moving the KV (and in backward also dKV) of ``tokens`` tokens, one layer."""
        per_token = self.kv_bytes_per_token + (self.grad_bytes_per_token if backward else 0.0)
        bw = self.bw_inter_node if inter_node else self.bw_intra_node
        return self.p2p_latency_s + tokens * per_token / bw

    # ---------------------------------------------------------- construction
    @classmethod
    def analytic(cls, model: ModelSpec, hw: HardwareSpec, tp: int = 1, pp: int = 1) -> CostModel:
        """Coefficients from FLOP and byte counts (bf16 weights and activations, flash-style
        attention with no s^2 activations, sequence parallelism dividing activations by TP)."""
        if tp <= 0 or pp <= 0:
            raise ConfigError(f"TP and PP must be positive, got TP={tp}, PP={pp}")
        if model.num_layers % pp:
            raise ConfigError(f"{model.name}: {model.num_layers} layers do not split into {pp} pipeline stages")
        if model.num_query_groups % tp and tp % model.num_query_groups:
            raise ConfigError(f"{model.name}: {model.num_query_groups} KV heads cannot be split over TP={tp}")
        h, q, kv, f = model.hidden_size, model.query_size, model.kv_size, model.ffn_hidden_size
        mlp_mats = 3 if model.swiglu else 2
        experts = model.active_experts
        # forward FLOPs per token: QKV, output projection, (router), MLP of each active expert
        linear = 2 * (h * (q + 2 * kv) + q * h + experts * mlp_mats * h * f) + 2 * h * model.num_experts
        pair = 2 * 2 * q  # QK^T and PV per query-key pair; the causal half is in pairs = s^2/2
        flops = hw.flops * tp
        # activation elements kept per token: attention block (norm input, QKV input, Q, K, V,
        # attention output = projection input) and each active MLP (norm input, fc1 input,
        # fc1 output, fc2 input); no dropout masks, no s^2 scores (flash-style attention)
        act = BF16_BYTES * ((2 * h + 2 * q + 2 * kv) + experts * (2 * h + mlp_mats * f))
        kv_heads_per_shard = max(1, model.num_query_groups // tp)
        kv_shard = kv_heads_per_shard * model.kv_channels
        return cls(
            a1=3 * pair / 2 / flops,
            b1=3 * linear / flops,
            g=hw.layer_overhead_s,
            a2=act / tp,
            b2=0.0,
            num_layers=model.num_layers // pp,
            kv_bytes_per_token=2 * kv_shard * BF16_BYTES,
            grad_bytes_per_token=2 * kv_shard * FP32_BYTES,
            bw_d2h=hw.bw_d2h,
            bw_h2d=hw.bw_h2d,
            bw_intra_node=hw.bw_intra_node,
            bw_inter_node=hw.bw_inter_node,
            p2p_latency_s=hw.p2p_latency_s,
            host_memory_bytes=hw.host_memory_bytes,
            flops_per_token_linear=3 * linear / tp,
            flops_per_token_pair=3 * pair / 2 / tp,
        )

    # -------------------------------------------------------------- profiles
    @classmethod
    def from_profile(cls, path: str | Path) -> CostModel:
        """Read a profile (YAML or JSON) written by ``bytescale profile`` or by hand."""
        data = load_mapping(path)
        data = {k: v for k, v in data.items() if k not in ("source", "notes")}
        return cls(**_typed_fields(cls, data, f"profile {path}"))

    def to_profile(self, path: str | Path, source: str = "") -> None:
        data = asdict(self)
        if source:
            data["source"] = source
        Path(path).write_text(json.dumps(data, indent=2) + "\n")

    def with_overrides(self, **changes) -> CostModel:
        return replace(self, **changes)

    def describe(self) -> str:
        s = 8192
        return (
            f"T(8K)={self.layer_time(s) * 1e3:.2f} ms/layer, Act(8K)={self.act_bytes(s) / 2**30:.2f} GiB/layer, "
            f"{self.num_layers} layers, KV {self.kv_bytes_per_token:.0f} B/token/layer, "
            f"PCIe {self.bw_d2h / 1e9:.0f}/{self.bw_h2d / 1e9:.0f} GB/s, P2P {self.bw_intra_node / 1e9:.0f}/{self.bw_inter_node / 1e9:.0f} GB/s"
        )
