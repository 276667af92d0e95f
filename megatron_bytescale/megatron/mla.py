"""Multi-latent attention (MLA) under HDP: megatron-core's ``MLASelfAttention``, two changes.

megatron-core's MLA layer (``multi_latent_attention.MLASelfAttention``) makes per token a query
of ``qk_head_dim + qk_pos_emb_head_dim`` per head (through ``q_lora_rank`` or directly), a KV
latent of ``kv_lora_rank`` (a down-projection, its norm) and one rotary key of
``qk_pos_emb_head_dim`` shared by the heads; its up-projection ``linear_kv_up_proj`` turns the
latent into each head's no-rope key (``qk_head_dim``) and value (``v_head_dim``); RoPE comes
from the layer's own ``rotary_pos_emb`` (``--rope-type rope`` or ``yarn``); then core attention
gets q, k of one head dim and v of another. Under HDP:

* RoPE at each token's true position: the layer's ``rotary_pos_emb`` is wrapped in
  ``rotary.TruePositionRotaryEmbedding`` (plain RoPE and YaRN, fused or not);
* core attention is ``HDPCoreAttention`` (the ring), which for a *latent ring* (the plan's
  ``Piece.transport == "latent"``) also needs what K and V are made of: the latent and the
  up-projection (``runtime.ring_attention.MLALatent``). ``get_query_key_value_tensors``
  returns the latent among its results; this layer keeps it for the core attention call that
  follows in the same forward (``take_latent``), and passes it through the activation
  checkpoint of ``--recompute-granularity selective`` (core_attn) as a checkpoint input.

With TP each rank's up-projection holds its heads' rows while the latent is whole on every TP
rank, so the ring carries the whole latent; the latent's gradient from the other ring
members, per TP rank its heads' share, is summed over TP (or reduce-scattered under sequence
parallelism) as megatron-core's column-parallel linear does for its input.

Everything else is megatron-core's: the projections, norms, the output projection, the
up-projection recompute (``mla_up_proj``), every TP shard.
"""

from __future__ import annotations

import weakref

from megatron.core import tensor_parallel
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from torch import Tensor

from ..errors import ConfigError
from ..runtime.ring_attention import MLALatent
from .rotary import TruePositionRotaryEmbedding


class HDPMLASelfAttention(MLASelfAttention):
    """megatron-core's MLA self-attention with RoPE at true positions and its latent handed to
    HDP core attention (see the module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rotary_pos_emb = TruePositionRotaryEmbedding(self.rotary_pos_emb)
        bind = getattr(self.core_attention, "bind_latent_source", None)
        if bind is None:
            raise ConfigError(
                f"HDP multi-latent attention needs HDP core attention, got {type(self.core_attention).__name__}"
            )
        bind(weakref.ref(self))  # weak: the core attention is this layer's child
        self._latent: Tensor | None = None

    def get_query_key_value_tensors(self, *args, **kwargs):
        query, key, value, q_compressed, kv_compressed = super().get_query_key_value_tensors(*args, **kwargs)
        self._latent = kv_compressed  # the latent after its norm: the up-projection's input
        return query, key, value, q_compressed, kv_compressed

    def take_latent(self) -> Tensor | None:
        """The latent of this forward (once: later forwards make their own)."""
        latent, self._latent = self._latent, None
        return latent

    def ring_latent(self, latent: Tensor) -> MLALatent:
        """What a latent ring needs from this layer for ``latent`` ([T or T/TP, 1, r])."""
        up = self.linear_kv_up_proj
        weight, bias = getattr(up, "weight", None), getattr(up, "bias", None)
        if weight is None or (isinstance(bias, Tensor) and bias.numel()):
            raise ConfigError(
                f"the latent ring re-expands K and V with the KV up-projection's weight; "
                f"{type(up).__name__} has {'a bias' if weight is not None else 'no weight'}: use --hdp-mla-ring kv"
            )
        if type(up).__name__ == "TELayerNormColumnParallelLinear":
            raise ConfigError(
                "the latent ring re-expands K and V from the normed latent, but Transformer Engine fuses the KV "
                "latent's norm into the up-projection (--qk-layernorm with --transformer-impl transformer_engine): "
                "use --hdp-mla-ring kv, or --transformer-impl local"
            )
        latent = latent.squeeze(1) if latent.dim() == 3 else latent
        tp = self.config.tensor_model_parallel_size
        if tp > 1 and self.config.sequence_parallel:  # [T/TP, r] -> [T, r]; backward reduce-scatters
            latent = tensor_parallel.gather_from_sequence_parallel_region(latent, tensor_parallel_output_grad=True)
        elif tp > 1:  # backward: the heads' shares summed over TP
            latent = tensor_parallel.copy_to_tensor_model_parallel_region(latent)
        fuse = bool(getattr(up, "gradient_accumulation_fusion", False))
        return MLALatent(latent=latent, weight=weight, pos_dim=self.config.qk_pos_emb_head_dim, fuse_wgrad=fuse)

    def _checkpointed_attention_forward(
        self,
        query,
        key,
        value,
        attention_mask,
        rotary_pos_emb=None,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
        core_attention_extra_kwargs=None,
    ):
        """Selective recompute of core attention with the latent among the checkpoint's inputs
        (recomputed in backward, the attention must see this forward's latent, not a later
        one's)."""
        latent = self.take_latent()

        def recompute(query, key, value, latent):
            return self.core_attention(query, key, value, attention_mask, latent=latent)

        return tensor_parallel.checkpoint(recompute, False, query, key, value, latent)
