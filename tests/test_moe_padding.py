"""Padding tokens stay out of a MoE router's load-balancing statistics: a micro-batch padded
to a multiple of 4 tokens (runtime.padding, as sequence parallelism and an expert-parallel
empty slot pad) gives the same loss and gradients as unpadded, with the aux loss on."""

from __future__ import annotations

from megatron_bytescale.local_world import preload, run_local_world
from megatron_bytescale.planner.contract import MicroBatch, Plan, whole_piece

from hdp_helpers import read_tokens

preload(["megatron.core.models.gpt.gpt_model", "megatron_bytescale.megatron.local_run"])


def _run(pad_to, pass_mask):
    import dataclasses

    import megatron_bytescale.runtime.step as step_module
    from megatron_bytescale.megatron import local_run
    from megatron_bytescale.runtime import padding
    from megatron_bytescale.runtime.batch import StepBatch, build_micro_batch_data

    model, group = local_run.setup_model(
        "tiny-moe", seed=3, moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.1
    )
    plan = Plan(
        num_ranks=1,
        capacity=20,
        num_layers=2,
        seq_lens=(9, 6),
        ranks=((MicroBatch((whole_piece(0, 9, 0), whole_piece(1, 6, 0))),),),
    ).validate()
    step = StepBatch(plan, 0, [build_micro_batch_data(mb, read_tokens) for mb in plan.micro_batches(0)])

    def unmasked(data, layout, multiple):  # what the router would count without the mask
        data, layout = padding.pad_micro_batch(data, layout, multiple)
        return dataclasses.replace(data, padding_mask=None), layout

    saved = step_module.sequence_parallel_multiple, step_module.pad_micro_batch
    step_module.sequence_parallel_multiple = lambda config: pad_to  # 15 tokens -> a multiple of pad_to
    step_module.pad_micro_batch = padding.pad_micro_batch if pass_mask else unmasked
    try:
        result = local_run.run_step(step, model, group)
    finally:
        step_module.sequence_parallel_multiple, step_module.pad_micro_batch = saved
        local_run.teardown()
    return {"tokens": result.global_tokens, "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters()}}


def _steps(rank, world):
    return [_run(1, True), _run(4, True), _run(4, False)]


def test_padding_tokens_do_not_change_the_aux_loss_gradients():
    ((plain, padded, counted),) = run_local_world(_steps, 1, timeout_s=120)
    assert padded["tokens"] == plain["tokens"] == 13
    router = [n for n in plain["grads"] if n.endswith("router.weight")]
    assert router
    worst = max(float((padded["grads"][n] - plain["grads"][n]).abs().max()) for n in plain["grads"])
    assert worst < 1e-6, worst
    # without the mask the padding token enters the aux loss and moves the router's gradient
    moved = max(float((counted["grads"][n] - plain["grads"][n]).abs().max()) for n in router)
    assert moved > 1e-4, moved
