"""Stacks of transformer layers of a model's shape, for profiling and offload checks.

Two backends build the same LLaMA-style layer (RMSNorm, GQA self-attention with RoPE, SwiGLU
MLP, no biases) for a model of ``configs/models`` (or a ``ModelSpec``):

* ``"megatron"``: megatron-core's ``TransformerLayer`` exactly as HDP training builds it
  (``megatron.model.transformer_config`` from the model's args file, the HDP local layer spec
  with ring attention as core attention, Megatron's RoPE table); each forward runs inside an
  active micro-batch of one whole sequence (a ring of one: the local attention path);
* ``"torch"``: the same layer in plain torch with torch's fused causal attention, for machines
  without megatron-core (the GPU check machine has none).

Layers take and return ``[s, b, h]`` hidden states, as Megatron's do.
"""

from __future__ import annotations

import os

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
        q.permute(1, 2, 0, 3),
        k.permute(1, 2, 0, 3),
        v.permute(1, 2, 0, 3),
        is_causal=True,
        scale=scale,
        enable_gqa=k.shape[2] != hq,
    )
    return out.permute(2, 0, 1, 3).reshape(s, b, hq * d)


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
    """megatron-core layers need Megatron's parallel state: a one-rank gloo world if no world
    exists (``bytescale profile`` run directly), then ``megatron.parallel.init_parallel()``."""
    import torch.distributed as dist

    from ..megatron import parallel

    if not dist.is_initialized():
        from ..local_world import free_port

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
    parallel.init_parallel()


def build_megatron_layers(model: str | ModelSpec, num_layers: int, dtype: torch.dtype):
    """``num_layers`` HDP TransformerLayers of ``model`` and Megatron's RoPE module for them."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.spec_utils import build_module

    from ..megatron.layer_spec import hdp_gpt_layer_spec
    from ..megatron.model import load_model, transformer_config

    ensure_megatron_parallel()
    spec, arch = load_model(model)
    config = transformer_config(spec, arch, dtype=dtype, num_layers=num_layers)
    layer_spec = hdp_gpt_layer_spec(normalization=arch.normalization)
    layers = [build_module(layer_spec, config=config, layer_number=i + 1) for i in range(num_layers)]
    rotary = RotaryEmbedding(
        kv_channels=spec.kv_channels,
        rotary_percent=arch.rotary_percent,
        rotary_base=arch.rotary_base,
        use_cpu_initialization=True,
    )
    return layers, rotary


class LayerStack(nn.Module):
    """``num_layers`` transformer layers of ``model`` run in sequence on ``[s, 1, h]`` hidden
    states (one whole causal sequence)."""

    def __init__(
        self,
        model: str | ModelSpec,
        num_layers: int,
        backend: str = "torch",
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        seed: int = 0,
    ):
        super().__init__()
        spec = model if isinstance(model, ModelSpec) else ModelSpec.load(model)
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
        self.rotary = None
        torch.manual_seed(seed)
        if backend == "megatron":  # megatron draws weights on the CPU (use_cpu_initialization)
            layers, self.rotary = build_megatron_layers(model, num_layers, dtype)
        else:
            with torch.device(device):  # initialise where the layers will run: fast on a GPU
                layers = [LlamaLayer(spec) for _ in range(num_layers)]
        self.layers = nn.ModuleList(layers).to(device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, num_layers: int | None = None) -> torch.Tensor:
        """Run the first ``num_layers`` layers (all by default)."""
        if self.backend == "torch":
            freqs = rope_freqs(x.shape[0], self.spec.kv_channels, device=x.device)
            for layer in self.layers[:num_layers]:
                x = layer(x, rotary_pos_emb=freqs)
            return x
        from ..megatron import parallel
        from ..megatron.rotary import true_position_emb
        from ..planner.contract import MicroBatch, Piece
        from ..runtime.context import active_micro_batch
        from ..runtime.layout import MicroBatchLayout

        s = x.shape[0]
        rank = parallel.hdp_rank()
        layout = MicroBatchLayout.from_micro_batch(MicroBatch((Piece(0, s, ((0, s),), (rank,)),)), rank)
        positions = torch.arange(s)
        freqs = true_position_emb(self.rotary, positions).to(x.device)
        with active_micro_batch(layout, positions):
            for layer in self.layers[:num_layers]:
                x, _ = layer(x, attention_mask=None, rotary_pos_emb=freqs)
        return x


def default_backend() -> str:
    """megatron-core where it is installed, plain torch elsewhere."""
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        return "torch"
    return "megatron"
