"""The router's load-balancing statistics of a micro-batch that holds padding only.

Under expert parallelism the members of an EP group run the same number of micro-batch slots
(``planner/expert_slots.py``); a member with nothing to run in a slot runs a filler of padding
tokens, so that it joins every all-to-all of its partners. The filler's ``padding_mask`` keeps
its tokens out of the router's statistics, as megatron-core defines them for padded
micro-batches: the load-balancing losses (``aux_loss``, ``seq_aux_loss``) count only real
tokens, ``get_tokens_per_expert_and_token_count`` returns that count, and the loss divides by
it. With no real token the division is 0 / 0: the filler's aux loss, its gradient (scaled by
its zero token count) and the logged value are NaN on every parameter the router reaches.

Megatron never builds a micro-batch without a real token; its z-loss already defines that case
(``z_loss_func`` clamps the real-token count to at least 1). ``install`` gives the
load-balancing losses the same definition: the total real-token count is clamped to at least
1, so a padding-only micro-batch contributes a loss of exactly 0, with zero gradient, and
records 0 in Megatron's aux-loss tracker (with the reduction groups every other micro-batch
records, so the logging collectives still pair up on every rank). A micro-batch with at least
one real token has a count of at least 1 and is computed exactly as before.
"""

from __future__ import annotations

import functools

_MARK = "_hdp_counts_at_least_one"


def counts_at_least_one(original):
    """Wrap megatron-core's ``get_tokens_per_expert_and_token_count`` (see above)."""
    if getattr(original, _MARK, False):
        return original

    @functools.wraps(original)
    def counts(routing_map, reduce_group, topk=None, with_padding_mask=False):
        per_expert, local, total = original(routing_map, reduce_group, topk=topk, with_padding_mask=with_padding_mask)
        if with_padding_mask:
            import torch

            total = torch.clamp(total, min=1.0)
        return per_expert, local, total

    setattr(counts, _MARK, True)
    return counts


def install() -> None:
    """Under HDP: the router's module reads the count function at call time (idempotent)."""
    from megatron.core.transformer.moe import router

    router.get_tokens_per_expert_and_token_count = counts_at_least_one(router.get_tokens_per_expert_and_token_count)
