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
    from megatron_bytescale.planner.contract import Plan

    step = step_batch(Plan.from_json(plan_json), parallel_state.get_data_parallel_rank())
    return local_run.run_step(step, model, group, **kwargs)


def shard_info(model) -> dict[str, tuple]:
    """How each parameter is cut over TP: (tensor-parallel?, partition dim, partition stride)."""
    return {
        n: (
            getattr(p, "tensor_model_parallel", False),
            getattr(p, "partition_dim", -1),
            getattr(p, "partition_stride", 1),
        )
        for n, p in model.named_parameters()
    }


def one_rank_plan(lens, num_layers: int = 4):
    """Every sequence of ``lens`` whole, one micro-batch each, on one rank without PP: the
    reference every HDP layout is compared against."""
    from megatron_bytescale.planner.contract import MicroBatch, Plan, whole_piece

    ranks = (tuple(MicroBatch((whole_piece(i, s, 0),)) for i, s in enumerate(lens)),)
    return Plan(num_ranks=1, capacity=max(lens), num_layers=num_layers, seq_lens=tuple(lens), ranks=ranks).validate()


def global_layer_names(model, prefix: str = "") -> dict[str, str]:
    """``prefix + name`` of a pipeline stage's (or model chunk's) parameters -> the names the
    same weights have without PP: its layers are numbered from 0, ``layer_number`` is the
    global one (Megatron's offset for the stage and virtual stage)."""
    names = {}
    for name, _ in model.named_parameters():
        if name.startswith("decoder.layers."):
            local, rest = name[len("decoder.layers.") :].split(".", 1)
            layer = model.decoder.layers[int(local)]
            names[prefix + name] = f"decoder.layers.{layer.layer_number - 1}.{rest}"
        else:
            names[prefix + name] = name
    return names


def one_rank_reference(rank, world, lens_by_case, seed):
    """On one gloo rank: the tiny model's full weights (drawn with ``seed``), and per case the
    loss, token count and gradients of its sequences run whole (``one_rank_plan``)."""
    from megatron_bytescale.megatron import local_run

    model, group = local_run.setup_model("tiny", seed=seed)
    out = {"weights": {n: p.detach().clone() for n, p in model.named_parameters()}}
    for case, lens in lens_by_case.items():
        for p in model.parameters():
            p.grad = None
        result = local_run.run_step(step_batch(one_rank_plan(lens), 0), model, group)
        out[case] = {"loss": result.loss, "tokens": result.global_tokens, "grads": grads_of(model)}
    local_run.teardown()
    return out
