"""Stacks of transformer layers of a model's shape, for profiling and offload checks.

Two backends build the same LLaMA-style layer (RMSNorm, GQA self-attention with RoPE, SwiGLU
MLP, no biases) for a ``ModelSpec``:

* ``"megatron"``: megatron-core's ``TransformerLayer`` from its local spec, with a flash-style
  core attention (``SDPACoreAttention``: torch's fused causal attention, which saves O(s) for
  backward, as flash-attn and our ring attention do, instead of the local spec's s x s scores);
* ``"torch"``: the same layer in plain torch, for machines without megatron-core (the GPU
  check machine has none).

Layers take and return ``[s, b, h]`` hidden states, as Megatron's do.
"""

from __future__ import annotations

import os
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from ..planner.specs import ModelSpec

BACKENDS = ("megatron", "torch")
ROPE_BASE = 10000.0
NORM_EPS = 1e-5


def rope_freqs(seq_len: int, dim: int, device=None) -> torch.Tensor:
    """Rotary angles in Megatron's layout ``[s, 1, 1, dim]`` (non-interleaved halves)."""
    inv = 1.0 / (ROPE_BASE ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv)
    return torch.cat((angles, angles), dim=-1)[:, None, None, :]


def apply_rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [s, b, n, d] by ``freqs`` [s, 1, 1, d] (rotate-half convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x * freqs.cos() + rotated * freqs.sin()).to(x.dtype)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Causal GQA attention: q [s, b, hq, d], k/v [s, b, hkv, d] -> [s, b, hq*d]."""
    s, b, hq, d = q.shape
    out = F.scaled_dot_product_attention(
        q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3),
        is_causal=True, scale=scale, enable_gqa=k.shape[2] != hq,
    )
    return out.permute(2, 0, 1, 3).reshape(s, b, hq * d)


class SDPACoreAttention(nn.Module):
    """Megatron ``core_attention`` submodule (DotProductAttention's interface) computing causal
    attention with torch's fused kernel. Causal masking only: no attention mask, no packing."""

    def __init__(self, config, layer_number: int, attn_mask_type=None, attention_type: str = "self",
                 attention_dropout=None, softmax_scale=None, cp_comm_type=None, pg_collection=None):
        super().__init__()
        self.config = config
        self.softmax_scale = softmax_scale

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is not None or attention_bias is not None:
            raise ConfigError("SDPACoreAttention computes plain causal attention: no packed sequences or bias")
        return causal_attention(query, key, value, self.softmax_scale)


class LlamaLayer(nn.Module):
    """Plain-torch transformer layer of ``spec``'s shape (same math as the Megatron backend)."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        h, f = spec.hidden_size, spec.ffn_hidden_size
        self.spec = spec
        self.input_norm = nn.RMSNorm(h, eps=NORM_EPS)
        self.qkv = nn.Linear(h, spec.query_size + 2 * spec.kv_size, bias=False)
        self.proj = nn.Linear(spec.query_size, h, bias=False)
        self.mlp_norm = nn.RMSNorm(h, eps=NORM_EPS)
        self.fc1 = nn.Linear(h, 2 * f if spec.swiglu else f, bias=False)
        self.fc2 = nn.Linear(f, h, bias=False)

    def forward(self, x: torch.Tensor, rotary_pos_emb: torch.Tensor | None = None) -> torch.Tensor:
        spec = self.spec
        s, b, _ = x.shape
        q, k, v = self.qkv(self.input_norm(x)).split([spec.query_size, spec.kv_size, spec.kv_size], dim=-1)
        q = q.reshape(s, b, spec.num_attention_heads, spec.kv_channels)
        k = k.reshape(s, b, spec.num_query_groups, spec.kv_channels)
        v = v.reshape(s, b, spec.num_query_groups, spec.kv_channels)
        if rotary_pos_emb is not None:
            q, k = apply_rope(q, rotary_pos_emb), apply_rope(k, rotary_pos_emb)
        x = x + self.proj(causal_attention(q, k, v))
        y = self.fc1(self.mlp_norm(x))
        if spec.swiglu:
            gate, up = y.chunk(2, dim=-1)
            y = F.silu(gate) * up
        else:
            y = F.gelu(y)
        return x + self.fc2(y)


def ensure_megatron_parallel() -> None:
    """megatron-core layers need its parallel state: a one-rank gloo world if none exists."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        from ..local_world import free_port

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)


def megatron_config(spec: ModelSpec, num_layers: int, dtype: torch.dtype):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        kv_channels=spec.kv_channels,
        ffn_hidden_size=spec.ffn_hidden_size,
        gated_linear_unit=spec.swiglu,
        activation_func=F.silu if spec.swiglu else F.gelu,
        normalization="RMSNorm",
        layernorm_epsilon=NORM_EPS,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=True,
    )


def build_megatron_layers(spec: ModelSpec, num_layers: int, dtype: torch.dtype) -> list[nn.Module]:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    ensure_megatron_parallel()
    layer_spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    layer_spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    config = megatron_config(spec, num_layers, dtype)
    return [build_module(layer_spec, config=config, layer_number=i + 1) for i in range(num_layers)]


class LayerStack(nn.Module):
    """``num_layers`` transformer layers run in sequence on ``[s, b, h]`` hidden states."""

    def __init__(self, spec: ModelSpec, num_layers: int, backend: str = "torch",
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", seed: int = 0):
        super().__init__()
        if backend not in BACKENDS:
            raise ConfigError(f"unknown layer backend {backend!r}: choose one of {', '.join(BACKENDS)}")
        if spec.num_experts:
            raise ConfigError(
                f"model {spec.name!r} is a mixture of experts: layer stacks build dense layers only; "
                "use the analytic cost model (bytescale profile measures dense models)"
            )
        if num_layers < 1:
            raise ConfigError(f"a layer stack needs at least one layer, got {num_layers}")
        self.spec = spec
        self.backend = backend
        torch.manual_seed(seed)
        if backend == "megatron":  # megatron initialises on the CPU (use_cpu_initialization)
            layers: Sequence[nn.Module] = build_megatron_layers(spec, num_layers, dtype)
        else:
            with torch.device(device):  # initialise where the layers will run: fast on a GPU
                layers = [LlamaLayer(spec) for _ in range(num_layers)]
        self.layers = nn.ModuleList(layers).to(device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, num_layers: int | None = None) -> torch.Tensor:
        """Run the first ``num_layers`` layers (all by default)."""
        freqs = rope_freqs(x.shape[0], self.spec.kv_channels, device=x.device)
        for layer in self.layers[:num_layers]:
            if self.backend == "megatron":
                x, _ = layer(x, attention_mask=None, rotary_pos_emb=freqs)
            else:
                x = layer(x, rotary_pos_emb=freqs)
        return x


def default_backend() -> str:
    """megatron-core where it is installed, plain torch elsewhere."""
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        return "torch"
    return "megatron"
