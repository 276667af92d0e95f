"""Pipeline parallelism under HDP: PP 2 x HDP 2 on gloo trains exactly like one rank.

Four processes: two pipelines of two stages (Megatron's rank order: stage 0 holds global
ranks 0 and 1, stage 1 ranks 2 and 3). Each pipeline runs its own micro-batches through
1F1B; rings join the same stage of both pipelines. The reference runs every sequence whole
on one rank without PP, from the same full weights. All cases run in one launch each way.
"""

from __future__ import annotations

import pytest

from megatron_bytescale.local_world import preload, run_local_world
from megatron_bytescale.planner.contract import (
    FORWARD,
    MicroBatch,
    Op,
    Plan,
    plan_pipeline_deadlock,
    ring_pieces,
    whole_piece,
)

from hdp_helpers import global_layer_names, grads_of, one_rank_reference, step_batch

preload(["megatron.core.models.gpt.gpt_model", "megatron_bytescale.megatron.local_run"])

SEED = 5
TOL = 2e-5
PP = 2


def uneven_counts_plan() -> Plan:
    """Pipeline 0 runs four micro-batches, pipeline 1 two; both rings span the pipelines at
    different indices (1 and 2 on pipeline 0, 0 and 1 on pipeline 1), and the first ring's
    micro-batch offloads half of its activations."""
    lens = (26, 19, 6, 9, 4)
    r1 = ring_pieces(0, 26, (0, 1))
    r2 = ring_pieces(1, 19, (1, 0))
    ranks = (
        (
            MicroBatch((whole_piece(2, 6, 0),)),
            MicroBatch((r1[0],), offload_ratio=0.5),
            MicroBatch((r2[1], whole_piece(4, 4, 0))),
            MicroBatch((whole_piece(3, 9, 0),)),
        ),
        (MicroBatch((r1[1],), offload_ratio=0.5), MicroBatch((r2[0],))),
    )
    return Plan(num_ranks=2, capacity=20, num_layers=2, seq_lens=lens, ranks=ranks).validate()


def idle_pipeline_plan() -> Plan:
    """Pipeline 1 has no micro-batch at all: it still joins the reduction."""
    lens = (13, 7, 10)
    ranks = ((MicroBatch((whole_piece(0, 13, 0),)), MicroBatch((whole_piece(1, 7, 0), whole_piece(2, 10, 0)))), ())
    return Plan(num_ranks=2, capacity=20, num_layers=2, seq_lens=lens, ranks=ranks).validate()


def deadlocking_plan() -> Plan:
    """Valid without pipelines (rings in the same relative order), but under 1F1B stage 1 of
    pipeline 1 waits in ring 2's forward while pipeline 0 waits in ring 1's backward."""
    lens = (10, 12, 5)
    r1, r2 = ring_pieces(0, 10, (0, 1)), ring_pieces(1, 12, (0, 1))
    ranks = (
        (MicroBatch((r1[0],)), MicroBatch((r2[0],))),
        (MicroBatch((r1[1],)), MicroBatch((whole_piece(2, 5, 1),)), MicroBatch((r2[1],))),
    )
    return Plan(num_ranks=2, capacity=20, num_layers=2, seq_lens=lens, ranks=ranks).validate()


def reordered_plan() -> Plan:
    """Not 1F1B: the ring is first on pipeline 0 and last on pipeline 1; pipeline 1's stages
    run it before their local work (and its backward before theirs), the order
    ``stage_schedule`` finds for these lengths (``tests/test_stage_schedule.py``)."""
    lens = (24, 12, 8, 5)
    ring = ring_pieces(0, 24, (0, 1))
    ranks = (
        (MicroBatch((ring[0],)), MicroBatch((whole_piece(1, 12, 0),))),
        (
            MicroBatch((whole_piece(2, 8, 1),)),
            MicroBatch((whole_piece(3, 5, 1),)),
            MicroBatch((ring[1],), offload_ratio=0.5),
        ),
    )
    orders = (
        ((0, 1, -1, -2), (0, -1, 1, -2)),
        ((2, 0, -3, -1, 1, -2), (2, -3, 0, -1, 1, -2)),
    )
    return Plan(num_ranks=2, capacity=20, num_layers=2, seq_lens=lens, ranks=ranks, stage_orders=orders).validate()


def deadlock_made_safe_plan() -> Plan:
    """``deadlocking_plan`` with stage orders that run one micro-batch at a time through
    both stages: the same micro-batches, no deadlock."""
    plan = deadlocking_plan()
    orders = tuple(
        tuple(tuple(c for m in range(len(mbs)) for c in (m, -1 - m)) for _ in range(PP)) for mbs in plan.ranks
    )
    return Plan(
        num_ranks=2, capacity=20, num_layers=2, seq_lens=plan.seq_lens, ranks=plan.ranks, stage_orders=orders
    ).validate()


CASES = {
    "uneven": uneven_counts_plan,
    "idle": idle_pipeline_plan,
    "reordered": reordered_plan,
    "deadlock-ordered": deadlock_made_safe_plan,
}


def _pipelined(rank, world, plans_json, weights):
    import torch
    from megatron.core import parallel_state

    from megatron_bytescale.errors import PlanError
    from megatron_bytescale.megatron import local_run
    from megatron_bytescale.runtime.offload import ActivationOffloader, transformer_layers

    # deallocate_pipeline_outputs: as Megatron-LM trains (outputs freed once sent, backward
    # through the C++ engine)
    model, group = local_run.setup_model("tiny", pp=PP, seed=SEED, deallocate_pipeline_outputs=True)
    names = global_layer_names(model)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(weights[names[n]])
    offloader = ActivationOffloader(transformer_layers(model), keep_last=0, min_tensor_bytes=0)
    hdp = parallel_state.get_data_parallel_rank()
    out = {
        "stage": parallel_state.get_pipeline_model_parallel_rank(),
        "hdp": hdp,
        "names": names,
    }
    for case, text in plans_json.items():
        plan = Plan.from_json(text)
        step = step_batch(plan, hdp)
        for p in model.parameters():
            p.grad = None
        try:
            result = local_run.run_step(step, model, group, offloader=offloader)
        except PlanError as exc:
            out[case] = {"error": str(exc)}
            continue
        out[case] = {
            "loss": result.loss,
            "tokens": result.global_tokens,
            "mbs": result.stats.micro_batches,
            "ring_bytes": result.stats.p2p_bytes,
            "stage_bytes": result.stats.pipeline_bytes,
            "offloaded": result.stats.offloaded_bytes,
            "first_is_ring": bool(result.stats.timings) and result.stats.timings[0].ring,  # by forward start
            "grads": grads_of(model),
        }
    offloader.remove()
    local_run.teardown()
    return out


@pytest.fixture(scope="module")
def runs():
    plans = {case: make() for case, make in CASES.items()}
    for plan in plans.values():
        assert plan_pipeline_deadlock(plan, PP) is None
    assert plan_pipeline_deadlock(deadlocking_plan(), PP)
    (ref,) = run_local_world(one_rank_reference, 1, {c: p.seq_lens for c, p in plans.items()}, SEED, timeout_s=120)
    texts = {c: p.to_json() for c, p in plans.items()} | {"deadlock": deadlocking_plan().to_json()}
    outs = run_local_world(_pipelined, 4, texts, ref["weights"], timeout_s=180)
    return plans, ref, outs


@pytest.mark.parametrize("case", sorted(CASES))
def test_pp2_by_hdp2_equals_one_rank(runs, case):
    plans, ref, outs = runs
    # Megatron's order tp-cp-ep-dp-pp: the stage is the slowest-moving coordinate
    assert [(o["stage"], o["hdp"]) for o in outs] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    want = ref[case]
    assert want["tokens"] == sum(s - 1 for s in plans[case].seq_lens)
    worst = 0.0
    for o in outs:
        got = o[case]
        assert got["tokens"] == want["tokens"]
        assert got["loss"] == pytest.approx(want["loss"], abs=TOL)
        assert got["mbs"] == len(plans[case].ranks[o["hdp"]])
        for name, grad in got["grads"].items():
            worst = max(worst, float((grad - want["grads"][o["names"][name]]).abs().max()))
    assert worst < TOL, worst
    # every stage of every pipeline together holds every weight once or more (nothing untested)
    assert {o["names"][n] for o in outs for n in o[case]["grads"]} == set(want["grads"])


def test_rings_span_pipelines_with_different_counts_and_offload(runs):
    _, _, outs = runs
    by = {(o["stage"], o["hdp"]): o["uneven"] for o in outs}
    assert [by[(0, h)]["mbs"] for h in (0, 1)] == [4, 2]
    assert all(o["ring_bytes"] > 0 for o in by.values())  # both rings ran on both stages
    assert all(o["offloaded"] > 0 for o in by.values())  # the ring micro-batch offloaded
    assert by[(0, 0)]["stage_bytes"] > 0 and by[(1, 1)]["stage_bytes"] > 0  # activations and gradients moved


def test_a_pipeline_with_no_micro_batch_joins_the_reduction(runs):
    _, _, outs = runs
    idle = [o["idle"] for o in outs if o["hdp"] == 1]
    assert [o["mbs"] for o in idle] == [0, 0]
    assert all(o["stage_bytes"] == 0 and o["ring_bytes"] == 0 for o in idle)


def test_stage_orders_from_the_plan_are_what_runs(runs):
    """The reordered plan's pipeline 1 runs its ring first although it is last in its list
    (1F1B would run the local micro-batches first); the deadlocking plan runs once it
    carries orders."""
    plans, _, outs = runs
    assert plans["reordered"].stage_order(1, 0)[0] == Op(FORWARD, 2)
    assert all(o["reordered"]["ring_bytes"] > 0 for o in outs)
    assert all(o["reordered"]["first_is_ring"] for o in outs)  # pipeline 1 too: its ring went first
    assert all("error" not in o["deadlock-ordered"] for o in outs)
    assert (
        plan_pipeline_deadlock(deadlocking_plan(), PP) and plan_pipeline_deadlock(plans["deadlock-ordered"], PP) is None
    )


def test_an_order_that_deadlocks_under_1f1b_is_refused_on_every_rank(runs):
    _, _, outs = runs
    errors = [o["deadlock"].get("error") for o in outs]
    assert all(e is not None for e in errors), errors
    assert any("deadlocks under 1F1B with 2 stages" in e for e in errors), errors
