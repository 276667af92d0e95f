"""The cost model every planning and simulation decision is made with (design 2.4, 2.8).

Per transformer layer on one rank (one TP shard):

    T(s)   = a1*s^2 + b1*s + g     forward+backward seconds for s tokens of one causal sequence
    Act(s) = a2*s + b2             activation bytes kept for backward

plus what a ring pass moves per token and layer (KV heads only, GQA), the PCIe copy
bandwidths for offloading, and the P2P bandwidths. Coefficients come analytically from a
ModelSpec and HardwareSpec, or from a profile file measured by ``bytescale profile``.

Activation recompute (``with_recompute``): of the ``l`` layers, ``recomputed_layers`` are
recomputed whole (Megatron's full granularity: the first ``n`` with the block method, all with
uniform); they keep no activations (only their input, not counted) and run their forward
twice. ``recomputed_attention_layers`` run their core attention forward twice (those layers,
or every layer with selective ``core_attn``), ring hops included. ``layer_time`` is then the
per-layer average over the stage: the attention term grows by ``FORWARD_SHARE * m / l``, the
linear terms by ``FORWARD_SHARE * k / l`` (``recompute_time``: that extra, all of it in
backward). ``Act`` stays the per-layer bytes of a layer that keeps its
activations; ``activation_layers = l - k`` of them do. Selective ``core_attn`` frees almost
nothing under flash-style attention (the attention output is kept anyway as the output
projection's input; only the fp32 log-sum-exp goes), so it changes time, not ``Act``.
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
RECOMPUTE_FIELDS = ("recomputed_layers", "recomputed_attention_layers")  # set by with_recompute, not profiles


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
    grad_bytes_per_gpu: float = 0.0  # fp32 gradients one GPU reduces over its HDP group per step (0: unknown)
    recomputed_layers: int = 0  # k: layers recomputed whole (keep no activations)
    recomputed_attention_layers: int = 0  # m >= k: layers whose attention forward (and ring) runs twice

    @property
    def activation_layers(self) -> int:
        """Layers that keep their activations for backward: what capacity and offloading concern."""
        return self.num_layers - self.recomputed_layers

    @property
    def recompute_attention_share(self) -> float:
        """m / l: the share of layers whose ring forward runs again in backward."""
        return self.recomputed_attention_layers / self.num_layers if self.num_layers else 0.0

    # two-level attention (planner/sizing/two_level.py): the heads of one TP shard, and what the head
    # all-to-all moves per token and layer for the queries (bf16); 0 heads: two-level off
    q_heads: int = 0
    kv_heads: int = 0
    q_bytes_per_token: float = 0.0
    # MoE (planner/expert/timing.py): bytes one token's routed hidden states take in one
    # all-to-all of one layer (top-k x hidden, bf16); 0: a dense model
    moe_a2a_bytes_per_token: float = 0.0

    # ------------------------------------------------------------- formulas
    def layer_time(self, tokens: float, attention_pairs: float | None = None) -> float:
        """Seconds for one layer, forward+backward. ``attention_pairs`` defaults to one causal
        sequence of ``tokens`` (s^2 in the a1 term); pass sum(s_i^2) for a pack, s^2/N for a
        zigzag share of a ring of N."""
        pairs = tokens * tokens if attention_pairs is None else attention_pairs
        return self.a1 * pairs + self.b1 * tokens + self.g + self.recompute_time(tokens, pairs)

    def recompute_time(self, tokens: float, attention_pairs: float) -> float:
        """Seconds per layer (stage average) of the forwards activation recompute runs again in
        backward; 0 without recompute. Included in ``layer_time``."""
        if not self.recomputed_attention_layers:
            return 0.0
        l = self.num_layers
        attn, rest = self.a1 * attention_pairs, self.b1 * tokens + self.g
        return self.forward_share * (attn * self.recomputed_attention_layers + rest * self.recomputed_layers) / l

    def act_bytes(self, tokens: float) -> float:
        return self.a2 * tokens + self.b2

    def hop_time(self, tokens: float, inter_node: bool, backward: bool = False) -> float:
        """One ring hop moving the KV (and in backward also dKV) of ``tokens`` tokens, one layer."""
        per_token = self.kv_bytes_per_token + (self.grad_bytes_per_token if backward else 0.0)
        bw = self.bw_inter_node if inter_node else self.bw_intra_node
        return self.p2p_latency_s + tokens * per_token / bw

    # ---------------------------------------------------------- construction
    @classmethod
    def analytic(
        cls,
        model: ModelSpec,
        hw: HardwareSpec,
        tp: int = 1,
        pp: int = 1,
        sequence_parallel: bool = True,
        dkv_bf16: bool = False,
    ) -> CostModel:
        """Coefficients from FLOP and byte counts (bf16 weights and activations, flash-style
        attention with no s^2 activations). With ``sequence_parallel`` (Megatron's companion of
        TP) every activation is divided by TP; without it the four hidden-size activations per
        layer (both norms' inputs, the QKV and fc1 inputs) stay whole on every TP rank.
        ``dkv_bf16``: the backward's dK/dV accumulators travel in bf16 (else fp32)."""
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
        act_whole = BF16_BYTES * (2 * h + experts * 2 * h)  # what sequence parallelism shards
        act_heads = BF16_BYTES * ((2 * q + 2 * kv) + experts * mlp_mats * f)  # sharded by TP anyway
        kv_heads_per_shard = max(1, model.num_query_groups // tp)
        # parameters per GPU: its TP shard of its stage's layers, plus an even share of the
        # input embedding and output layer (first and last stage hold them)
        layer_params = h * (q + 2 * kv) + q * h + max(1, model.num_experts) * mlp_mats * h * f + 2 * h
        params = (model.num_layers * layer_params + 2 * model.vocab_size * h) / (tp * pp)
        kv_shard = kv_heads_per_shard * model.kv_channels
        return cls(
            a1=3 * pair / 2 / flops,
            b1=3 * linear / flops,
            g=hw.layer_overhead_s,
            a2=(act_whole + act_heads) / tp if sequence_parallel else act_whole + act_heads / tp,
            b2=0.0,
            num_layers=model.num_layers // pp,
            kv_bytes_per_token=2 * kv_shard * BF16_BYTES,
            grad_bytes_per_token=2 * kv_shard * (BF16_BYTES if dkv_bf16 else FP32_BYTES),
            bw_d2h=hw.bw_d2h,
            bw_h2d=hw.bw_h2d,
            bw_intra_node=hw.bw_intra_node,
            bw_inter_node=hw.bw_inter_node,
            p2p_latency_s=hw.p2p_latency_s,
            host_memory_bytes=hw.host_memory_bytes,
            flops_per_token_linear=3 * linear / tp,
            flops_per_token_pair=3 * pair / 2 / tp,
            grad_bytes_per_gpu=FP32_BYTES * params,
            q_heads=max(1, model.num_attention_heads // tp),
            kv_heads=kv_heads_per_shard,
            q_bytes_per_token=max(1, model.num_attention_heads // tp) * model.kv_channels * BF16_BYTES,
            moe_a2a_bytes_per_token=(
                model.moe_router_topk * h * BF16_BYTES / (tp if sequence_parallel else 1) if model.num_experts else 0.0
            ),
        )

    # -------------------------------------------------------------- profiles
    @classmethod
    def from_profile(cls, path: str | Path) -> CostModel:
        """Read a profile (YAML or JSON) written by ``bytescale profile`` or by hand."""
        data = load_mapping(path)
        data = {k: v for k, v in data.items() if k not in ("source", "notes")}
        run_config = sorted(k for k in RECOMPUTE_FIELDS if data.pop(k, 0))
        if run_config:
            raise ConfigError(
                f"profile {path}: {run_config} describe a run's recompute flags, not the hardware: drop them "
                "(a profile is measured without recompute; the flags apply it with with_recompute)"
            )
        return cls(**_typed_fields(cls, data, f"profile {path}"))

    def to_profile(self, path: str | Path, source: str = "") -> None:
        data = asdict(self)
        if source:
            data["source"] = source
        Path(path).write_text(json.dumps(data, indent=2) + "\n")

    def with_overrides(self, **changes) -> CostModel:
        return replace(self, **changes)

    def with_recompute(
        self,
        granularity: str | None,
        method: str | None = None,
        num_layers: int | None = None,
        modules: tuple[str, ...] | list[str] | None = None,
    ) -> CostModel:
        """This model under Megatron's activation recompute flags (``--recompute-granularity``,
        ``--recompute-method``, ``--recompute-num-layers``, ``--recompute-modules``), from one
        without recompute (see the module docstring for what changes)."""
        if self.recomputed_layers or self.recomputed_attention_layers:
            raise ConfigError("this cost model already includes activation recompute; apply with_recompute once")
        l = self.num_layers
        if granularity in (None, "none"):
            return self
        if granularity == "full":
            if method == "uniform":
                k = l
            elif method == "block":
                if num_layers is None or num_layers < 0:
                    raise ConfigError(f"--recompute-method block needs --recompute-num-layers >= 0, got {num_layers}")
                k = min(num_layers, l)
            else:
                raise ConfigError(
                    f"--recompute-granularity full needs --recompute-method uniform or block, got {method!r}"
                )
            m = k
        elif granularity == "selective":
            modules = ("core_attn",) if modules is None else modules  # megatron-core's default
            k, m = 0, (l if "core_attn" in modules else 0)
        else:
            raise ConfigError(f"--recompute-granularity {granularity!r}: expected full or selective")
        return replace(self, recomputed_layers=k, recomputed_attention_layers=m)

    def describe(self) -> str:
        s = 8192
        return (
            f"T(8K)={self.layer_time(s) * 1e3:.2f} ms/layer, Act(8K)={self.act_bytes(s) / 2**30:.2f} GiB/layer, "
            f"{self.num_layers} layers, KV {self.kv_bytes_per_token:.0f} B/token/layer, "
            f"PCIe {self.bw_d2h / 1e9:.0f}/{self.bw_h2d / 1e9:.0f} GB/s, P2P "
            f"{self.bw_intra_node / 1e9:.0f}/{self.bw_inter_node / 1e9:.0f} GB/s"
        )
