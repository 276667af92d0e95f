"""Gradient reduction for runs without Megatron's DistributedDataParallel (the CPU demo,
``bytescale verify``, tests): one all-reduce over the HDP group, then division by the step's
global token count. Megatron runs use its own ``finalize_model_grads``, which does the same
over the DP x CP group when ``--calculate-per-token-loss`` is set; with
``--overlap-grad-reduce`` the helpers below decide, per rank and step, when its buckets launch.

With pipeline parallelism it also does what Megatron's ``finalize_model_grads`` does for
pipelines: the token count (counted by the last stage, where the loss is) goes to every
stage of the pipeline, and the gradients of word embeddings tied to the output layer are
summed between the first and the last stage (their embedding group)."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


def make_finalize_grads(group=None, *, tp_group=None, pp_group=None, embedding_group=None, expert_group=None):
    """A ``finalize_model_grads_func`` for a TransformerConfig: sum gradients over ``group``
    and divide by the all-reduced token count. Under sequence parallelism the gradients of the
    weights marked ``sequence_parallel`` (norms: each TP rank saw its share of the tokens) are
    first summed over ``tp_group``, as Megatron's ``finalize_model_grads`` does. ``pp_group``:
    this rank's pipeline (the token count is summed over it: only the last stage counts);
    ``embedding_group``: the first and last stage, when this rank is one of them (tied
    word-embedding gradients are summed). ``expert_group``: with expert parallelism, the
    expert-data-parallel group over which the gradients of this rank's experts (megatron-core
    marks them ``allreduce=False``) are summed instead of ``group``, as Megatron's DDP does."""

    def finalize(models, num_tokens, pg_collection=None, force_all_reduce=False):  # noqa: ARG001
        params = [p for m in models for p in m.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:  # a rank with no micro-batches still contributes zeros
                p.grad = torch.zeros_like(p)
        shared = [p.grad for p in params if getattr(p, "sequence_parallel", False)]
        if shared and tp_group is not None and dist.get_world_size(tp_group) > 1:
            flat = _flatten_dense_tensors(shared)
            dist.all_reduce(flat, group=tp_group)
            for g, reduced in zip(shared, _unflatten_dense_tensors(flat, shared)):
                g.copy_(reduced)
        if embedding_group is not None:
            for m in models:
                tied = _tied_embedding_weight(m)
                if tied is not None:
                    dist.all_reduce(tied.grad, group=embedding_group)
        if num_tokens is not None and pp_group is not None:
            dist.all_reduce(num_tokens, group=pp_group)
        total = None
        if num_tokens is not None:
            total = num_tokens.detach().clone().to(torch.int64)
            dist.all_reduce(total, group=group)
            num_tokens.copy_(total)
        experts = expert_group is not None
        for over, grads in (
            (group, [p.grad for p in params if not experts or getattr(p, "allreduce", True)]),
            (expert_group, [p.grad for p in params if experts and not getattr(p, "allreduce", True)]),
        ):
            if not grads:
                continue
            flat = _flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=over)
            if total is not None:
                flat /= max(int(total.item()), 1)
            for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
                g.copy_(reduced)

    return finalize


# ------------------------------------------------------------------ overlapped reduction
# Megatron DDP with --overlap-grad-reduce launches a bucket's collective from a backward hook
# once all its gradients are in, during the last micro-batch (outside ``no_sync``). HDP ranks
# run different numbers of micro-batches, so per rank:
#
# * the last micro-batch runs with gradient sync on when it is local (no ring): its buckets
#   launch during its backward. After a bucket collective a rank must post no more ring P2P on
#   the HDP group (NCCL serialises both on one communicator, and the ring partner may not have
#   reached its own collective yet), so a ring micro-batch last keeps sync off;
# * a rank whose buckets did not launch that way (ring micro-batch last, no micro-batch at
#   all) launches every bucket explicitly after its last backward;
# * with virtual pipeline stages each model chunk is its own DDP: no chunk launches from
#   backward hooks (a later backward of another chunk may still post ring P2P), and after the
#   device's last backward every chunk launches its buckets, chunk by chunk, on every rank;
# * every bucket launches in the DDP's bucket order on every rank, whoever launches it:
#   ``in_order_launch`` holds a bucket that is ready before its predecessors until they go.
#   (Backward finishes buckets slightly out of order, e.g. 0, 1, 2, 4, 3 for the tiny GPT, and
#   collectives pair up by issue order across ranks.)
#
# --overlap-param-gather (distributed optimizer): after the optimizer step each rank holds its
# shard of the new parameters; Megatron's DDP gathers the rest during the next forward, from
# forward pre-hooks (each module waits for its bucket's all-gather, dispatching it first if
# nobody has), or, with aligned gathers (``align_param_gather``, virtual stages), from the
# schedule's ``param_sync_func`` per model chunk. Megatron's training loop switches the
# pre-hooks (and ``param_sync_func``) off for its first iteration (the parameters are in sync
# from initialisation or the checkpoint), while it validates and saves (after a synchronous
# gather), and on again after; with ``--overlap-param-gather-with-optimizer-step`` the optimizer
# dispatches the first chunk's gather itself right after its step.
#
# HDP ranks run different numbers of micro-batches, and a rank with none for a chunk runs no
# forward of it, so forward pre-hooks cannot decide when the all-gathers happen. ``ParamGather``
# follows the same life cycle per step: when a chunk's pre-hooks are on, the step dispatches
# every bucket's all-gather of every chunk at its start, chunk by chunk in bucket order, on
# every rank (a chunk whose gather the optimizer dispatched is skipped by Megatron's own
# ``start_param_sync``); the pre-hooks then only wait (aligned gathers); and before the step
# ends every rank waits for every gather still open, so none is in flight when the optimizer
# writes the parameters again and the next step finds no handle left (Megatron asserts it).
# Collectives are issued before any ring or pipeline transfer of the step, in the same order on
# every rank. When the pre-hooks are off, nothing is dispatched, as in Megatron.


def overlaps_param_gather(model) -> bool:
    """Is ``model`` a Megatron DDP (distributed optimizer) that overlaps its param all-gather?"""
    config = getattr(model, "ddp_config", None)
    return bool(config is not None and config.use_distributed_optimizer and config.overlap_param_gather)


def param_gather_hooks_on(model) -> bool:
    """Are the forward pre-hooks of the overlapped param all-gather on (Megatron's training loop
    turns them off for its first iteration, validation and saving)?"""
    return overlaps_param_gather(model) and bool(getattr(model, "remove_forward_pre_hook_handles", None))


class ParamGather:
    """The overlapped parameter all-gathers of one step, for every model chunk (see above)."""

    def __init__(self, chunks):
        self.chunks = [chunk for chunk in chunks if param_gather_hooks_on(chunk)]

    def dispatch(self) -> None:
        """At the step's start: every bucket's all-gather, chunk by chunk, in bucket order."""
        for chunk in self.chunks:
            chunk.ddp_config.align_param_gather = True  # the pre-hooks wait and dispatch nothing
            chunk.start_param_sync()  # returns at once where the optimizer step dispatched it

    def finish(self) -> None:
        """Before the step ends: wait for every all-gather still open (all of them on a rank
        without micro-batches, those of modules no forward reached elsewhere)."""
        for chunk in self.chunks:
            for group in chunk.bucket_groups + chunk.expert_parallel_bucket_groups:
                if group.param_gather_handle is not None:
                    group.finish_param_sync(skip_next_bucket_dispatch=True)


def overlaps_grad_reduce(model) -> bool:
    """Is ``model`` a Megatron DDP that overlaps its gradient reduction with backward?"""
    config = getattr(model, "ddp_config", None)
    return bool(config is not None and config.overlap_grad_reduce)


class InOrderLaunch:
    """Launches a DDP's bucket-group collectives strictly in bucket order (see above); counts
    how many launched from backward hooks (``launched_in_backward``) in the current step."""

    def __init__(self, ddp):
        self.groups = list(ddp.bucket_groups) + list(ddp.expert_parallel_bucket_groups)
        self._launch = [g.start_grad_sync for g in self.groups]
        self._reset = [g.reset for g in self.groups]
        self._ready: dict[int, dict] = {}
        self.next = 0
        self.in_backward = False
        self.launched_in_backward = 0
        for i, g in enumerate(self.groups):
            g.start_grad_sync = self._make_launch(i)
            g.reset = self._make_reset(i)

    def _make_launch(self, i: int):
        def launch(*args, **kwargs):
            if i < self.next:  # launched already this step: Megatron's own guard decides
                return self._launch[i](*args, **kwargs)
            self._ready[i] = kwargs
            while self.next in self._ready:
                j = self.next
                self._launch[j](**self._ready.pop(j))
                self.next += 1
                self.launched_in_backward += self.in_backward

        return launch

    def _make_reset(self, i: int):
        def reset():
            self.next, self._ready, self.launched_in_backward = 0, {}, 0
            self._reset[i]()

        return reset


def in_order_launch(model) -> InOrderLaunch | None:
    """The model's InOrderLaunch (installed on first use); None without overlapped reduction."""
    if not overlaps_grad_reduce(model):
        return None
    launcher = getattr(model, "_hdp_in_order_launch", None)
    if launcher is None:
        launcher = InOrderLaunch(model)
        model._hdp_in_order_launch = launcher
    return launcher


class StepGradSync:
    """One rank's overlapped gradient reduction in one step (``runtime.step`` calls
    ``backward`` around each backward, ``launch_rest`` before finalize_model_grads): which
    micro-batch reduces gradients during backward, and the explicit launch for ranks where
    none does."""

    def __init__(
        self,
        model,
        micro_batches,
        forward_only: bool = False,
        last_backward: int | None = None,
        expert_parallel: int = 1,
        reduce_in_backward: bool = True,
    ):
        """``last_backward``: the micro-batch whose backward this stage runs last (default:
        the last one, as in 1F1B; a plan's stage order may end with another).
        ``reduce_in_backward=False``: no micro-batch reduces during its backward; every bucket
        launches in ``launch_rest`` (one model chunk of several)."""
        self.model = model
        self.launcher = None if forward_only else in_order_launch(model)
        last = len(micro_batches) - 1 if last_backward is None else last_backward
        # under expert parallelism every backward runs MoE all-to-alls, which EP partners must
        # meet in the same order as on every rank: no bucket collective may come between them,
        # so every rank launches its buckets after its last backward
        last_is_local = (
            reduce_in_backward and bool(micro_batches) and micro_batches[last].ring is None and expert_parallel == 1
        )
        self.sync_index = last if self.launcher is not None and last_is_local else None

    @contextlib.contextmanager
    def backward(self, index: int):
        """Around micro-batch ``index``'s backward (inside ``no_sync``): sync on for the chosen one."""
        if index != self.sync_index:
            yield
            return
        groups = self.launcher.groups
        for g in groups:  # what leaving no_sync does: backward hooks may launch buckets
            g.is_last_microbatch = True
        self.launcher.in_backward = True
        try:
            yield
        finally:
            self.launcher.in_backward = False
            for g in groups:
                g.is_last_microbatch = False

    def launch_rest(self) -> None:
        """After the last backward: launch the buckets that backward hooks did not."""
        if self.launcher is not None and self.sync_index is None:
            self.model.start_grad_sync()


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
