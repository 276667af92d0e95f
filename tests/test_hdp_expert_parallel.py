"""Expert parallelism under HDP: EP=2 x HDP=4 on four gloo ranks (megatron-core's MoE layer,
4 experts, top-2, the all-to-all token dispatcher) trains exactly like one rank holding every
expert. The plan rings a sequence across the two EP groups and gives two ranks empty slots
(planner.expert.slots): they run one padding token that joins every all-to-all."""

from __future__ import annotations

import re
import zlib

import pytest

from megatron_bytescale.local_world import preload, run_local_world
from megatron_bytescale.planner.contract import MicroBatch, Plan, ring_pieces, whole_piece
from megatron_bytescale.planner.expert.slots import align_expert_slots

from hdp_helpers import one_rank_plan, run_plan

preload(["megatron.core.models.gpt.gpt_model", "megatron_bytescale.megatron.local_run"])

EXPERTS = 4
TOL = 2e-5
LOCAL_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


def ep_plan() -> Plan:
    """EP groups {0, 1} and {2, 3}; sequence 0 rings over ranks 1 and 2 (one member in each group)."""
    return align_expert_slots(unaligned_plan(num_layers=2), 2).validate()


def unaligned_plan(num_layers: int) -> Plan:
    """Four ranks' micro-batches before EP alignment: sequence 0 rings over ranks 1 and 2 after
    rank 2's own sequence; ranks 1 and 3 hold fewer micro-batches than their partners."""
    lens = (21, 9, 6, 11, 7, 5)
    ring = ring_pieces(0, 21, (1, 2))
    mb = lambda *p: MicroBatch(tuple(p))  # noqa: E731
    ranks = (
        (mb(whole_piece(1, 9, 0)), mb(whole_piece(2, 6, 0))),
        (mb(ring[0]),),
        (mb(whole_piece(3, 11, 2)), mb(ring[1])),
        (mb(whole_piece(4, 7, 3), whole_piece(5, 5, 3)),),
    )
    return Plan(num_ranks=4, capacity=24, num_layers=num_layers, seq_lens=lens, ranks=ranks).validate()


def global_name(name: str, ep_rank: int, local: int) -> str:
    """A parameter's name with its local expert index made global (EP rank e holds experts e*local..)."""
    return LOCAL_EXPERT.sub(lambda m: f".local_experts.{ep_rank * local + int(m.group(1))}.", name)


def _step(rank, world, plan_json, ep):
    import torch
    from megatron.core import parallel_state

    from megatron_bytescale.megatron import local_run

    # no load-balancing loss: it is a per-micro-batch statistic, different on one rank by design
    model, group = local_run.setup_model("tiny-moe", ep=ep, seed=5, moe_router_load_balancing_type="none")
    ep_rank, local = parallel_state.get_expert_model_parallel_rank(), EXPERTS // ep
    # the same weights for every expert whichever rank holds it (CPU initialisation draws a
    # rank's own experts only): each weight drawn from a generator seeded by its global name
    # (norms keep their ones), large enough that expert and router gradients are far above TOL
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm" not in name:
                gen = torch.Generator().manual_seed(zlib.crc32(global_name(name, ep_rank, local).encode()))
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    result = run_plan(plan_json, model, group)
    out = {
        "loss": result.loss,
        "tokens": result.global_tokens,
        "slots": result.stats.micro_batches,
        "grads": {global_name(n, ep_rank, local): p.grad.detach().clone() for n, p in model.named_parameters()},
    }
    local_run.teardown()
    return out


def test_ep2_by_hdp4_with_a_ring_across_ep_groups_and_empty_slots_equals_one_rank():
    plan = ep_plan()
    empty = [[not mb.pieces for mb in mbs] for mbs in plan.ranks]
    assert empty == [[False, False], [True, False], [False, False], [False, True]]
    outs = run_local_world(_step, 4, plan.to_json(), 2, timeout_s=180)
    (ref,) = run_local_world(_step, 1, one_rank_plan(plan.seq_lens, num_layers=2).to_json(), 1, timeout_s=120)
    assert len(ref["grads"]) == 2 * (5 + 2 * EXPERTS) + 3  # per layer: 2 norms, qkv, proj, router, 2 per expert
    experts_seen = set()
    for o in outs:
        assert o["slots"] == 2
        assert o["tokens"] == ref["tokens"] == sum(s - 1 for s in plan.seq_lens)  # padding not counted
        assert o["loss"] == pytest.approx(ref["loss"], abs=TOL)
        worst = 0.0
        for name, grad in o["grads"].items():
            experts_seen.add(name)
            worst = max(worst, float((grad - ref["grads"][name]).abs().max()))
        assert worst < TOL, worst
    assert experts_seen == set(ref["grads"])  # every expert's gradient compared (gathered from its holder)
