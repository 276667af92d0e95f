"""The router's load-balancing statistics of a micro-batch that holds padding only.

Under expert parallelism the members of an EP group run the same number of micro-batch slots
(``planner/expert/slots.py``); a member with nothing to run in a slot runs a filler of padding
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

A rank that runs no micro-batch at all in a step (a plan may leave one idle) records nothing,
and Megatron's logging then reduces the router losses over groups that rank does not join
(core_v0.16 skips the data-parallel average of a loss a rank never recorded, core_v0.19 the
z-loss's average over its data-parallel group): the run hangs at its first log line.
``record_idle_rank`` has each of its routers record zero for every loss it would have recorded,
through the router's own reporting (so with its groups), as a filler would.
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


def record_idle_rank(chunks) -> None:
    """On a rank without micro-batches in a training step: every router records a zero for
    each of its losses (load balancing, sequence load balancing, z-loss), through megatron-core's
    own reporting methods, so that the logging reductions pair up with the other ranks'."""
    import torch
    from megatron.core.transformer.moe.router import Router

    for chunk in chunks:
        for router in (m for m in chunk.modules() if isinstance(m, Router)):
            if not router.training:
                continue
            experts = router.config.num_moe_experts
            zeros = torch.zeros(1, experts, device=router.weight.device, dtype=torch.float32)
            for name, kind in (("load_balancing_loss", "aux_loss"), ("seq_load_balancing_loss", "seq_aux_loss")):
                coeff = router.get_aux_loss_coeff(kind)
                if coeff > 0:
                    router.attach_and_log_load_balancing_loss(
                        zeros, coeff, zeros.sum(), name, router.tp_cp_group, valid_token_count=0
                    )
            if router.config.moe_z_loss_coeff is not None:
                with torch.enable_grad():
                    router.apply_z_loss(zeros, padding_mask=torch.ones(1, dtype=torch.bool, device=zeros.device))
