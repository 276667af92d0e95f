"""Multi-token prediction (``--mtp-num-layers``) under HDP: megatron-core's MTP block, three hooks.

megatron-core's MTP (``transformer/multi_token_prediction.py``, DeepSeek-V3's): depth k (1..D)
combines each token's hidden state of depth k-1 with the embedding of the token k positions
on, runs one transformer layer, and predicts the token k + 1 positions on; the input ids,
labels and loss mask get there by a left roll per depth (``roll_tensor``). Under HDP:

* **the roll stays inside each document and crosses ring members**: ``roll_tensor`` (looked up
  at call time in the modules that call it) becomes ``runtime.document_roll`` while an HDP
  micro-batch runs, so a token's next token comes from its own document, on whichever ring
  member or zigzag chunk holds it, and a document's last tokens get nothing (Megatron's zero);
* **HDP attention in the MTP layers**: Megatron's builders make the MTP block's layer spec
  from their own decoder spec (``get_gpt_mtp_block_spec(config, spec, ...)``); the hook gives
  it HDP's (``layer_spec.with_hdp_core_attention``);
* **the loss scale, per token, of the whole step**: with ``--calculate-per-token-loss``
  core_v0.19 scales depth k's loss sum of a micro-batch by ``original_num_tokens /
  num_tokens`` (its labelled tokens over those with a depth-k label; ``process_mtp_loss``),
  and finalize_model_grads divides by the step's labelled tokens. With one micro-batch per
  step that is depth k's mean loss over its own labelled tokens; with several it depends on
  how tokens are grouped into micro-batches, which HDP changes. Under HDP the ratio is the
  step's: ``G_0 / G_k`` with ``G_k = sum over documents of max(0, L - 1 - k)`` (every token
  with a depth-k label; HDP's loss mask is 1 on all tokens but each document's last), so
  any number of ranks and micro-batches gives one rank's result, and Megatron's, when the
  step is one micro-batch. core_v0.16.1 adds depth k's per-token loss sum unscaled
  (divided by the step's labelled tokens only): layout-independent as it is;
* **the logged ``mtp_k loss``, per token of the step**: Megatron logs the mean over its
  micro-batches of each micro-batch's mean depth-k loss (its tracker sums them, averages over
  the data-parallel group and divides by the micro-batch count). HDP's micro-batches are packs
  and ring shares, so that mean counts a document split over a ring once per member (a 2-member
  ring doubled it). Under HDP each micro-batch records its depth-k loss sum scaled so that the
  logged value is the step's mean depth-k loss per labelled token (``G_k`` tokens): the same on
  any number of ranks, and Megatron's value when the step is one micro-batch.

``install()`` puts the hooks in place (idempotent); each hands over to megatron-core's function
unchanged outside an HDP micro-batch.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import sys
from dataclasses import dataclass

import torch

from ..errors import BytescaleError
from ..runtime.context import active_or_none
from ..runtime.document_roll import roll_within_documents
from . import parallel


@dataclass
class _LossScale:
    """One ``process_mtp_loss`` call: the micro-batch's labelled tokens and the step's counts."""

    original: torch.Tensor  # loss_mask.sum() of the micro-batch, as process_mtp_loss computes it
    step_counts: list[int]  # G_0, G_1, ...: the step's tokens with a depth-k label
    depth: int = 0


_loss_scale: contextvars.ContextVar[_LossScale | None] = contextvars.ContextVar("bytescale_mtp_loss", default=None)
# the token count the roll hook last returned for a loss mask: what megatron-core divides the
# logged depth-k loss by (``hdp_tracked_loss`` multiplies it back)
_mask_tokens: contextvars.ContextVar = contextvars.ContextVar("bytescale_mtp_mask_tokens", default=None)


def step_label_counts(seq_lens, depths: int) -> list[int]:
    """``G_k`` for k = 0..depths: tokens of the step with a label k tokens further on."""
    return [sum(max(0, s - 1 - k) for s in seq_lens) for k in range(depths + 1)]


def hdp_roll_tensor(original):
    """megatron-core's ``roll_tensor(tensor, shifts, dims, cp_group, packed_seq_params)``: inside
    an HDP micro-batch the shift along documents and rings; outside it, Megatron's."""
    if getattr(original, "_hdp_wrapped", False):
        return original

    @functools.wraps(original)
    def roll_tensor(tensor, shifts=-1, dims=-1, cp_group=None, packed_seq_params=None, **kwargs):
        active = active_or_none()
        if active is None:
            return original(tensor, shifts, dims, cp_group, packed_seq_params, **kwargs)
        if tensor is None:
            return None, None
        if shifts != -1 or dims not in (-1, tensor.dim() - 1) or packed_seq_params is not None or kwargs:
            raise BytescaleError(
                f"multi-token prediction under HDP shifts one token along the last dimension (got shifts={shifts}, "
                f"dims={dims}{', packed_seq_params' if packed_seq_params is not None else ''})"
            )
        group = active.group if active.group is not None else parallel.hdp_group()
        rolled = roll_within_documents(tensor, active.layout, group)
        total = rolled.sum()
        scale = _loss_scale.get()
        if scale is not None and tensor.is_floating_point():  # process_mtp_loss's loss mask of depth k
            scale.depth += 1
            counts = scale.step_counts
            # original / total must be the step's G_0 / G_k (see the module docstring)
            total = scale.original * (counts[scale.depth] / counts[0]) if counts[0] else total
        if tensor.is_floating_point():
            _mask_tokens.set(total)
        return rolled, total

    roll_tensor._hdp_wrapped = True
    return roll_tensor


def hdp_process_mtp_loss(original):
    """core_v0.19's ``process_mtp_loss``: under HDP with the per-token loss, depth k's loss
    scaled by the step's labelled tokens over its tokens with a depth-k label."""
    if getattr(original, "_hdp_wrapped", False):
        return original

    @functools.wraps(original)
    def process_mtp_loss(hidden_states, labels, loss_mask, *args, **kwargs):
        active = active_or_none()
        config = kwargs.get("config")
        if active is None or config is None or not config.calculate_per_token_loss or loss_mask is None:
            return original(hidden_states, labels, loss_mask, *args, **kwargs)
        if labels is None:
            raise BytescaleError("multi-token prediction under HDP takes the HDP loader's labels; got none")
        counts = step_label_counts(active.step_seq_lens, config.mtp_num_layers)
        token = _loss_scale.set(_LossScale(original=loss_mask.sum(), step_counts=counts))
        try:
            return original(hidden_states, labels, loss_mask, *args, **kwargs)
        finally:
            _loss_scale.reset(token)

    process_mtp_loss._hdp_wrapped = True
    return process_mtp_loss


def hdp_tracked_loss(original):
    """megatron-core's ``MTPLossLoggingHelper.save_loss_to_tracker`` (core_v0.16) or
    ``save_metrics_to_tracker`` (core_v0.19): under HDP the micro-batch's depth-k loss is
    recorded as its loss sum times Megatron's micro-batch count and data-parallel size over
    the step's ``G_k`` (module docstring), so that the logged value is the step's per-token mean."""
    if getattr(original, "_hdp_wrapped", False):
        return original
    signature = inspect.signature(original)

    @functools.wraps(original)
    def save(loss, *args, **kwargs):
        active = active_or_none()
        tokens = _mask_tokens.get()
        if active is None or tokens is None or not active.step_seq_lens:
            return original(loss, *args, **kwargs)
        from megatron.core import num_microbatches_calculator as calculator

        if getattr(calculator, "_GLOBAL_NUM_MICROBATCHES_CALCULATOR", None) is None:
            return original(loss, *args, **kwargs)  # outside Megatron's loop: nothing logs it
        bound = signature.bind(loss, *args, **kwargs).arguments
        depth = bound["layer_number"] + 1
        counts = step_label_counts(active.step_seq_lens, bound["num_layers"])
        group = bound.get("avg_group")
        ranks = torch.distributed.get_world_size(group) if group is not None else 1
        total = torch.as_tensor(tokens, dtype=loss.dtype, device=loss.device)
        summed = torch.where(total > 0, loss * total, torch.zeros_like(loss))  # the micro-batch's loss sum
        scale = calculator.get_num_microbatches() * ranks / counts[depth] if counts[depth] else 0.0
        return original(summed * scale, *args, **kwargs)

    save._hdp_wrapped = True
    return save


def hdp_mtp_block_spec(original):
    """``get_gpt_mtp_block_spec(config, spec, ...)`` with HDP core attention in ``spec`` (the MTP
    layers' transformer layer), whatever decoder spec Megatron's builder hands it."""
    if getattr(original, "_hdp_wrapped", False):
        return original

    @functools.wraps(original)
    def get_gpt_mtp_block_spec(config, spec, *args, **kwargs):
        from .layer_spec import with_hdp_core_attention

        return original(config, with_hdp_core_attention(spec), *args, **kwargs)

    get_gpt_mtp_block_spec._hdp_wrapped = True
    return get_gpt_mtp_block_spec


def install() -> None:
    """The roll and loss hooks in megatron-core's MTP and GPT modules (idempotent)."""
    from megatron.core.models.gpt import gpt_model
    from megatron.core.transformer import multi_token_prediction

    for module in (multi_token_prediction, gpt_model):  # 0.16's gpt_model imports roll_tensor by name
        if hasattr(module, "roll_tensor"):
            module.roll_tensor = hdp_roll_tensor(module.roll_tensor)
    if hasattr(gpt_model, "process_mtp_loss"):  # core_v0.19
        gpt_model.process_mtp_loss = hdp_process_mtp_loss(gpt_model.process_mtp_loss)
    helper = multi_token_prediction.MTPLossLoggingHelper
    for name in ("save_loss_to_tracker", "save_metrics_to_tracker"):  # core_v0.16, core_v0.19
        if name in vars(helper):
            setattr(helper, name, staticmethod(hdp_tracked_loss(getattr(helper, name))))


def install_spec_hook(builder_module_name: str | None = None) -> None:
    """HDP attention in the MTP block spec of Megatron's builders: core_v0.19's builder imports
    ``get_gpt_mtp_block_spec`` from megatron-core's spec module when it builds; core_v0.16's
    ``gpt_builders`` module imported it by name (``builder_module_name``). Only under HDP:
    call it from the HDP model hooks."""
    from megatron.core.models.gpt import gpt_layer_specs

    modules = [gpt_layer_specs]
    builder = sys.modules.get(builder_module_name) if builder_module_name else None
    if builder is not None:
        modules.append(builder)
    for module in modules:
        if hasattr(module, "get_gpt_mtp_block_spec"):
            module.get_gpt_mtp_block_spec = hdp_mtp_block_spec(module.get_gpt_mtp_block_spec)
