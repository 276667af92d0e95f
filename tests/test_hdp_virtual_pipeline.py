"""Virtual pipeline stages under HDP: PP 2 x V 2 x HDP 2 on gloo trains exactly like one rank.

Four processes: two pipelines of two devices, each device holding two model chunks of one
layer (Megatron's interleaved layout: chunk c of device d is virtual stage c * 2 + d, so
device 0 holds layers 0 and 2, device 1 layers 1 and 3). Each pipeline runs its own
micro-batches through the interleaved order (``contract.interleaved_order``), which runs
any count; rings join the same device of both pipelines. The reference runs every sequence
whole on one rank without PP, from the same full weights. All cases run in one launch each way;
the last wraps each chunk in Megatron's DistributedDataParallel with ``overlap_grad_reduce``
and reduces with Megatron's ``finalize_model_grads`` over the list of chunks.
"""

from __future__ import annotations

import pytest

from megatron_bytescale.local_world import preload, run_local_world
from megatron_bytescale.planner.contract import (
    MicroBatch,
    Plan,
    encode_stage_orders,
    interleaved_order,
    plan_pipeline_deadlock,
    ring_pieces,
    whole_piece,
)

from hdp_helpers import global_layer_names, one_rank_reference, step_batch

preload(["megatron.core.models.gpt.gpt_model", "megatron_bytescale.megatron.local_run"])

SEED = 7
TOL = 2e-5
PP, V = 2, 2


def _interleaved(ranks) -> tuple:
    """Every pipeline's interleaved orders, as the plan's stage orders (so ``validate`` checks them)."""
    return encode_stage_orders([[interleaved_order(len(mbs), PP, d, V) for d in range(PP)] for mbs in ranks], V)


def ring_plan() -> Plan:
    """Pipeline 0 runs three micro-batches (not a multiple of PP), pipeline 1 two; a ring spans
    both pipelines (first on each) and offloads half of its activations."""
    lens = (22, 9, 6, 11, 5)
    ring = ring_pieces(0, 22, (0, 1))
    ranks = (
        (
            MicroBatch((ring[0],), offload_ratio=0.5),
            MicroBatch((whole_piece(1, 9, 0),)),
            MicroBatch((whole_piece(2, 6, 0),)),
        ),
        (MicroBatch((ring[1],), offload_ratio=0.5), MicroBatch((whole_piece(3, 11, 1), whole_piece(4, 5, 1)))),
    )
    return Plan(
        num_ranks=2,
        capacity=20,
        num_layers=2,
        seq_lens=lens,
        ranks=ranks,
        stage_orders=_interleaved(ranks),
        virtual_stages=V,
    ).validate()


def idle_plan() -> Plan:
    """Pipeline 1 has no micro-batch (it still joins the reduction); pipeline 0 runs three in
    the runtime's own interleaved order (the plan gives none)."""
    lens = (13, 7, 10)
    ranks = (tuple(MicroBatch((whole_piece(i, s, 0),)) for i, s in enumerate(lens)), ())
    return Plan(num_ranks=2, capacity=20, num_layers=2, seq_lens=lens, ranks=ranks, virtual_stages=V).validate()


def one_chunk_plan() -> Plan:
    """``idle_plan`` made for one chunk per device: the V = 2 model refuses it."""
    plan = idle_plan()
    return Plan(num_ranks=2, capacity=20, num_layers=2, seq_lens=plan.seq_lens, ranks=plan.ranks).validate()


def planned_plan() -> Plan:
    """What the planner makes with two chunks per device: rings across both pipelines in the
    chunk order it chose as the shortest safe one, run as planned."""
    from megatron_bytescale.planner.planner import PlannerConfig, plan_step

    from planner_cases import small_cost

    config = PlannerConfig(
        num_ranks=2, capacity=20, ranks_per_node=2, balance="none", pipeline_stages=PP, virtual_stages=V
    )
    return plan_step([30, 38, 12, 17, 5, 14], config, small_cost(num_layers=2)).validate()


CASES = {"ring": ring_plan, "idle": idle_plan, "planned": planned_plan}


def _interleaved_run(rank, world, plans_json, weights):
    import torch
    from megatron.core import parallel_state

    from megatron_bytescale.errors import PlanError
    from megatron_bytescale.megatron import local_run
    from megatron_bytescale.runtime.offload import ActivationOffloader, transformer_layers

    chunks, group = local_run.setup_model("tiny", pp=PP, vpp=V, seed=SEED, deallocate_pipeline_outputs=True)
    names = {k: g for c, m in enumerate(chunks) for k, g in global_layer_names(m, f"c{c}.").items()}
    params = {f"c{c}.{n}": p for c, m in enumerate(chunks) for n, p in m.named_parameters()}
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(weights[names[n]])
    layers = [layer for m in chunks for layer in transformer_layers(m)]
    offloader = ActivationOffloader(layers, keep_last=0, min_tensor_bytes=0)
    hdp = parallel_state.get_data_parallel_rank()
    out = {
        "stage": parallel_state.get_pipeline_model_parallel_rank(),
        "hdp": hdp,
        "names": names,
        "layers": [[layer.layer_number for layer in m.decoder.layers] for m in chunks],
    }
    for case, text in plans_json.items():
        step = step_batch(Plan.from_json(text), hdp)
        for p in params.values():
            p.grad = None
        try:
            result = local_run.run_step(step, chunks, group, offloader=offloader)
        except PlanError as exc:
            out[case] = {"error": str(exc)}
            continue
        out[case] = {
            "loss": result.loss,
            "tokens": result.global_tokens,
            "mbs": result.stats.micro_batches,
            "timings": len(result.stats.timings),
            "ring_bytes": result.stats.p2p_bytes,
            "stage_bytes": result.stats.pipeline_bytes,
            "offloaded": result.stats.offloaded_bytes,
            "grads": {n: p.grad.detach().clone() for n, p in params.items()},
        }
    offloader.remove()
    out["ddp"] = _ddp_steps(chunks, group, plans_json["ring"], hdp)
    local_run.teardown()
    return out


BUCKET = 4000  # parameters per bucket: several per chunk


def _ddp_steps(chunks, group, plan_json, hdp, steps=2):
    """Each chunk its own DDP (overlapped reduction, small buckets), as Megatron builds VPP
    models; two steps (the first is DDP's first batch). Gradients: the chunks' main_grad."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    from megatron_bytescale.megatron import local_run

    config = chunks[0].config
    ddps = [
        DistributedDataParallel(config, DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=BUCKET), m)
        for m in chunks
    ]
    config.no_sync_func = [d.no_sync for d in ddps]
    config.finalize_model_grads_func = finalize_model_grads
    out = []
    for _ in range(steps):
        for d in ddps:
            d.zero_grad_buffer()
        result = local_run.run_step(step_batch(Plan.from_json(plan_json), hdp), ddps, group)
        out.append(
            {
                "loss": result.loss,
                "buckets": sum(len(d.bucket_groups) for d in ddps),
                "in_backward": sum(d._hdp_in_order_launch.launched_in_backward for d in ddps),
                "grads": {
                    f"c{c}.{n}": p.main_grad.detach().clone()
                    for c, m in enumerate(chunks)
                    for n, p in m.named_parameters()
                },
            }
        )
    return out


@pytest.fixture(scope="module")
def runs():
    plans = {case: make() for case, make in CASES.items()}
    for plan in plans.values():
        assert plan_pipeline_deadlock(plan, PP) is None
    (ref,) = run_local_world(one_rank_reference, 1, {c: p.seq_lens for c, p in plans.items()}, SEED, timeout_s=120)
    texts = {c: p.to_json() for c, p in plans.items()} | {"one-chunk": one_chunk_plan().to_json()}
    outs = run_local_world(_interleaved_run, 4, texts, ref["weights"], timeout_s=180)
    return plans, ref, outs


def test_pp2_v2_by_hdp2_equals_one_rank(runs):
    plans, ref, outs = runs
    assert [(o["stage"], o["hdp"]) for o in outs] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    # Megatron's interleaved layout: device 0 holds layers 1 and 3 (1-based), device 1 layers 2 and 4
    assert [o["layers"] for o in outs] == [[[1], [3]], [[1], [3]], [[2], [4]], [[2], [4]]]
    for case, plan in plans.items():
        want = ref[case]
        assert want["tokens"] == sum(s - 1 for s in plan.seq_lens)
        worst = 0.0
        for o in outs:
            got = o[case]
            assert got["tokens"] == want["tokens"], case
            assert got["loss"] == pytest.approx(want["loss"], abs=TOL), case
            assert got["mbs"] == got["timings"] == len(plan.ranks[o["hdp"]])
            for name, grad in got["grads"].items():
                worst = max(worst, float((grad - want["grads"][o["names"][name]]).abs().max()))
        print(
            f"PP=2 x V=2 x HDP=2, {case}: loss {outs[0][case]['loss']:.8f} vs one rank {want['loss']:.8f}, "
            f"max gradient difference {worst:.3g}"
        )
        assert worst < TOL, (case, worst)
        # the chunks of all devices together hold every weight (nothing untested)
        assert {o["names"][n] for o in outs for n in o[case]["grads"]} == set(want["grads"])
    by = {(o["stage"], o["hdp"]): o for o in outs}
    assert plans["planned"].virtual_stages == V  # its chunk orders, or Megatron's when that is the shortest
    assert all(o["planned"]["ring_bytes"] > 0 for o in outs)  # the planner's rings ran
    assert all(o["ring"]["ring_bytes"] > 0 and o["ring"]["offloaded"] > 0 for o in outs)  # the ring ran, offloading
    assert all(
        o["ring"]["stage_bytes"] > 0 for o in outs
    )  # every device sends (device 1's chunk 0 to device 0's chunk 1)
    assert [by[(s, 1)]["idle"]["stage_bytes"] for s in range(PP)] == [0, 0]


def test_chunks_in_ddp_with_overlapped_reduction_are_exact(runs):
    """Every chunk's buckets launch after the device's last backward (none from backward
    hooks: a later backward may still post ring transfers), chunk by chunk on every rank."""
    _, ref, outs = runs
    want = ref["ring"]
    for o in outs:
        for st in o["ddp"]:
            assert st["buckets"] >= V and st["in_backward"] == 0  # Megatron buckets only the first stage finely
            assert st["loss"] == pytest.approx(want["loss"], abs=TOL)
            worst = max(float((g - want["grads"][o["names"][n]]).abs().max()) for n, g in st["grads"].items())
            assert worst < TOL, worst


def test_a_plan_for_another_chunk_count_is_refused_on_every_rank(runs):
    _, _, outs = runs
    errors = [o["one-chunk"].get("error") for o in outs]
    assert all(e is not None for e in errors), errors
    assert any("made for 1 virtual pipeline stages per device but the model has 2 chunks" in e for e in errors), errors
