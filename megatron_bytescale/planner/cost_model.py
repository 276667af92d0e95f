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

import numpy as np

from ..errors import ConfigError
from .jit import jitable
from .specs import HardwareSpec, ModelSpec, _typed_fields, load_mapping

BF16_BYTES = 2
FP32_BYTES = 4
FORWARD_SHARE = 1.0 / 3.0  # backward costs about twice the forward
# the latent ring's re-expansion of a received block: one GEMM in the forward; in the backward
# the GEMM again (K and V are not kept) and its two gradient GEMMs (the latent's, the weight's)
EXPAND_PASSES = 4
EXPAND_FORWARD_SHARE = 1.0 / EXPAND_PASSES
RECOMPUTE_FIELDS = ("recomputed_layers", "recomputed_attention_layers")  # set by with_recompute, not profiles


@jitable
def layer_seconds(a1, b1, g, tokens, pairs, forward_share, recomputed, recomputed_attention, layers):
    """The cost formula: seconds of one layer, forward and backward, on one rank, of ``tokens``
    tokens with ``pairs`` causal attention pairs: ``a1 * pairs + b1 * tokens + g``, plus the
    forwards activation recompute runs again (``recompute_seconds``; its arguments are
    ``CostModel.recompute``). Every time the planner and the simulator give a layer's work
    comes from here: ``CostModel.layer_time`` in Python, a direct call inside the planner's
    kernels (a ``@jitable`` helper, compiled into them). Scalars or numpy arrays."""
    rest = recompute_seconds(a1, b1, g, tokens, pairs, forward_share, recomputed, recomputed_attention, layers)
    return a1 * pairs + b1 * tokens + g + rest


@jitable
def recompute_seconds(a1, b1, g, tokens, pairs, forward_share, recomputed, recomputed_attention, layers):
    """The part of ``layer_seconds`` that activation recompute adds (0 without it): the
    forward share of the attention of the ``recomputed_attention`` layers and of the linear
    work of the ``recomputed`` ones, averaged over the stage's ``layers``."""
    if not recomputed_attention:
        return 0.0
    return forward_share * (a1 * pairs * recomputed_attention + (b1 * tokens + g) * recomputed) / layers


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
    o_bytes_per_token: float = 0.0  # the attention output's heads, when not q's size (MLA's v head dim); 0: q's
    # MoE (planner/expert/timing.py): bytes one token's routed hidden states take in one
    # all-to-all of one layer (top-k x hidden, bf16); 0: a dense model
    moe_a2a_bytes_per_token: float = 0.0
    # multi-latent attention's latent ring (Piece.transport "latent"; 0: the model has none):
    # what a hop carries per token and layer (the latent and rotary key, bf16), what the
    # backward's accumulator adds, and the seconds a member spends re-expanding one received
    # token's K and V with the up-projection, forward and backward together (a fourth of it
    # in the forward: the GEMM; the backward runs it again and both of its gradient GEMMs)
    latent_bytes_per_token: float = 0.0
    latent_grad_bytes_per_token: float = 0.0
    expand_s_per_token: float = 0.0

    def ring_bytes(self, transport: str = "kv") -> tuple[float, float]:
        """(bytes a forward hop carries, bytes the backward's accumulator adds) per token and
        layer for a ring carrying ``transport``."""
        if transport == "kv":
            return self.kv_bytes_per_token, self.grad_bytes_per_token
        if transport == "latent" and self.latent_bytes_per_token > 0:
            return self.latent_bytes_per_token, self.latent_grad_bytes_per_token
        raise ConfigError(
            f"ring transport {transport!r}: this cost model has no such ring (the latent ring needs a "
            "multi-latent attention model)"
        )

    @property
    def ring_transports(self) -> tuple[str, ...]:
        """The ring transports this model can run."""
        return ("kv", "latent") if self.latent_bytes_per_token > 0 else ("kv",)

    # ------------------------------------------------------------- formulas
    def layer_time(self, tokens: float, attention_pairs: float | None = None) -> float:
        """Seconds for one layer, forward+backward (``layer_seconds``). ``attention_pairs``
        defaults to one causal sequence of ``tokens`` (s^2 in the a1 term); pass sum(s_i^2) for
        a pack, s^2/N for a zigzag share of a ring of N."""
        pairs = tokens * tokens if attention_pairs is None else attention_pairs
        return layer_seconds(self.a1, self.b1, self.g, tokens, pairs, *self.recompute)

    def recompute_time(self, tokens: float, attention_pairs: float) -> float:
        """Seconds per layer (stage average) of the forwards activation recompute runs again in
        backward; 0 without recompute. Included in ``layer_time``."""
        return recompute_seconds(self.a1, self.b1, self.g, tokens, attention_pairs, *self.recompute)

    @property
    def recompute(self) -> tuple[float, int, int, int]:
        """``layer_seconds``' recompute arguments: forward share, layers recomputed whole,
        layers whose attention is recomputed, layers."""
        return self.forward_share, self.recomputed_layers, self.recomputed_attention_layers, self.num_layers

    def short_time(self, tokens, capacity: int):
        """Seconds (all layers) of a whole sequence of ``tokens <= capacity`` before packing
        decides its micro-batch: ``layer_seconds`` with a pro-rata share ``tokens / capacity``
        of the micro-batch's fixed cost ``g``, with the recompute of its layers."""
        share = self.g * tokens / capacity
        return self.num_layers * layer_seconds(self.a1, self.b1, share, tokens, tokens * tokens, *self.recompute)

    def compute_bound(self, seq_lens, ranks: int) -> float:
        """Seconds (one stage) if the attention and linear work of every sequence, whole, were
        spread perfectly over ``ranks``: a bound, not a layer's time (``layer_seconds`` less its
        per-micro-batch ``g``, and no recompute, communication or offloading)."""
        s = np.asarray(seq_lens, dtype=np.float64)
        return float(self.num_layers * np.sum(self.a1 * s * s + self.b1 * s)) / ranks

    def act_bytes(self, tokens: float) -> float:
        return self.a2 * tokens + self.b2

    def hop_time(self, tokens: float, inter_node: bool, backward: bool = False, transport: str = "kv") -> float:
        """One ring hop moving the KV (and in backward also dKV) of ``tokens`` tokens, one layer
        (``transport`` "latent": the latent and its gradient instead)."""
        fwd, grad = self.ring_bytes(transport)
        per_token = fwd + (grad if backward else 0.0)
        bw = self.bw_inter_node if inter_node else self.bw_intra_node
        return self.p2p_latency_s + tokens * per_token / bw

    def ring_layer_time(self, seq_len, ring_size, inter_node, transport: str = "kv", attention_pairs=None):
        """Seconds of one layer, forward and backward, of one sequence alone on a zigzag ring of
        ``ring_size`` > 1 members (even blocks of ``seq_len / ring_size``), by the timeline's
        rules: the linear part, then the ring steps, each as long as its attention (and a latent
        ring's re-expansion of the block it received) or the hop beside it, whichever is longer;
        backward ends with the accumulators' hop home. Arrays broadcast (``inter_node``: hops
        over the network). For a pack of sequences, ``seq_len`` is their tokens and
        ``attention_pairs`` the sum of their squares (default ``seq_len^2``)."""
        n = np.asarray(ring_size, dtype=float)
        b = seq_len / n
        pairs = seq_len * seq_len if attention_pairs is None else attention_pairs
        fs, bs = self.forward_share, 1.0 - self.forward_share
        # layer_seconds' terms apart: the attention per member per step ((s^2 / N) / N pairs), the linear part
        attn = self.a1 * pairs / (n * n)
        bw = np.where(inter_node, self.bw_inter_node, self.bw_intra_node)
        width, grad = self.ring_bytes(transport)
        hop_f = self.p2p_latency_s + b * width / bw
        hop_b = self.p2p_latency_s + b * (width + grad) / bw
        tail = self.p2p_latency_s + b * grad / bw
        lin = self.b1 * b + self.g
        step_f = fs * attn + self.expand_time(b, False, transport)  # steps 1..N-1 attend a received block
        step_b = bs * attn + self.expand_time(b, True, transport)
        middle = (n - 2).clip(0)
        fwd = fs * lin + np.maximum(fs * attn, hop_f) + np.maximum(step_f, hop_f) * middle + step_f
        bwd = bs * lin + np.maximum(bs * attn, hop_b) + np.maximum(step_b, hop_b) * middle + step_b + tail
        return fwd + bwd

    def cheaper_transport(self, seq_len: int, ring_size: int, inter_node: bool, attention_pairs=None) -> str:
        """The ring transport under which this ring runs its sequences fastest (``ring_layer_time``;
        K and V on a tie, and for a model without a latent ring)."""
        times = {
            t: float(self.ring_layer_time(seq_len, ring_size, inter_node, t, attention_pairs))
            for t in self.ring_transports
        }
        return min(self.ring_transports, key=lambda t: (times[t], t != "kv"))

    def expand_time(self, tokens, backward: bool = False, transport: str = "latent"):
        """Seconds one latent-ring member spends re-expanding ``tokens`` received tokens in one
        layer's forward (``backward``: the backward's share); 0 for a K/V ring."""
        if transport != "latent":
            return 0.0 * tokens
        share = 1.0 - EXPAND_FORWARD_SHARE if backward else EXPAND_FORWARD_SHARE
        return share * self.expand_s_per_token * tokens

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
        if model.num_query_groups % tp and tp % model.num_query_groups:
            raise ConfigError(f"{model.name}: {model.num_query_groups} KV heads cannot be split over TP={tp}")
        if model.is_mla and model.num_attention_heads % tp:
            raise ConfigError(f"{model.name}: {model.num_attention_heads} heads cannot be split over TP={tp}")
        shape = layer_shape(model)
        h, heads = model.hidden_size, model.num_attention_heads
        flops = hw.flops * tp
        # forward FLOPs per token and layer (a layer-average: MoE and dense layers, MTP depths):
        # attention projections, router, MLPs; per causal query-key pair QK^T and PV
        linear = 2 * (shape["attention_params"] + shape["mlp_macs"] + shape["extra_macs"])
        pair = 2 * heads * (model.k_head_dim + model.v_dim)  # the causal half is in pairs = s^2/2
        # activation elements kept per token: attention block (norm input, QKV input, Q, K, V,
        # attention output = projection input; MLA's latents) and each active MLP (norm input,
        # fc1 input, fc1 output, fc2 input); no dropout masks, no s^2 scores (flash-style attention)
        act_whole = BF16_BYTES * (2 * h + shape["latent_values"] + shape["mlps"] * 2 * h)  # what SP shards
        qkvo = 2 * heads * (model.k_head_dim + model.v_dim) if model.is_mla else 2 * (model.query_size + model.kv_size)
        act_heads = BF16_BYTES * (qkvo + shape["mlp_act"])  # what TP shards anyway
        values = model.ring_values_per_token(tp)
        grad_bytes = BF16_BYTES if dkv_bf16 else FP32_BYTES
        # parameters per GPU: its TP shard of its stage's layers, plus an even share of the
        # input embedding and output layer (first and last stage hold them)
        params = (shape["params"] + 2 * model.vocab_size * h) / (tp * pp)
        r_expand = model.kv_lora_rank * heads * (model.qk_head_dim + model.v_dim) if model.is_mla else 0
        return cls(
            a1=3 * pair / 2 / flops,
            b1=3 * linear / flops,
            g=hw.layer_overhead_s,
            a2=(act_whole + act_heads) / tp if sequence_parallel else act_whole + act_heads / tp,
            b2=0.0,
            num_layers=stage_layers(model, pp),
            kv_bytes_per_token=values["kv"] * BF16_BYTES,
            grad_bytes_per_token=values["kv"] * grad_bytes,
            latent_bytes_per_token=float(values.get("latent", 0) * BF16_BYTES),
            latent_grad_bytes_per_token=float(values.get("latent", 0) * grad_bytes),
            expand_s_per_token=EXPAND_PASSES * 2 * r_expand / flops,
            bw_d2h=hw.bw_d2h,
            bw_h2d=hw.bw_h2d,
            bw_intra_node=hw.bw_intra_node,
            bw_inter_node=hw.bw_inter_node,
            p2p_latency_s=hw.p2p_latency_s,
            host_memory_bytes=hw.host_memory_bytes,
            flops_per_token_linear=3 * linear / tp,
            flops_per_token_pair=3 * pair / 2 / tp,
            grad_bytes_per_gpu=FP32_BYTES * params,
            q_heads=max(1, heads // tp),
            kv_heads=max(1, model.num_query_groups // tp),
            q_bytes_per_token=max(1, heads // tp) * model.k_head_dim * BF16_BYTES,
            o_bytes_per_token=max(1, heads // tp) * model.v_dim * BF16_BYTES if model.is_mla else 0.0,
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


def layer_shape(model: ModelSpec) -> dict[str, float]:
    """Per token, averaged over the layers a token passes (the model's and its MTP depths),
    what one layer holds: ``attention_params`` (the attention projections' weights, = their
    multiply-adds per token), ``mlp_macs`` (the active MLPs' and the router's), ``extra_macs``
    (an MTP depth's projection of [embedding, hidden] to hidden), ``mlps`` (MLPs a token passes
    through), ``mlp_act`` (their kept widths), ``latent_values`` (MLA's latents) and ``params``
    (every layer's weights together, MLPs of every expert)."""
    h, heads, mats = model.hidden_size, model.num_attention_heads, 3 if model.swiglu else 2
    if model.is_mla:
        rq, r, dr = model.q_lora_rank, model.kv_lora_rank, model.qk_pos_emb_head_dim
        q_proj = h * rq + rq * heads * model.k_head_dim if rq else h * heads * model.k_head_dim
        attention = q_proj + h * (r + dr) + r * heads * (model.qk_head_dim + model.v_dim) + heads * model.v_dim * h
        latents = rq + r + dr
    else:
        attention = h * (model.query_size + 2 * model.kv_size) + model.query_size * h
        latents = 0
    layers = model.attention_layers
    f = model.ffn_hidden_size
    if model.num_experts:
        fe, fs = model.moe_ffn_hidden_size or f, model.moe_shared_expert_size
        moe = model.num_layers - model.dense_layers + model.mtp_num_layers  # an MTP depth is a MoE layer
        dense = layers - moe
        k = model.moe_router_topk
        mlp_macs = (moe * (mats * h * (k * fe + fs) + h * model.num_experts) + dense * mats * h * f) / layers
        mlps = (moe * (k + (1 if fs else 0)) + dense) / layers
        mlp_act = (moe * mats * (k * fe + fs) + dense * mats * f) / layers
        mlp_params = moe * mats * h * (model.num_experts * fe + fs) + dense * mats * h * f
    else:
        mlp_macs, mlps, mlp_act, mlp_params = mats * h * f, 1, mats * f, layers * mats * h * f
    extra = model.mtp_num_layers * 2 * h * h
    return {
        "attention_params": attention,
        "mlp_macs": mlp_macs,
        "extra_macs": extra / layers,
        "mlps": mlps,
        "mlp_act": mlp_act,
        "latent_values": latents,
        "params": layers * (attention + 2 * h) + mlp_params + extra,
    }


def stage_layers(model: ModelSpec, pp: int) -> int:
    """Layers on one pipeline stage. The model's layers split evenly, as Megatron requires
    without an uneven layout; its MTP depths run on the last stage, which every stage is
    costed as (the fullest stage sets the pipelines' pace)."""
    if model.num_layers % pp:
        raise ConfigError(f"{model.name}: {model.num_layers} layers do not split into {pp} pipeline stages")
    return model.num_layers // pp + model.mtp_num_layers
