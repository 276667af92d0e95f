"""Expert parallelism with pipelines under HDP: PP 2 x EP 2 x HDP 4 on eight gloo ranks
(megatron-core's MoE layer, 4 experts, top-2, the all-to-all token dispatcher; one layer per
stage) trains exactly like one rank holding every expert and every layer.

The plan is the planner's alignment (``planner/expert/pipelines.py``): a sequence rings across
the two EP groups (HDP ranks 1 and 2), so its slot is one global slot on both, and members with
nothing to run hold padding-only fillers; each group's pipelines then run the same 1F1B order,
their stages' all-to-alls pairing slot by slot."""

from __future__ import annotations

import zlib

import pytest
from test_hdp_expert_parallel import EXPERTS, TOL, global_name, unaligned_plan

from megatron_bytescale.local_world import preload, run_local_world
from megatron_bytescale.planner.contract import Plan, plan_pipeline_deadlock
from megatron_bytescale.planner.expert.pipelines import align_pipelined_slots

from hdp_helpers import global_layer_names, one_rank_plan, run_plan

preload(["megatron.core.models.gpt.gpt_model", "megatron_bytescale.megatron.local_run"])

PP, EP = 2, 2


def ep_pipeline_plan() -> Plan:
    """``test_hdp_expert_parallel``'s four ranks, one layer per stage, aligned over both pipelines."""
    return align_pipelined_slots(unaligned_plan(num_layers=1), EP).validate()


def _step(rank, world, plan_json, pp, ep):
    import torch
    from megatron.core import parallel_state

    from megatron_bytescale.megatron import local_run

    # no load-balancing loss: a per-micro-batch statistic, different on one rank by design
    model, group = local_run.setup_model("tiny-moe", pp=pp, ep=ep, seed=5, moe_router_load_balancing_type="none")
    ep_rank, local = parallel_state.get_expert_model_parallel_rank(), EXPERTS // ep
    layers = global_layer_names(model)
    names = {n: global_name(layers[n], ep_rank, local) for n, _ in model.named_parameters()}
    # every weight drawn from a generator seeded by its name without PP or EP (norms keep ones)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm" not in name:
                gen = torch.Generator().manual_seed(zlib.crc32(names[name].encode()))
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    result = run_plan(plan_json, model, group)
    out = {
        "stage": parallel_state.get_pipeline_model_parallel_rank(),
        "loss": result.loss,
        "tokens": result.global_tokens,
        "slots": result.stats.micro_batches,
        "grads": {names[n]: p.grad.detach().clone() for n, p in model.named_parameters()},
    }
    local_run.teardown()
    return out


def test_pp2_by_ep2_by_hdp4_with_a_ring_across_ep_groups_equals_one_rank():
    plan = ep_pipeline_plan()
    assert plan_pipeline_deadlock(plan, PP) is None
    counts = [len(mbs) for mbs in plan.ranks]
    assert counts[0] == counts[1] and counts[2] == counts[3]  # lock-step within each EP group
    assert any(not mb.pieces for mbs in plan.ranks for mb in mbs)  # fillers join the all-to-alls
    outs = run_local_world(_step, PP * 4, plan.to_json(), PP, EP, timeout_s=240)
    (ref,) = run_local_world(_step, 1, one_rank_plan(plan.seq_lens, num_layers=2).to_json(), 1, 1, timeout_s=120)
    seen = set()
    for o in outs:
        assert o["tokens"] == ref["tokens"] == sum(s - 1 for s in plan.seq_lens)  # padding not counted
        assert o["loss"] == pytest.approx(ref["loss"], abs=TOL)
        worst = max(float((g - ref["grads"][n]).abs().max()) for n, g in o["grads"].items())
        assert worst < TOL, (o["stage"], worst)
        seen |= set(o["grads"])
    assert seen == set(ref["grads"])  # every layer's and expert's gradient compared
