"""HDP core attention: megatron-core's ``core_attention`` slot filled by our ring attention.

``SelfAttention`` projects q/k/v, applies RoPE (at true positions, see ``rotary``), then calls
``core_attention(query, key, value, attention_mask, attn_mask_type=..., attention_bias=...,
packed_seq_params=...)`` with ``[sq, b, heads, head_dim]`` tensors and expects
``[sq, b, heads * head_dim]`` back. Under HDP the row is one packed micro-batch (b = 1) whose
causal and document masking, and the ring of ranks that share its long sequences, come from
the active micro-batch's layout (``runtime.context``), not from a mask tensor.

With TP each rank holds its heads' shard (heads / TP query heads, their KV groups); the ring
runs among the HDP ranks with the same TP rank (``parallel.hdp_group()``), so only that
shard's KV travels.

Activation recompute (``--recompute-granularity full``, or selective with ``core_attn``)
re-runs this forward during backward, inside the micro-batch's backward: the HDP step makes
the layout active again there, and every ring member recomputes the same layers in the same
(reverse) order, so the recomputed KV hops pair up like the first ones and are counted again.

Multi-latent attention (``mla.HDPMLASelfAttention``) builds this module with its K head dim
(``k_channels``) and V head dim (``v_channels``), which differ; K and V then travel as one
buffer per token, or, where the plan makes the ring a latent ring, the layer's latent travels
instead (``latent``, or what the layer kept from this forward) and each member re-expands it.
"""

from __future__ import annotations

from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor

from ..errors import BytescaleError, ConfigError
from ..runtime.context import current_micro_batch
from ..runtime.ring_attention import ring_attention
from . import parallel


def check_config(config: TransformerConfig) -> None:
    """Refuse settings that HDP ring attention cannot honour, naming the fix."""
    if config.attention_dropout:
        raise ConfigError(
            f"HDP ring attention has no attention dropout, but attention_dropout={config.attention_dropout}: "
            "set it to 0 (--attention-dropout 0.0)"
        )
    if config.context_parallel_size != 1:
        raise ConfigError(
            f"HDP replaces Megatron's context parallelism (context_parallel_size={config.context_parallel_size}): "
            "use --context-parallel-size 1; long sequences get their rings from the plan"
        )


class HDPCoreAttention(MegatronModule):
    """Ring attention over the active micro-batch's layout, pluggable as ``core_attention``."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
        k_channels: int | None = None,
        v_channels: int | None = None,
    ):
        super().__init__(config=config)
        check_config(config)
        if attention_type != "self":
            raise ConfigError(f"HDP core attention serves self-attention only, got attention_type={attention_type!r}")
        if attn_mask_type != AttnMaskType.causal:
            raise ConfigError(f"HDP core attention is causal (with document masking), got {attn_mask_type}")
        if attention_dropout:
            raise ConfigError(f"HDP ring attention has no attention dropout, got attention_dropout={attention_dropout}")
        self.layer_number = layer_number
        self.softmax_scale = softmax_scale if softmax_scale is not None else (k_channels or config.kv_channels) ** -0.5
        self._latent_source = None  # an MLA layer (weakref) whose latent a latent ring carries

    def bind_latent_source(self, layer_ref) -> None:
        """``layer_ref()``: the multi-latent attention layer this module serves (``mla``)."""
        self._latent_source = layer_ref

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: Tensor | None = None,
        packed_seq_params=None,
        latent: Tensor | None = None,
    ) -> Tensor:
        if attention_mask is not None or attention_bias is not None:
            raise BytescaleError(
                "HDP attention masks by the micro-batch layout; pass attention_mask=None and no attention_bias"
            )
        if packed_seq_params is not None:
            raise BytescaleError(
                "HDP describes packing by the active micro-batch's layout; do not pass packed_seq_params"
            )
        if attn_mask_type not in (None, AttnMaskType.causal):
            raise BytescaleError(f"HDP core attention is causal, got attn_mask_type={attn_mask_type}")
        if query.dim() != 4 or query.shape[1] != 1:
            raise BytescaleError(
                "HDP core attention takes one packed row [tokens, 1, heads, head_dim], "
                f"got query {tuple(query.shape)}: "
                "use micro-batch size 1"
            )
        active = current_micro_batch()
        group = active.group if active.group is not None else parallel.hdp_group()
        layer = self._latent_source() if self._latent_source is not None else None
        if layer is not None and latent is None:
            latent = layer.take_latent()  # kept by the layer's forward, just before this call
        ring_latent = None
        if active.layout.transport == "latent" and active.layout.blocks:
            if layer is None or latent is None:
                raise BytescaleError(
                    "the plan makes this micro-batch's ring a latent ring, but this attention layer has no MLA latent: "
                    "plan with the 'kv' ring transport (--hdp-mla-ring kv) unless the model uses "
                    "--multi-latent-attention"
                )
            ring_latent = layer.ring_latent(latent)
        out = ring_attention(
            query[:, 0],
            key[:, 0],
            value[:, 0],
            active.layout,
            group=group,
            softmax_scale=self.softmax_scale,
            counter=active.counter,
            latent=ring_latent,
        )  # [T, heads, v head dim]
        return out.reshape(out.shape[0], 1, -1)
