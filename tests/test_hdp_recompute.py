"""Megatron's activation recompute under HDP: exact against one rank, ring bytes as predicted.

A recomputed layer re-runs its forward (ring attention and its KV hops included) during the
micro-batch's backward. Every ring member recomputes the same layers in the same order, so
the re-sent KV blocks pair up; the counter sees them, and ``Plan.p2p_bytes_per_rank`` predicts
them with ``recomputed_layers``. One launch of two gloo ranks runs every case in turn (full
uniform, full block, selective core_attn, and block recompute beside offloading) against one
reference run without recompute.
"""

from __future__ import annotations

import pytest

from megatron_bytescale.local_world import preload, run_local_world
from megatron_bytescale.planner.contract import MicroBatch, Plan, ring_pieces, whole_piece
from megatron_bytescale.planner.ring_traffic import p2p_bytes_per_rank

from hdp_helpers import grads_of, one_rank_plan, step_batch

preload(["megatron.core.models.gpt.gpt_model", "megatron_bytescale.megatron.local_run"])

SEED = 5
TOL = 2e-5
LAYERS = 4  # configs/models/tiny.args
KV_BYTES = 2 * 2 * 16 * 4  # tiny: 2 KV heads x 16 dims, K and V, fp32

CASES = {
    # name: (TransformerConfig overrides, layers whose forward runs twice, offload ratio)
    "full_uniform": (
        dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
        LAYERS,
        0.0,
    ),
    "full_block": (dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=3), 3, 0.0),
    "selective_core_attn": (dict(recompute_granularity="selective", recompute_modules=["core_attn"]), LAYERS, 0.0),
    # layers 0-1 recomputed, layer 2 offloaded (the last layer stays: keep_last=1)
    "block_and_offload": (dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2), 2, 1.0),
}


def two_rank_plan(ratio: float = 0.0) -> Plan:
    """Sequence 0 (31 tokens) over the ring (1, 0) beside local ones; rank 1 runs a second,
    local micro-batch after the ring one."""
    lens = (31, 6, 9, 4)
    share = dict(zip((1, 0), ring_pieces(0, 31, (1, 0))))
    ranks = (
        (MicroBatch((share[0], whole_piece(1, 6, 0)), ratio),),
        (MicroBatch((share[1], whole_piece(3, 4, 1)), ratio), MicroBatch((whole_piece(2, 9, 1),), ratio)),
    )
    return Plan(num_ranks=2, capacity=24, num_layers=LAYERS, seq_lens=lens, ranks=ranks).validate()


def _run(plan: Plan, overrides: dict, offload: bool) -> dict:
    from megatron.core import parallel_state

    from megatron_bytescale.megatron import local_run
    from megatron_bytescale.runtime.offload import ActivationOffloader, transformer_layers

    model, group = local_run.setup_model("tiny", seed=SEED, **overrides)
    hdp = parallel_state.get_data_parallel_rank()
    step = step_batch(plan, hdp)
    offloader = ActivationOffloader(transformer_layers(model), keep_last=1, min_tensor_bytes=0) if offload else None
    result = local_run.run_step(step, model, group, offloader=offloader)
    out = {"loss": result.loss, "p2p": result.stats.p2p_bytes, "grads": grads_of(model)}
    if offloader is not None:
        layers = offloader.last_stats().layers
        out["layer_saved"] = [layer.saved_bytes for layer in layers]
        out["layer_moved"] = [layer.offloaded_bytes for layer in layers]
    local_run.teardown()
    return out


def _all_cases(rank, world):
    outs = {}
    for name, (overrides, _, ratio) in CASES.items():
        outs[name] = _run(two_rank_plan(ratio), overrides, offload=ratio > 0)
    return outs


def _reference(rank, world, lens):
    return _run(one_rank_plan(lens, num_layers=LAYERS), {}, offload=False)


def max_grad_diff(got: dict, ref: dict) -> float:
    assert got.keys() == ref.keys()
    return max(float((got[n] - ref[n]).abs().max()) for n in got)


@pytest.fixture(scope="module")
def runs():
    plan = two_rank_plan()
    outs = run_local_world(_all_cases, 2, timeout_s=180)
    (ref,) = run_local_world(_reference, 1, plan.seq_lens, timeout_s=120)
    return plan, outs, ref


@pytest.mark.parametrize("case", list(CASES))
def test_recompute_is_exact_and_resends_what_the_plan_predicts(runs, case):
    plan, outs, ref = runs
    recomputed = CASES[case][1]
    predicted = p2p_bytes_per_rank(plan, KV_BYTES, KV_BYTES, num_layers=LAYERS, recomputed_layers=recomputed)
    without = p2p_bytes_per_rank(plan, KV_BYTES, KV_BYTES, num_layers=LAYERS)
    for rank, o in enumerate(d[case] for d in outs):
        assert o["loss"] == pytest.approx(ref["loss"], abs=TOL)
        assert max_grad_diff(o["grads"], ref["grads"]) < TOL, (case, rank)
        assert o["p2p"] == predicted[rank] > without[rank]  # the recomputed forwards re-sent their KV


def test_recomputed_layers_keep_nothing_and_the_others_are_offloaded(runs):
    _, outs, _ = runs
    for o in (d["block_and_offload"] for d in outs):
        assert o["layer_saved"][:2] == [0, 0]  # recomputed: nothing saved inside them
        assert o["layer_saved"][2] > 0 and o["layer_moved"][2] == o["layer_saved"][2]  # offloaded whole
        assert o["layer_moved"][3] == 0  # kept on the device (keep_last)
