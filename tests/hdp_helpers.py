"""Helpers shared by the tests that run megatron-core's GPT under HDP on gloo ranks."""

from __future__ import annotations

import numpy as np
import torch

VOCAB = 512  # configs/models/tiny.args


def read_tokens(seq_id: int, start: int, stop: int) -> np.ndarray:
    """Deterministic token ids of sequence ``seq_id`` (any reader of the same batch agrees)."""
    return np.random.default_rng(1000 + seq_id).integers(0, VOCAB, size=stop)[start:stop]


def shard_like(full: torch.Tensor, param, tp_rank: int, tp: int) -> torch.Tensor:
    """This TP rank's part of a full tensor, cut as megatron-core's CPU initialisation cuts it."""
    if not getattr(param, "tensor_model_parallel", False):
        return full
    dim, stride = param.partition_dim, param.partition_stride
    chunks = torch.split(full, param.shape[dim] // stride, dim=dim)
    return torch.cat(chunks[tp_rank::tp], dim=dim)


def grads_of(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def step_batch(plan, hdp: int):
    """HDP rank ``hdp``'s delivery of ``plan``, its tokens from ``read_tokens``."""
    from megatron_bytescale.runtime.batch import StepBatch, build_micro_batch_data

    return StepBatch(plan, hdp, [build_micro_batch_data(mb, read_tokens) for mb in plan.micro_batches(hdp)])


def run_plan(plan_json: str, model, group, **kwargs):
    """This rank's part of a JSON plan, run through the HDP step (``local_run.run_step``)."""
    from megatron.core import parallel_state

    from megatron_bytescale.megatron import local_run
    from megatron_bytescale.planner.plan import Plan

    step = step_batch(Plan.from_json(plan_json), parallel_state.get_data_parallel_rank())
    return local_run.run_step(step, model, group, **kwargs)


def shard_info(model) -> dict[str, tuple]:
    """How each parameter is cut over TP: (tensor-parallel?, partition dim, partition stride)."""
    return {
        n: (getattr(p, "tensor_model_parallel", False), getattr(p, "partition_dim", -1), getattr(p, "partition_stride", 1))
        for n, p in model.named_parameters()
    }
