"""RoPE at each token's true position inside its own sequence (design 2.3).

Under HDP a rank's micro-batch is a packed row of pieces: whole short sequences (positions
0..s-1) and zigzag chunks of long ones (a chunk of a sequence starting at 50,000 has
positions 50,000...). Megatron's GPTModel computes RoPE for positions 0..T-1 of the row, so
every token after the first piece would be rotated at the wrong angle.

How megatron-core 0.16.1 applies RoPE (``GPTModel._preprocess`` -> ``SelfAttention.forward``):
``GPTModel`` calls ``self.rotary_pos_emb(rotary_seq_len, packed_seq=..., cp_group=...)`` once
per forward and hands the resulting ``[T, 1, 1, d]`` angle table to every layer;
``SelfAttention`` rotates q and k with ``apply_rotary_pos_emb(t, freqs, config,
cu_seqlens=None)`` (sbhd), which multiplies row i of ``t`` by row i of ``freqs``. With
``packed_seq_params`` (thd), it instead slices ``freqs`` per document from ``cu_seqlens``
(restarting at 0, or at each document's offset when the table has one row per token).

The least intrusive hook is therefore the one module GPTModel asks for the table: we swap
``model.rotary_pos_emb`` for ``TruePositionRotaryEmbedding``, which wraps Megatron's own
``RotaryEmbedding`` and answers with one row per token, taken at the token's true position
from the active micro-batch (``runtime.context``). Everything downstream stays Megatron's: the
sbhd ``apply_rotary_pos_emb`` (fused or not), every layer, every TP shard. HDP passes no
``packed_seq_params``: document boundaries live in the layout our core attention reads.

The rows come from Megatron's ``RotaryEmbedding.get_emb(n, offset)`` (same inverse
frequencies, interpolation factor, interleaving and device), called once per run of
consecutive *distinct* positions of the micro-batch: whole sequences all start at 0, so their
positions form one run however many are packed, and each zigzag piece adds at most two. The
angles are bit-identical to those of the whole sequence (``arange(n) + offset`` is exact in
float32 below 2^24 positions).

Multi-latent attention keeps its RoPE in every attention layer instead (``MLASelfAttention``'s
own ``rotary_pos_emb``, ``RotaryEmbedding`` or ``YarnRotaryEmbedding`` for ``--rope-type yarn``;
GPTModel then has none), and asks it the same way: ``get_rotary_seq_len``, then the table
(YaRN: the table and its mscale) or, with the fused YaRN kernel, ``get_cached_cos_sin`` (the
kernel rotates row t of the tokens by row t of the cos/sin tables). ``mla.HDPMLASelfAttention``
wraps that module in the same ``TruePositionRotaryEmbedding``, which answers all three with
rows at the true positions.
"""

from __future__ import annotations

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from torch import nn

from ..errors import BytescaleError, ConfigError
from ..runtime.context import current_micro_batch

_EXACT_POSITIONS = 1 << 24  # float32 represents every integer position below this exactly


def position_runs(positions: torch.Tensor) -> list[tuple[int, int]]:
    """``(first position, length)`` of each run of consecutive values in a sorted 1-D tensor."""
    p = positions.to("cpu", torch.int64)
    if p.numel() == 0:
        return []
    breaks = (torch.nonzero(p[1:] - p[:-1] != 1).flatten() + 1).tolist()
    starts = [0] + breaks
    ends = breaks + [p.numel()]
    return [(int(p[s]), e - s) for s, e in zip(starts, ends)]


def true_position_emb(rotary: RotaryEmbedding, positions: torch.Tensor) -> torch.Tensor:
    """Megatron's RoPE angle table ``[T, 1, 1, d]``, row i taken at position ``positions[i]``."""
    return true_position_table(rotary, positions)[0]


def true_position_table(rotary: RotaryEmbedding, positions: torch.Tensor) -> tuple[torch.Tensor, float | None]:
    """(angle table at ``positions``, YaRN's mscale or None): what ``rotary.get_emb`` gives
    (``YarnRotaryEmbedding.get_emb`` answers a pair)."""
    if positions.dim() != 1 or positions.numel() == 0:
        raise BytescaleError(f"RoPE needs a non-empty 1-D positions tensor, got shape {tuple(positions.shape)}")
    distinct, row_of_token = torch.unique(positions.to("cpu", torch.int64), sorted=True, return_inverse=True)
    if int(distinct[-1]) >= _EXACT_POSITIONS:
        raise BytescaleError(
            f"position {int(distinct[-1])} is beyond {_EXACT_POSITIONS}: float32 RoPE angles would be inexact"
        )
    parts, mscale = [], None
    for start, length in position_runs(distinct):
        emb = rotary.get_emb(length, offset=start)
        if isinstance(emb, tuple):
            emb, mscale = emb
        parts.append(emb)
    table = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
    return table[row_of_token.to(table.device)], mscale


class TruePositionRotaryEmbedding(nn.Module):
    """Stands in for ``GPTModel.rotary_pos_emb``: RoPE rows at the active micro-batch's positions."""

    def __init__(self, rotary: RotaryEmbedding):
        super().__init__()
        if not isinstance(rotary, RotaryEmbedding):
            raise ConfigError(
                f"true-position RoPE wraps megatron-core's RotaryEmbedding, got {type(rotary).__name__}; "
                "use --position-embedding-type rope"
            )
        self.rotary = rotary  # holds no parameters or buffers: the state dict is unchanged

    def get_rotary_seq_len(self, *args, **kwargs) -> int:
        return self.rotary.get_rotary_seq_len(*args, **kwargs)

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None):
        """The angle table at the active micro-batch's positions; for YaRN (table, mscale), as
        ``YarnRotaryEmbedding`` answers."""
        table, mscale = true_position_table(self.rotary, self._positions(max_seq_len, offset, cp_group))
        return table if mscale is None else (table, mscale)

    def get_cached_cos_sin(self, seq_len: int, offset: int = 0, dtype=None, packed_seq: bool = False):
        """YaRN's fused path: cos and sin (times mscale) of the angle table, one row per token at
        its true position (``YarnRotaryEmbedding`` caches the same values for rows 0..seq_len-1)."""
        table, mscale = true_position_table(self.rotary, self._positions(seq_len, offset, None))
        mscale = 1.0 if mscale is None else mscale
        dtype = dtype if dtype is not None else torch.get_default_dtype()
        return (table.cos() * mscale).to(dtype).contiguous(), (table.sin() * mscale).to(dtype).contiguous()

    def _positions(self, max_seq_len: int, offset: int, cp_group) -> torch.Tensor:
        active = current_micro_batch()
        if offset:
            raise BytescaleError(
                "true-position RoPE takes positions from the micro-batch; a RoPE offset is not supported"
            )
        if cp_group is not None and cp_group.size() > 1:
            raise ConfigError("HDP replaces Megatron's context parallelism: use --context-parallel-size 1")
        if max_seq_len != active.num_tokens:
            raise BytescaleError(
                f"the model runs {max_seq_len} tokens but the active micro-batch has {active.num_tokens} positions: "
                "activate the micro-batch whose tokens are being run (micro-batch size 1, no sequence padding)"
            )
        return active.positions


def use_true_positions(model: nn.Module) -> nn.Module:
    """Swap GPTModel's RoPE for true-position RoPE (in place; wrappers such as DDP are looked
    through). Returns the model. Idempotent. A multi-latent attention model has its RoPE in its
    attention layers, which HDP's MLA layer already turns to true positions: checked here."""
    gpt = model
    while not hasattr(gpt, "rotary_pos_emb") and hasattr(gpt, "module"):
        gpt = gpt.module
    if getattr(getattr(gpt, "config", None), "multi_latent_attention", False):
        _check_mla_rotary(gpt)
        return model
    rotary = getattr(gpt, "rotary_pos_emb", None)
    if isinstance(rotary, TruePositionRotaryEmbedding):
        return model
    if rotary is None:
        raise ConfigError(
            f"{type(gpt).__name__} has no rotary_pos_emb: HDP needs a GPTModel built with "
            "position_embedding_type='rope' (--position-embedding-type rope)"
        )
    gpt.rotary_pos_emb = TruePositionRotaryEmbedding(rotary)
    return model


def _check_mla_rotary(gpt: nn.Module) -> None:
    """Every multi-latent attention layer of ``gpt`` rotates at true positions."""
    from megatron.core.transformer.multi_latent_attention import MultiLatentAttention

    for name, module in gpt.named_modules():
        if isinstance(module, MultiLatentAttention) and not isinstance(
            module.rotary_pos_emb, TruePositionRotaryEmbedding
        ):
            raise ConfigError(
                f"{name} ({type(module).__name__}) rotates keys at row positions: under HDP multi-latent attention "
                "layers come from HDP's layer spec (megatron_bytescale.megatron.mla.HDPMLASelfAttention)"
            )
