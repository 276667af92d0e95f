"""The HDP step on N gloo ranks trains exactly like one rank running the same global batch.

Every rank runs megatron-core's GPTModel through ``runtime.step.run_hdp_step`` (the step
Megatron-LM's patched loop runs) on its own micro-batches; the reference runs every sequence
whole on a single rank. Loss and every gradient must agree in fp32.
"""

from __future__ import annotations

import pytest

from megatron_bytescale.local_world import preload, run_local_world
from megatron_bytescale.planner.contract import MicroBatch, Plan, ring_pieces, whole_piece
from megatron_bytescale.planner.ring_traffic import p2p_bytes_per_rank

from hdp_helpers import grads_of, one_rank_plan, read_tokens, run_plan, shard_info, shard_like

preload(["megatron.core.models.gpt.gpt_model", "megatron_bytescale.megatron.local_run"])

SEED = 3
TOL = 2e-5


def mixed_plan() -> Plan:
    """Sequence 0 (40 tokens) over a ring of 3 ranks; short ones packed beside it and on rank 3,
    which runs two micro-batches. Lengths are not divisible by 2N."""
    lens = (40, 5, 9, 7, 3, 11)
    ring = (2, 0, 1)
    share = dict(zip(ring, ring_pieces(0, 40, ring)))  # 14, 13, 13 tokens
    ranks = (
        (MicroBatch((share[0],)),),
        (MicroBatch((share[1], whole_piece(4, 3, 1))),),
        (MicroBatch((share[2],)),),
        (
            MicroBatch((whole_piece(1, 5, 3), whole_piece(2, 9, 3))),
            MicroBatch((whole_piece(3, 7, 3), whole_piece(5, 11, 3))),
        ),
    )
    return Plan(num_ranks=4, capacity=18, num_layers=4, seq_lens=lens, ranks=ranks).validate()


def idle_rank_plan() -> Plan:
    """Three ranks; rank 2 has no micro-batch at all and must still join the reduction."""
    lens = (21, 6)
    share = ring_pieces(0, 21, (0, 1))
    ranks = ((MicroBatch((share[0],)),), (MicroBatch((share[1], whole_piece(1, 6, 1))),), ())
    return Plan(num_ranks=3, capacity=20, num_layers=4, seq_lens=lens, ranks=ranks).validate()


def _step(rank, world, plan_json, tp=1):
    from megatron.core import parallel_state

    from megatron_bytescale.megatron import local_run

    model, group = local_run.setup_model("tiny", tp=tp, seed=SEED)
    result = run_plan(plan_json, model, group)
    out = {
        "loss": result.loss,
        "tokens": result.global_tokens,
        "p2p": result.stats.p2p_bytes,
        "mbs": result.stats.micro_batches,
        "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
        "grads": grads_of(model),
        "shard_info": shard_info(model),
    }
    local_run.teardown()
    return out


def reference(lens):
    (ref,) = run_local_world(_step, 1, one_rank_plan(lens).to_json(), timeout_s=120)
    return ref


def max_grad_diff(got: dict, ref: dict) -> float:
    assert got.keys() == ref.keys()
    return max(float((got[n] - ref[n]).abs().max()) for n in got)


def test_mixed_batch_on_four_ranks_equals_one_rank():
    plan = mixed_plan()
    outs = run_local_world(_step, 4, plan.to_json(), timeout_s=150)
    ref = reference(plan.seq_lens)
    assert ref["tokens"] == sum(s - 1 for s in plan.seq_lens)
    assert [o["mbs"] for o in outs] == [1, 1, 1, 2]
    for o in outs:
        assert o["tokens"] == ref["tokens"]
        assert o["loss"] == pytest.approx(ref["loss"], abs=TOL)
        assert max_grad_diff(o["grads"], ref["grads"]) < TOL
    # the ring really communicated, exactly what the plan predicts (tiny: 2 KV heads x 16 dims)
    predicted = p2p_bytes_per_rank(
        plan, kv_bytes_per_token=2 * 2 * 16 * 4, grad_bytes_per_token=2 * 2 * 16 * 4, num_layers=4
    )
    assert [o["p2p"] for o in outs] == predicted
    assert outs[3]["p2p"] == 0 and outs[0]["p2p"] > 0


def test_a_rank_with_no_micro_batches_still_joins_the_reduction():
    plan = idle_rank_plan()
    outs = run_local_world(_step, 3, plan.to_json(), timeout_s=150)
    ref = reference(plan.seq_lens)
    assert outs[2]["mbs"] == 0
    for o in outs:
        assert o["loss"] == pytest.approx(ref["loss"], abs=TOL)
        assert max_grad_diff(o["grads"], ref["grads"]) < TOL


def test_tp2_by_hdp2_equals_one_rank():
    share = ring_pieces(0, 23, (0, 1))
    plan = Plan(
        num_ranks=2,
        capacity=20,
        num_layers=4,
        seq_lens=(23, 8, 5),
        ranks=((MicroBatch((share[0], whole_piece(1, 8, 0))),), (MicroBatch((share[1], whole_piece(2, 5, 1))),)),
    ).validate()
    outs = run_local_world(_step, 4, plan.to_json(), 2, timeout_s=180)
    ref = reference(plan.seq_lens)
    for o in outs:
        assert o["loss"] == pytest.approx(ref["loss"], abs=TOL)
        worst = 0.0
        for name, grad in o["grads"].items():
            tp_parallel, dim, stride = o["shard_info"][name]
            param = type(
                "P",
                (),
                {
                    "tensor_model_parallel": tp_parallel,
                    "partition_dim": dim,
                    "partition_stride": stride,
                    "shape": grad.shape,
                },
            )
            worst = max(worst, float((grad - shard_like(ref["grads"][name], param, o["tp_rank"], 2)).abs().max()))
        assert worst < TOL, worst


# ------------------------------------------------------------------ bad input, no hangs


def _bad_step(rank, world, case):
    from megatron_bytescale.errors import PlanError
    from megatron_bytescale.megatron import local_run
    from megatron_bytescale.runtime.batch import StepBatch, build_micro_batch_data

    model, group = local_run.setup_model("tiny", seed=SEED)
    plan = mixed_plan() if case != "world" else idle_rank_plan()  # idle plan: 3 ranks, world is 4
    mbs = [build_micro_batch_data(mb, read_tokens) for mb in plan.ranks[rank]] if rank < plan.num_ranks else []
    step = StepBatch(plan, rank, mbs)
    if case == "missing" and rank == 1:
        step = None
    if case == "disagree" and rank == 3:
        # another plan, same micro-batches for this rank (plan_digest ignores meta, which
        # holds each rank's own planning time)
        other = Plan.from_dict({**mixed_plan().to_dict(), "capacity": 19})
        step = StepBatch(other, rank, mbs)
    if case == "shapes" and rank == 0:
        step.micro_batches[0].tokens = step.micro_batches[0].tokens[:-1]
    try:
        local_run.run_step(step, model, group)
        return None
    except PlanError as exc:
        return str(exc)
    finally:
        local_run.teardown()


@pytest.mark.parametrize(
    "case, words",
    [
        ("world", "plan was made for 3 HDP ranks but the HDP group has 4"),
        ("missing", "no plan was delivered to this rank"),
        ("disagree", "disagree about this step's plan"),
        ("shapes", "pieces hold"),
    ],
)
def test_bad_deliveries_fail_on_every_rank_without_hanging(case, words):
    errors = run_local_world(_bad_step, 4, case, timeout_s=60)
    assert all(e is not None for e in errors), errors  # every rank stops, none waits on a peer
    assert any(words in e for e in errors), errors
