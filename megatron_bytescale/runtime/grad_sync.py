"""Gradient reduction for runs without Megatron's DistributedDataParallel (the CPU demo,
``bytescale verify``, tests): one all-reduce over the HDP group, then division by the step's
global token count. Megatron runs use its own ``finalize_model_grads``, which does the same
over the DP x CP group when ``--calculate-per-token-loss`` is set.

With pipeline parallelism it also does what Megatron's ``finalize_model_grads`` does for
pipelines: the token count (counted by the last stage, where the loss is) goes to every
stage of the pipeline, and the gradients of word embeddings tied to the output layer are
summed between the first and the last stage (their embedding group)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


def make_finalize_grads(group=None, pp_group=None, embedding_group=None):
    """A ``finalize_model_grads_func`` for a TransformerConfig: sum gradients over ``group``
    and divide by the all-reduced token count. ``pp_group``: this rank's pipeline (the token
    count is summed over it: only the last stage counts); ``embedding_group``: the first and
    last stage, when this rank is one of them (tied word-embedding gradients are summed)."""

    def finalize(models, num_tokens, pg_collection=None, force_all_reduce=False):  # noqa: ARG001
        params = [p for m in models for p in m.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:  # a rank with no micro-batches still contributes zeros
                p.grad = torch.zeros_like(p)
        if embedding_group is not None:
            for m in models:
                tied = _tied_embedding_weight(m)
                if tied is not None:
                    dist.all_reduce(tied.grad, group=embedding_group)
        if num_tokens is not None and pp_group is not None:
            dist.all_reduce(num_tokens, group=pp_group)
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


def _tied_embedding_weight(model):
    """The word-embedding weight a first or last pipeline stage shares with the other end of
    the pipeline (megatron-core's LanguageModule), or None."""
    while not hasattr(model, "share_embeddings_and_output_weights") and hasattr(model, "module"):
        model = model.module
    if not getattr(model, "share_embeddings_and_output_weights", False):
        return None
    if not (getattr(model, "pre_process", False) or getattr(model, "post_process", False)):
        return None
    return model.shared_embedding_or_output_weight()
