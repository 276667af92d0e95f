"""--overlap-grad-reduce under HDP: Megatron DDP's buckets reduce during the last backward.

Three gloo ranks run megatron-core's GPT inside Megatron's DistributedDataParallel (small
buckets, so there are many) with ``overlap_grad_reduce`` and Megatron's ``finalize_model_grads``:
rank 0's last micro-batch is local (its buckets launch from backward hooks), rank 1's is a ring
one (it launches every bucket after its backward), rank 2 has none. Two steps: the first is
DDP's first batch (it learns the bucket fill counts), the second launches from the hooks.
Gradients must equal one rank's on the same global batch.
"""

from __future__ import annotations

import pytest

from megatron_bytescale.local_world import preload, run_local_world
from megatron_bytescale.planner.contract import MicroBatch, Plan, ring_pieces, whole_piece

from hdp_helpers import one_rank_plan, read_tokens

preload(["megatron.core.models.gpt.gpt_model", "megatron_bytescale.megatron.local_run"])

SEED = 7
TOL = 2e-5
BUCKET = 4000  # parameters per bucket: the tiny GPT gets ~18 of them


def three_rank_plan() -> Plan:
    lens = (21, 6, 5)
    share = ring_pieces(0, 21, (0, 1))
    ranks = (
        (MicroBatch((share[0],)), MicroBatch((whole_piece(1, 6, 0),))),  # ring, then local: overlaps
        (MicroBatch((share[1], whole_piece(2, 5, 1))),),  # ring last: launches after backward
        (),  # nothing to run: launches every bucket too
    )
    return Plan(num_ranks=3, capacity=20, num_layers=4, seq_lens=lens, ranks=ranks).validate()


def _overlapped(rank, world, plan_json, steps=2):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    from megatron_bytescale.megatron import local_run
    from megatron_bytescale.runtime.batch import StepBatch, build_micro_batch_data

    model, group = local_run.setup_model("tiny", seed=SEED)
    ddp = DistributedDataParallel(
        model.config, DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=BUCKET), model
    )
    model.config.no_sync_func = ddp.no_sync
    model.config.finalize_model_grads_func = finalize_model_grads
    plan = Plan.from_json(plan_json)
    out = {"buckets": len(ddp.bucket_groups), "steps": []}
    for _ in range(steps):
        ddp.zero_grad_buffer()
        step = StepBatch(plan, rank, [build_micro_batch_data(mb, read_tokens) for mb in plan.micro_batches(rank)])
        result = local_run.run_step(step, ddp, group)
        out["steps"].append(
            {
                "loss": result.loss,
                "in_backward": ddp._hdp_in_order_launch.launched_in_backward,
                "grads": {n: p.main_grad.detach().clone() for n, p in model.named_parameters()},
            }
        )
    local_run.teardown()
    return out


def _reference(rank, world, lens):
    from megatron_bytescale.megatron import local_run
    from megatron_bytescale.runtime.batch import StepBatch, build_micro_batch_data

    from hdp_helpers import grads_of

    model, group = local_run.setup_model("tiny", seed=SEED)
    plan = one_rank_plan(lens)
    step = StepBatch(plan, 0, [build_micro_batch_data(mb, read_tokens) for mb in plan.micro_batches(0)])
    result = local_run.run_step(step, model, group)
    out = {"loss": result.loss, "grads": grads_of(model)}
    local_run.teardown()
    return out


def max_grad_diff(got: dict, ref: dict) -> float:
    assert got.keys() == ref.keys()
    return max(float((got[n] - ref[n]).abs().max()) for n in got)


def test_overlapped_reduction_is_exact_with_idle_and_ring_last_ranks():
    plan = three_rank_plan()
    outs = run_local_world(_overlapped, 3, plan.to_json(), timeout_s=180)
    (ref,) = run_local_world(_reference, 1, plan.seq_lens, timeout_s=120)
    buckets = outs[0]["buckets"]
    assert buckets > 4
    for rank, o in enumerate(outs):
        for s, st in enumerate(o["steps"]):
            assert st["loss"] == pytest.approx(ref["loss"], abs=TOL)
            assert max_grad_diff(st["grads"], ref["grads"]) < TOL, (rank, s)
    # first step: DDP's first batch launches in finish_grad_sync; then rank 0's backward does
    assert [o["steps"][0]["in_backward"] for o in outs] == [0, 0, 0]
    assert [o["steps"][1]["in_backward"] for o in outs] == [buckets, 0, 0]


# ------------------------------------------- distributed optimizer: reduce-scatter + param gather
LR = 0.5


def _reference_sgd(rank, world, lens, steps):
    """One rank, two steps of plain SGD on the full parameters: gradients of each step."""
    import torch

    from megatron_bytescale.megatron import local_run
    from megatron_bytescale.runtime.batch import StepBatch, build_micro_batch_data

    from hdp_helpers import grads_of

    model, group = local_run.setup_model("tiny", seed=SEED)
    plan = one_rank_plan(lens)
    out = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        step = StepBatch(plan, 0, [build_micro_batch_data(mb, read_tokens) for mb in plan.micro_batches(0)])
        result = local_run.run_step(step, model, group)
        out.append({"loss": result.loss, "grads": grads_of(model)})
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
    local_run.teardown()
    return out


def _sharded(rank, world, plan_json, ref):
    """DDP with the distributed optimizer's buffer layout: each rank's bucket shards hold the
    reduced gradients; an SGD step on those shards stands in for Megatron's DistributedOptimizer
    (CUDA-only); the next step's all-gather must bring every rank the whole updated model."""
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    from megatron_bytescale.megatron import local_run
    from megatron_bytescale.runtime.batch import StepBatch, build_micro_batch_data

    model, group = local_run.setup_model("tiny", seed=SEED)
    config = DistributedDataParallelConfig(
        overlap_grad_reduce=True, overlap_param_gather=True, use_distributed_optimizer=True, bucket_size=BUCKET
    )
    ddp = DistributedDataParallel(model.config, config, model)
    model.config.no_sync_func = ddp.no_sync
    model.config.finalize_model_grads_func = finalize_model_grads
    names = {p: n for n, p in model.named_parameters()}
    plan = Plan.from_json(plan_json)
    out = []
    for _s, expected in enumerate(ref):
        ddp.zero_grad_buffer()
        step = StepBatch(plan, rank, [build_micro_batch_data(mb, read_tokens) for mb in plan.micro_batches(rank)])
        result = local_run.run_step(step, ddp, group)
        worst = 0.0
        for buffer in ddp.buffers:
            for bucket in buffer.buckets:
                want = torch.zeros_like(bucket.grad_data)
                for p, (start, end) in bucket.param_to_index.items():
                    want[start:end] = expected["grads"][names[p]].flatten()
                mine = shard_buffer(bucket.grad_data, world)[rank]
                worst = max(worst, float((mine - shard_buffer(want, world)[rank]).abs().max()))
                with torch.no_grad():  # SGD on this rank's shard of the parameters
                    shard_buffer(bucket.param_data, world)[rank].sub_(LR * mine)
        out.append({"loss": result.loss, "worst": worst})
    local_run.teardown()
    return out


def test_distributed_optimizer_layout_with_overlapped_param_gather_is_exact():
    plan = three_rank_plan()
    (ref,) = run_local_world(_reference_sgd, 1, plan.seq_lens, 2, timeout_s=120)
    outs = run_local_world(_sharded, 3, plan.to_json(), ref, timeout_s=180)
    for rank, steps in enumerate(outs):
        for s, st in enumerate(steps):
            assert st["loss"] == pytest.approx(ref[s]["loss"], abs=TOL), (rank, s)
            assert st["worst"] < TOL, (rank, s, st["worst"])
    assert ref[1]["loss"] != pytest.approx(ref[0]["loss"], abs=1e-3)  # the update changed the model
