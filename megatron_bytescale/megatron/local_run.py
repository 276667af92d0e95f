"""HDP training without Megatron-LM's training loop: the CPU demo, ``bytescale verify`` and
the tests. The model is megatron-core's GPTModel (``model.build_gpt_model``), the step is the
same ``runtime.step.run_hdp_step`` Megatron-LM runs, the forward step is pretrain_gpt's
(``pretrain_hooks.hdp_forward_step``); only the gradient reduction and the optimizer differ
(Megatron's DDP and optimizers need CUDA; here a flat all-reduce and a torch optimizer)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from ..runtime.batch import StepBatch
from ..runtime.grad_sync import make_finalize_grads
from ..runtime.step import StepStats, run_hdp_step
from . import cpu_compat, parallel
from .model import build_gpt_chunks
from .pretrain_hooks import LOSS_KEY, hdp_forward_step


@dataclass
class StepResult:
    loss: float  # mean per-token loss over the whole global batch (all ranks)
    loss_sum: float  # this rank's summed token losses
    global_tokens: int  # tokens with a label in the global batch
    stats: StepStats


def setup_model(
    model: str = "tiny", *, tp: int = 1, pp: int = 1, ep: int = 1, vpp: int = 1, seed: int = 0, **config_overrides
):
    """Parallel state on the initialised gloo world, then the GPT (this rank's pipeline stage)
    with our attention and a token-normalised gradient reduction over the HDP group (expert
    gradients over the expert-data-parallel group when ``ep`` > 1: a MoE model, megatron-core's
    all-to-all token dispatcher). Returns (model, hdp_group); with ``vpp`` > 1 virtual pipeline
    stages, ``model`` is the list of this device's ``vpp`` model chunks (Megatron's layout)."""

    cpu_compat.install()
    group = parallel.init_parallel(tp=tp, pp=pp, ep=ep, vpp=vpp)
    if ep > 1:
        config_overrides = {
            "expert_model_parallel_size": ep,
            "moe_token_dispatcher_type": "alltoall",
            **config_overrides,
        }
    chunks = build_gpt_chunks(model, seed=seed, **config_overrides)
    gpt = chunks[0]
    for chunk in chunks:
        chunk.config.calculate_per_token_loss = True
    pipeline = parallel_state.get_pipeline_model_parallel_group() if pp > 1 else None
    embedding = parallel_state.get_embedding_group() if pp > 1 and parallel_state.is_rank_in_embedding_group() else None
    finalize = make_finalize_grads(
        group,
        tp_group=parallel_state.get_tensor_model_parallel_group(),
        pp_group=pipeline,
        embedding_group=embedding,
        expert_group=parallel_state.get_expert_data_parallel_group() if ep > 1 else None,
    )
    for chunk in chunks:
        chunk.config.finalize_model_grads_func = finalize
    return (chunks if vpp > 1 else gpt), group


def run_step(step: StepBatch | None, model, group, *, forward_only: bool = False, offloader=None) -> StepResult:
    """One HDP step on this rank: forward+backward of its micro-batches, gradients reduced and
    divided by the global token count. The optimizer step is the caller's. ``model``: a GPT,
    or the list of model chunks ``setup_model(vpp=...)`` returns."""
    store, stats = run_hdp_step(
        step,
        forward_step_func=hdp_forward_step,
        model=model,
        config=(model[0] if isinstance(model, list) else model).config,
        group=group,
        forward_only=forward_only,
        offloader=offloader,
    )
    loss_sum = sum(float(d[LOSS_KEY][0]) for d in store)
    totals = torch.tensor([loss_sum, float(stats.loss_tokens)], dtype=torch.float64)
    dist.all_reduce(totals, group=group)
    if parallel.pipeline_stages() > 1:  # the loss is on the last stage: every stage reports it
        dist.all_reduce(totals, group=parallel.pipeline_group())
    global_tokens = int(totals[1].item())
    return StepResult(
        loss=float(totals[0] / max(global_tokens, 1)), loss_sum=loss_sum, global_tokens=global_tokens, stats=stats
    )


def teardown() -> None:
    parallel.destroy_parallel()
