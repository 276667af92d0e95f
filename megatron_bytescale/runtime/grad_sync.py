"""Gradient reduction for runs without Megatron's DistributedDataParallel (the CPU demo,
``bytescale verify``, tests): one all-reduce over the HDP group, then division by the step's
global token count. Megatron runs use its own ``finalize_model_grads``, which does the same
over the DP x CP group when ``--calculate-per-token-loss`` is set."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


def make_finalize_grads(group=None):
    """A ``finalize_model_grads_func`` for a TransformerConfig: sum gradients over ``group``
    and divide by the all-reduced token count."""

    def finalize(models, num_tokens, pg_collection=None, force_all_reduce=False):  # noqa: ARG001
        params = [p for m in models for p in m.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:  # a rank with no micro-batches still contributes zeros
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in params]
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=group)
        if num_tokens is not None:
            total = num_tokens.detach().clone().to(torch.int64)
            dist.all_reduce(total, group=group)
            num_tokens.copy_(total)
            flat /= max(int(total.item()), 1)
        for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(reduced)

    return finalize
