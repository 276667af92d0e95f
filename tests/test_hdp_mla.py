"""Multi-latent attention and multi-token prediction in megatron-core's GPT under HDP (gloo ranks,
the project's HDP step and megatron-core's own modules): the loss and every gradient of one
step equal one rank's, with documents split over rings of 2 to 5 members.

* the tiny GQA model with two MTP depths: a token's next tokens on another ring member, or in
  its member's other zigzag chunk;
* the MLA model with plain RoPE (the YaRN one runs in ``bytescale verify`` and through
  pretrain_gpt.py) and one MTP depth, the latent ring, selective recompute of core attention
  and of MLA's up-projection;
* the MLA model's latent ring with TP = 2 (each TP rank's ring carries the whole latent; the
  latent's gradient is summed over TP): TP 2 x HDP 2 against TP 2 on one HDP rank.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_bytescale.local_world import preload, run_local_world
from megatron_bytescale.planner.contract import MicroBatch, Plan, ring_pieces, whole_piece

from hdp_helpers import grads_of, one_rank_plan, step_batch

preload(["megatron.core.models.gpt.gpt_model", "megatron_bytescale.megatron.local_run"])

SEED = 7
TOL = 2e-5  # relative to the largest reference gradient: fp32 sums in other orders
TIMEOUT_S = 240
MLA_ROPE = ("--rope-type", "rope")
RECOMPUTE = dict(recompute_granularity="selective", recompute_modules=["core_attn", "mla_up_proj"])


def five_rank_plan(transport: str = "kv", **by_size: str) -> Plan:
    """Rings of 5, 4, 3 and 2 members, whole sequences beside; 2 layers (the MLA model). Each
    ring carries ``transport``, or ``by_size["ring<n>"]`` for the ring of n members."""
    rings = {5: (0, 1, 2, 3, 4), 4: (1, 2, 3, 4), 3: (4, 0, 1), 2: (2, 3)}
    lens = [61, 37, 23, 14, 6, 9, 3]
    shares = {
        n: ring_pieces(i, lens[i], rings[n], transport=by_size.get(f"ring{n}", transport))
        for i, n in enumerate((5, 4, 3, 2))
    }
    at = lambda n, r: shares[n][rings[n].index(r)]  # noqa: E731
    mbs = [[[at(5, r)]] for r in range(5)]
    mbs[0] += [[at(3, 0), whole_piece(4, 6, 0)]]
    mbs[1] += [[at(4, 1)], [at(3, 1)]]
    mbs[2] += [[at(4, 2)], [at(2, 2), whole_piece(5, 9, 2)]]
    mbs[3] += [[at(4, 3)], [at(2, 3)]]
    mbs[4] += [[at(4, 4)], [at(3, 4), whole_piece(6, 3, 4)]]
    return Plan(5, 64, 2, tuple(lens), tuple(tuple(MicroBatch(tuple(p)) for p in r) for r in mbs)).validate()


def model_file(tmp_path, base: str, *extra: str) -> str:
    """configs/models/<base>.args with extra flags, as a file of its own."""
    from megatron_bytescale.planner.specs import MODEL_DIR

    path = tmp_path / f"{base}-{len(list(tmp_path.iterdir()))}.args"
    path.write_text((MODEL_DIR / f"{base}.args").read_text() + "\n" + "\n".join(extra) + "\n")
    return str(path)


def _step(rank, world, plan_json, model, tp, overrides):
    """One HDP step of the plan: the loss, every gradient and the bytes per ring transport."""
    from megatron.core import parallel_state

    from megatron_bytescale.megatron import local_run

    gpt, group = local_run.setup_model(model, tp=tp, seed=SEED, **overrides)
    result = local_run.run_step(
        step_batch(Plan.from_json(plan_json), parallel_state.get_data_parallel_rank()), gpt, group
    )
    out = {
        "loss": result.loss,
        "grads": grads_of(gpt),
        "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
        "bytes": result.stats.p2p_bytes_by_transport,
    }
    local_run.teardown()
    return out


def run(plan: Plan, model: str, tp: int = 1, **overrides) -> list[dict]:
    return run_local_world(_step, plan.num_ranks * tp, plan.to_json(), model, tp, overrides, timeout_s=TIMEOUT_S)


def compare(hdp: list[dict], ref: list[dict]) -> tuple[float, float]:
    """(relative loss gap, largest gradient difference relative to the reference's largest
    gradient of that parameter), each HDP rank against the reference rank of its TP rank."""
    by_tp = {r["tp_rank"]: r for r in ref}
    worst = 0.0
    for out in hdp:
        want = by_tp[out["tp_rank"]]["grads"]
        assert out["grads"].keys() == want.keys()
        for name, g in out["grads"].items():
            scale = float(want[name].abs().max()) or 1.0
            worst = max(worst, float((g - want[name]).abs().max()) / scale)
    return abs(hdp[0]["loss"] - ref[0]["loss"]) / abs(ref[0]["loss"]), worst


def test_multi_token_prediction_over_rings_of_two_to_five_equals_one_rank(tmp_path):
    """tiny (GQA, RoPE) with two MTP depths and a loss scale of 0.3: each depth's input ids,
    labels and loss mask shift along documents across ring members; the MTP layers' attention
    is the ring's."""
    model = model_file(tmp_path, "tiny", "--mtp-num-layers 2", "--mtp-loss-scaling-factor 0.3")
    plan = five_rank_plan()
    hdp, ref = run(plan, model), run(one_rank_plan(plan.seq_lens, 4), model)
    loss_gap, grad_gap = compare(hdp, ref)
    print(f"\nMTP 2 over rings of 2-5: loss {hdp[0]['loss']:.8f} vs {ref[0]['loss']:.8f}, gradients {grad_gap:.2e}")
    assert any(n.startswith("mtp.") for n in hdp[0]["grads"])  # the MTP layers' weights are compared too
    assert loss_gap < TOL and grad_gap < TOL


def test_mla_latent_ring_with_recompute_and_mtp_equals_one_rank(tmp_path):
    """tiny-mla with plain RoPE and one MTP depth: the latent ring (the latent and rotary key
    travel; the up-projection's gradient summed on each member), core attention and MLA's
    up-projection recomputed in backward, against one rank without recompute."""
    model = model_file(tmp_path, "tiny-mla", *MLA_ROPE, "--mtp-num-layers 1")
    plan = five_rank_plan("latent")
    hdp, ref = run(plan, model, **RECOMPUTE), run(one_rank_plan(plan.seq_lens, 2), model)
    loss_gap, grad_gap = compare(hdp, ref)
    print(f"\nMLA latent ring + recompute + MTP: loss gap {loss_gap:.1e}, gradients {grad_gap:.2e}")
    assert all(set(r["bytes"]) == {"latent"} for r in hdp)  # every ring carried the latent
    assert any("linear_kv_up_proj" in n for n in hdp[0]["grads"])
    assert loss_gap < TOL and grad_gap < TOL


def test_one_step_mixing_latent_and_kv_rings_equals_one_rank(tmp_path):
    """--hdp-mla-ring auto gives each ring the faster transport, so one step may hold both: the
    rings of 5 and 3 members carry the latent, those of 4 and 2 K and V, on the same ranks."""
    model = model_file(tmp_path, "tiny-mla", *MLA_ROPE)
    plan = five_rank_plan("kv", ring5="latent", ring3="latent")
    hdp, ref = run(plan, model), run(one_rank_plan(plan.seq_lens, 2), model)
    loss_gap, grad_gap = compare(hdp, ref)
    print(f"\nMLA latent and K/V rings in one step: loss gap {loss_gap:.1e}, gradients {grad_gap:.2e}")
    assert set(hdp[1]["bytes"]) == {"latent", "kv"}  # rank 1 holds a latent ring (5) and a K/V ring (4)
    assert loss_gap < TOL and grad_gap < TOL


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sequence-parallel"])
def test_mla_latent_ring_with_tensor_parallelism_equals_one_hdp_rank(tmp_path, sequence_parallel):
    """TP = 2 x HDP = 2 against TP = 2 on one HDP rank: a 45-token sequence on the ring beside
    whole ones. Every TP rank's ring carries the whole latent and re-expands its own heads; the
    latent's gradient from the other member is summed over TP (under sequence parallelism the
    latent is gathered first and its gradient reduce-scattered; megatron-core's torch norm
    refuses sequence parallelism, so that model has no Q/KV norms). The K/V ring at TP 2 is the
    plain ring's TP path, with K and V of this TP rank's heads."""
    model = "tiny-mla"
    if sequence_parallel:
        from megatron_bytescale.planner.specs import MODEL_DIR

        model = str(tmp_path / "tiny-mla-no-qk-norm.args")
        Path(model).write_text((MODEL_DIR / "tiny-mla.args").read_text().replace("--qk-layernorm\n", ""))
    lens = (45, 7, 12)
    share = ring_pieces(0, 45, (0, 1), transport="latent")
    ranks = (
        (MicroBatch((share[0], whole_piece(1, 7, 0))),),
        (MicroBatch((share[1],)), MicroBatch((whole_piece(2, 12, 1),))),
    )
    plan = Plan(2, 32, 2, lens, ranks).validate()
    hdp = run(plan, model, tp=2, sequence_parallel=sequence_parallel)
    ref = run(one_rank_plan(lens, 2), model, tp=2, sequence_parallel=sequence_parallel)
    loss_gap, grad_gap = compare(hdp, ref)
    print(f"\nMLA latent ring, TP 2, SP {sequence_parallel}: loss gap {loss_gap:.1e}, gradients {grad_gap:.1e}")
    assert all(set(r["bytes"]) == {"latent"} for r in hdp)
    assert loss_gap < TOL and grad_gap < TOL


def test_mla_rope_rows_are_megatrons_at_true_positions():
    """The MLA layer's RoPE (plain and YaRN, the table, YaRN's mscale, the fused kernel's
    cos/sin) answers Megatron's rows at each token's position."""
    from megatron.core.models.common.embeddings import RotaryEmbedding, YarnRotaryEmbedding

    from megatron_bytescale.megatron import cpu_compat
    from megatron_bytescale.megatron.rotary import TruePositionRotaryEmbedding
    from megatron_bytescale.runtime.context import active_micro_batch
    from megatron_bytescale.runtime.layout import MicroBatchLayout

    cpu_compat.install()
    ring = (0, 1, 2)
    mb = MicroBatch((ring_pieces(0, 5000, ring)[1], whole_piece(1, 40, 1)))
    layout = MicroBatchLayout.from_micro_batch(mb, 1)
    yarn = YarnRotaryEmbedding(
        8, rotary_base=10000, scaling_factor=4.0, mscale=1.0, mscale_all_dim=0.0, use_cpu_initialization=True
    )
    plain = RotaryEmbedding(8, rotary_percent=1.0, use_cpu_initialization=True)
    with active_micro_batch(layout, layout.positions):
        table, mscale = TruePositionRotaryEmbedding(yarn)(layout.num_tokens)
        cos, sin = TruePositionRotaryEmbedding(yarn).get_cached_cos_sin(layout.num_tokens, dtype=torch.float32)
        rows = TruePositionRotaryEmbedding(plain)(layout.num_tokens)
    full, full_mscale = yarn.get_emb(5000)
    cached_cos, cached_sin = yarn.get_cached_cos_sin(5000, dtype=torch.float32)
    assert mscale == full_mscale != 1.0
    assert torch.equal(table, full[layout.positions]) and torch.equal(rows, plain.get_emb(5000)[layout.positions])
    assert torch.equal(cos, cached_cos[layout.positions]) and torch.equal(sin, cached_sin[layout.positions])
