"""Word embeddings tied to the output layer under PP 2 x HDP 2 on gloo: the step equals one rank.

The first stage holds the word embeddings, the last a copy as its output layer; each gets only
its own part of the gradient, and ``runtime.grad_sync.make_finalize_grads`` sums the two over the
embedding group (first and last stage of one pipeline) before the HDP reduction, as Megatron's
``finalize_model_grads`` does. Both copies must then hold the whole gradient of one rank's tied
weight (measured: without that sum the worst gradient difference is 0.097, against a
tolerance of 2e-5). (Building the tied model with PP on CPU is ``cpu_compat``'s: megatron-core moves the
copy to CUDA at construction.)
"""

from __future__ import annotations

import pytest
import torch

from megatron_bytescale.local_world import preload, run_local_world
from megatron_bytescale.planner.contract import MicroBatch, Plan, whole_piece

from hdp_helpers import grads_of, read_tokens

preload(["megatron.core.models.gpt.gpt_model", "megatron_bytescale.megatron.local_run"])

SEED = 7
TOL = 2e-5
LENS = (21, 9, 14, 6)
EMBEDDING = "embedding.word_embeddings.weight"


def _tied_model(folder) -> str:
    """The tiny model with tied embeddings (its args file without the untie flag)."""
    from megatron_bytescale.planner.specs import MODEL_DIR

    path = folder / "tiny-tied.args"
    lines = (MODEL_DIR / "tiny.args").read_text().splitlines(True)
    path.write_text("".join(line for line in lines if "--untie-embeddings-and-output-weights" not in line))
    return str(path)


def _plan(num_ranks: int) -> Plan:
    """Every sequence whole; with 2 ranks each pipeline runs two micro-batches."""

    def on(rank):
        return tuple(MicroBatch((whole_piece(i, s, rank),)) for i, s in enumerate(LENS) if i % num_ranks == rank)

    ranks = tuple(on(r) for r in range(num_ranks))
    return Plan(num_ranks=num_ranks, capacity=max(LENS), num_layers=4, seq_lens=LENS, ranks=ranks).validate()


def _step(model, group, plan, rank):
    from megatron_bytescale.megatron import local_run
    from megatron_bytescale.runtime.batch import StepBatch, build_micro_batch_data

    step = StepBatch(plan, rank, [build_micro_batch_data(mb, read_tokens) for mb in plan.micro_batches(rank)])
    for p in model.parameters():
        p.grad = None
    return local_run.run_step(step, model, group)


def _reference(rank, world, model_args):
    from megatron_bytescale.megatron import local_run

    model, group = local_run.setup_model(model_args, seed=SEED)
    assert model.share_embeddings_and_output_weights and model.output_layer.weight is None
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    result = _step(model, group, _plan(1), 0)
    out = {"weights": weights, "loss": result.loss, "grads": grads_of(model)}
    local_run.teardown()
    return out


def _global_name(model, name: str) -> str:
    """A stage's parameter name as the same weight is called without PP (layers are numbered
    from 0 on every stage; the last stage's output layer is the tied embedding)."""
    if name == "output_layer.weight":
        return EMBEDDING
    if name.startswith("decoder.layers."):
        local, rest = name[len("decoder.layers.") :].split(".", 1)
        return f"decoder.layers.{model.decoder.layers[int(local)].layer_number - 1}.{rest}"
    return name


def _pipelined(rank, world, model_args, weights):
    from megatron.core import parallel_state

    from megatron_bytescale.megatron import local_run

    model, group = local_run.setup_model(model_args, pp=2, seed=SEED)
    stage = parallel_state.get_pipeline_model_parallel_rank()
    # megatron-core's construction made the last stage's copy equal to the first stage's embedding
    tied = model.shared_embedding_or_output_weight().detach().clone()
    names = {n: _global_name(model, n) for n, _ in model.named_parameters()}
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(weights[names[n]])
    result = _step(model, group, _plan(2), parallel_state.get_data_parallel_rank())
    out = {"stage": stage, "loss": result.loss, "names": names, "tied_at_start": tied, "grads": grads_of(model)}
    local_run.teardown()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    model_args = _tied_model(tmp_path_factory.mktemp("tied"))
    (ref,) = run_local_world(_reference, 1, model_args, timeout_s=120)
    return ref, run_local_world(_pipelined, 4, model_args, ref["weights"], timeout_s=180)


def test_tied_embeddings_under_pp2_by_hdp2_equal_one_rank(runs):
    ref, outs = runs
    assert [o["stage"] for o in outs] == [0, 0, 1, 1]
    # the copies start equal (construction's all-reduce over the embedding group ran on gloo)
    for first, last in ((outs[0], outs[2]), (outs[1], outs[3])):
        assert torch.equal(first["tied_at_start"], last["tied_at_start"])
    worst = 0.0
    for o in outs:
        assert o["loss"] == pytest.approx(ref["loss"], abs=TOL)
        for name, grad in o["grads"].items():
            worst = max(worst, float((grad - ref["grads"][o["names"][name]]).abs().max()))
    print(
        f"tied embeddings, PP=2 x HDP=2: loss {outs[0]['loss']:.8f} vs one rank {ref['loss']:.8f}; "
        f"max gradient difference {worst:.2e}"
    )
    assert worst < TOL, worst
    # both ends hold the tied weight, whose gradient is not small next to the tolerance
    held = {o["stage"]: [n for n in o["names"] if o["names"][n] == EMBEDDING] for o in outs}
    assert held == {0: [EMBEDDING], 1: ["output_layer.weight"]}
    assert float(ref["grads"][EMBEDDING].abs().max()) > 100 * TOL
