"""Sequence parallelism with TP under HDP: TP=2 + SP x HDP=2 (four gloo ranks) trains exactly
like one rank. Every micro-batch here holds an odd number of tokens, so each is padded to a
multiple of TP (a padding document of its own: never attended, out of the loss and the token
count); the ring still moves only the planned KV blocks.
"""

from __future__ import annotations

import pytest

from megatron_bytescale.local_world import preload, run_local_world
from megatron_bytescale.planner.contract import MicroBatch, Plan, ring_pieces, whole_piece
from megatron_bytescale.planner.ring_traffic import p2p_bytes_per_rank
from megatron_bytescale.runtime.padding import padding_for

from hdp_helpers import grads_of, one_rank_plan, run_plan, shard_info, shard_like

preload(["megatron.core.models.gpt.gpt_model", "megatron_bytescale.megatron.local_run"])

SEED = 11
TOL = 2e-5
KV_BYTES = 1 * 16 * 4 * 2  # tiny at TP 2: one KV head of 16 dims per shard, K and V, fp32


def sp_plan() -> Plan:
    lens = (23, 8, 5, 6)
    share = ring_pieces(0, 23, (0, 1))  # 12 and 11 tokens
    ranks = (
        (MicroBatch((share[0], whole_piece(2, 5, 0))),),  # 17 tokens
        (MicroBatch((share[1], whole_piece(1, 8, 1))), MicroBatch((whole_piece(3, 6, 1),))),  # 19, then 6
    )
    return Plan(num_ranks=2, capacity=20, num_layers=4, seq_lens=lens, ranks=ranks).validate()


def _step(rank, world, plan_json, tp, sequence_parallel):
    from megatron.core import parallel_state

    from megatron_bytescale.megatron import local_run

    model, group = local_run.setup_model("tiny", tp=tp, seed=SEED, sequence_parallel=sequence_parallel)
    result = run_plan(plan_json, model, group)
    out = {
        "loss": result.loss,
        "tokens": result.global_tokens,
        "p2p": result.stats.p2p_bytes,
        "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
        "sp_weights": sum(bool(getattr(p, "sequence_parallel", False)) for p in model.parameters()),
        "grads": grads_of(model),
        "shard_info": shard_info(model),
    }
    local_run.teardown()
    return out


def test_tp2_sequence_parallel_by_hdp2_equals_one_rank():
    plan = sp_plan()
    assert all(padding_for(mb.tokens, 2) for mbs in plan.ranks for mb in mbs[:1])  # padding happens
    outs = run_local_world(_step, 4, plan.to_json(), 2, True, timeout_s=180)
    (ref,) = run_local_world(_step, 1, one_rank_plan(plan.seq_lens).to_json(), 1, False, timeout_s=120)
    predicted = p2p_bytes_per_rank(plan, KV_BYTES, KV_BYTES, num_layers=4)
    assert ref["sp_weights"] == 0
    for o in outs:
        assert o["sp_weights"] == 2 * 4 + 1  # both norms of each layer and the final norm
        assert o["tokens"] == ref["tokens"] == sum(s - 1 for s in plan.seq_lens)  # padding not counted
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
    # ranks 0, 1 are HDP rank 0's TP pair, 2, 3 HDP rank 1's (TP varies fastest)
    assert [o["p2p"] for o in outs] == [predicted[0], predicted[0], predicted[1], predicted[1]]
