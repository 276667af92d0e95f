"""GPT layer specs whose core attention is HDP ring attention.

``hdp_gpt_layer_spec`` is megatron-core's local spec (``get_gpt_layer_local_spec``: only
megatron-core modules, so it runs on CPU and on GPUs without Transformer Engine) with
``core_attention`` replaced. ``with_hdp_core_attention`` does the same swap on any GPT layer
spec whose self-attention is ``SelfAttention`` (or ``MLASelfAttention``, which becomes
``mla.HDPMLASelfAttention``): for the Transformer Engine spec, pass
``get_gpt_layer_with_transformer_engine_spec(...)`` through it; TE's fused QKV/norm linears
and fused RoPE stay, only ``TEDotProductAttention`` is replaced (our module takes the same
constructor and forward arguments), and TE's sbhd fused RoPE applies our per-token angle rows
unchanged.
"""

from __future__ import annotations

import copy

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.multi_latent_attention import MLASelfAttention, MLASelfAttentionSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from ..errors import ConfigError
from .core_attention import HDPCoreAttention
from .mla import HDPMLASelfAttention


def _swap(layer: ModuleSpec) -> None:
    attention = getattr(layer.submodules, "self_attention", None)
    module = getattr(attention, "module", None)
    if module in (MLASelfAttention, HDPMLASelfAttention) and isinstance(
        attention.submodules, MLASelfAttentionSubmodules
    ):
        attention.module = HDPMLASelfAttention  # RoPE at true positions, the latent for a latent ring
        attention.submodules.core_attention = HDPCoreAttention
        return
    if (
        not isinstance(attention, ModuleSpec)
        or module is not SelfAttention
        or not isinstance(attention.submodules, SelfAttentionSubmodules)
    ):
        raise ConfigError(
            f"HDP core attention plugs into megatron-core's SelfAttention or MLASelfAttention; this layer spec uses "
            f"{getattr(attention, 'module', attention)!r}"
        )
    attention.submodules.core_attention = HDPCoreAttention


def with_hdp_core_attention(spec):
    """A copy of a GPT layer spec (or decoder block spec) with HDP core attention in every layer."""
    spec = copy.deepcopy(spec)
    if isinstance(spec, TransformerBlockSubmodules):
        for layer in spec.layer_specs:
            _swap(layer)
    elif isinstance(spec, ModuleSpec):
        _swap(spec)
    else:
        raise ConfigError(f"expected a GPT layer ModuleSpec or TransformerBlockSubmodules, got {type(spec).__name__}")
    return spec


class SequenceParallelTorchNorm:
    """torch's LayerNorm / RMSNorm as a megatron-core norm that runs under sequence parallelism.

    megatron-core's torch norm (``WrappedTorchNorm``, the local spec's norm without Apex)
    refuses ``sequence_parallel``; a norm needs nothing but per-token math there, and its
    weights marked ``sequence_parallel`` so that ``finalize_model_grads`` sums their gradients
    over the TP ranks (each saw only its share of the tokens), as for Apex's norms."""

    def __new__(
        cls,
        config,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "LayerNorm",
    ):
        kind = config.normalization
        if kind not in ("LayerNorm", "RMSNorm") or config.layernorm_zero_centered_gamma:
            raise ConfigError(
                "sequence parallelism on the local spec takes LayerNorm or RMSNorm without zero-centred gamma, "
                f"got {kind}"
            )
        norm = (torch.nn.RMSNorm if kind == "RMSNorm" else torch.nn.LayerNorm)(hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel
        return norm


def hdp_gpt_layer_spec(
    num_experts: int | None = None,
    moe_grouped_gemm: bool = False,
    qk_layernorm: bool = False,
    normalization: str = "RMSNorm",
    qk_l2_norm: bool = False,
    sequence_parallel: bool = False,
    num_layers: int | None = None,
    multi_latent_attention: bool = False,
) -> ModuleSpec | TransformerBlockSubmodules:
    """megatron-core's local GPT layer spec with HDP ring attention as core attention. With
    ``sequence_parallel``: the decoder block spec for ``num_layers`` layers with
    ``SequenceParallelTorchNorm`` in every norm slot (the final norm included)."""
    spec = with_hdp_core_attention(
        get_gpt_layer_local_spec(
            num_experts=num_experts,
            moe_grouped_gemm=moe_grouped_gemm,
            qk_layernorm=qk_layernorm,
            multi_latent_attention=multi_latent_attention,
            normalization=normalization,
            qk_l2_norm=qk_l2_norm,
        )
    )
    if not sequence_parallel:
        return spec
    if num_layers is None:
        raise ConfigError("hdp_gpt_layer_spec(sequence_parallel=True) builds the block spec: pass num_layers")
    spec.submodules.input_layernorm = SequenceParallelTorchNorm
    spec.submodules.pre_mlp_layernorm = SequenceParallelTorchNorm
    return TransformerBlockSubmodules(layer_specs=[spec] * num_layers, layer_norm=SequenceParallelTorchNorm)
