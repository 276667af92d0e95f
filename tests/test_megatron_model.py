"""megatron-core's GPTModel under HDP on CPU/gloo: our core attention, true-position RoPE, TP.

Every distributed check runs in fresh gloo processes (``run_local_world``), so the CPU patches
and Megatron's parallel state never leak into the pytest process.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_bytescale.errors import BytescaleError, ConfigError
from megatron_bytescale.local_world import preload, run_local_world
from megatron_bytescale.planner.contract import MicroBatch, Piece
from megatron_bytescale.planner.contract.zigzag import zigzag_ranges

from hdp_helpers import grads_of, read_tokens, shard_like

# import megatron-core once in the launcher's forkserver, not in every rank
preload(["megatron.core.models.gpt.gpt_model", "megatron.core.distributed", "megatron_bytescale.megatron.model"])

SEED = 11


def _whole(seq_id: int, seq_len: int, rank: int) -> Piece:
    return Piece(seq_id, seq_len, ((0, seq_len),), (rank,))


def _share(seq_id: int, seq_len: int, ring: tuple[int, ...], rank: int) -> Piece:
    return Piece(seq_id, seq_len, zigzag_ranges(seq_len, len(ring))[ring.index(rank)], ring)


def _prepare(pieces, rank):
    from megatron_bytescale.runtime.batch import build_micro_batch_data
    from megatron_bytescale.runtime.layout import MicroBatchLayout

    mb = MicroBatch(tuple(pieces))
    return build_micro_batch_data(mb, read_tokens), MicroBatchLayout.from_micro_batch(mb, rank)


def _token_losses(model, data, layout):
    """Per-token LM loss [T] of one micro-batch (loss-masked), run as the HDP step runs it."""
    from megatron_bytescale.runtime.context import active_micro_batch

    with active_micro_batch(layout, data.positions):
        loss = model(data.tokens[None], None, attention_mask=None, labels=data.labels[None])
    return loss[0] * data.loss_mask


def _by_token(data, values) -> dict[tuple[int, int], torch.Tensor]:
    """{(seq_id, position): value} for the tokens of one micro-batch."""
    keys = [(p.seq_id, pos) for p in data.micro_batch.pieces for pos in p.positions()]
    return dict(zip(keys, values.detach()))


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


# --------------------------------------------------------------- one rank: model + RoPE


def _forward_backward_packed(rank, world):
    import dataclasses

    from megatron_bytescale.megatron import cpu_compat, model, parallel
    from megatron_bytescale.megatron.core_attention import HDPCoreAttention
    from megatron_bytescale.megatron.rotary import TruePositionRotaryEmbedding
    from megatron_bytescale.planner.specs import ModelSpec

    parallel.init_parallel()
    gpt = model.build_gpt_model("tiny", seed=SEED)
    out = {
        "cpu_patches": cpu_compat.install(),
        "core_attention": type(gpt.decoder.layers[0].self_attention.core_attention) is HDPCoreAttention,
        "rope": isinstance(gpt.rotary_pos_emb, TruePositionRotaryEmbedding),
        "params": sum(p.numel() for p in gpt.parameters()),
    }
    # two documents packed in one micro-batch: each must see only itself, at positions from 0
    packed, packed_layout = _prepare([_whole(0, 13, rank), _whole(1, 9, rank)], rank)
    losses = _token_losses(gpt, packed, packed_layout)
    losses.sum().backward()
    grads = [p.grad for p in gpt.parameters()]
    out["finite"] = bool(torch.isfinite(losses).all()) and all(bool(torch.isfinite(g).all()) for g in grads)
    out["all_params_have_grads"] = all(g is not None and bool(g.abs().sum() > 0) for g in grads)
    alone, alone_layout = _prepare([_whole(1, 9, rank)], rank)
    with torch.no_grad():
        alone_losses = _token_losses(gpt, alone, alone_layout)
    out["packed_vs_alone"] = float((losses[13:].detach() - alone_losses).abs().max())
    out["loss_spread"] = float(losses[13:21].std())
    # a forward with no active micro-batch names the fix
    try:
        gpt(packed.tokens[None], None, attention_mask=None, labels=packed.labels[None])
        out["no_context_error"] = None
    except BytescaleError as exc:
        out["no_context_error"] = str(exc)
    # the MoE variant (Mistral-style layers) runs too: router and experts on the CPU
    moe = model.build_gpt_model(
        dataclasses.replace(ModelSpec.load("tiny"), num_experts=4, moe_router_topk=2), seed=SEED
    )
    _token_losses(moe, packed, packed_layout).sum().backward()
    experts = [p.grad for n, p in moe.named_parameters() if ".experts." in n]
    out["moe_expert_grads"] = len(experts) > 0 and all(g is not None and bool(torch.isfinite(g).all()) for g in experts)
    parallel.destroy_parallel()
    return out


def test_tiny_gpt_runs_forward_backward_on_cpu_with_document_masking():
    (out,) = run_local_world(_forward_backward_packed, 1, timeout_s=120)
    assert out["cpu_patches"] and out["core_attention"] and out["rope"]
    assert out["params"] > 100_000
    assert out["finite"] and out["all_params_have_grads"]
    # a document packed after another scores exactly as it does alone
    assert out["packed_vs_alone"] < 1e-5, out
    assert out["loss_spread"] > 1e-3  # the losses are real numbers, not a constant
    assert "active_micro_batch" in out["no_context_error"]
    assert out["moe_expert_grads"]


def _rope_checks(rank, world):
    from megatron_bytescale.megatron import model, parallel
    from megatron_bytescale.megatron.rotary import position_runs, true_position_emb

    parallel.init_parallel()
    gpt = model.build_gpt_model("tiny", seed=SEED)
    rotary = gpt.rotary_pos_emb.rotary  # megatron-core's own RotaryEmbedding
    out = {}
    # our table equals megatron's for 0..n-1, and megatron's rows at arbitrary true positions
    out["arange_equal"] = torch.equal(true_position_emb(rotary, torch.arange(100)), rotary(100))
    positions = torch.tensor([50_000, 50_001, 50_002, 3, 4, 0, 1, 2, 3, 50_003])
    reference = rotary.get_emb(50_004)[positions]
    out["scattered_equal"] = torch.equal(true_position_emb(rotary, positions), reference)
    out["runs"] = position_runs(torch.tensor([0, 1, 2, 7, 8, 50_000]))

    # model level: layer 1's rotated q/k of a zigzag chunk equal the whole sequence's rows
    class Captured(Exception):
        pass

    captured = {}

    def capture(module, args):
        captured["q"], captured["k"] = args[0].detach().clone(), args[1].detach().clone()
        raise Captured

    gpt.decoder.layers[0].self_attention.core_attention.register_forward_pre_hook(capture)

    def qk(data, layout):
        try:
            _token_losses(gpt, data, layout)
        except Captured:
            return captured["q"][:, 0], captured["k"][:, 0]
        raise AssertionError("layer 1 core attention was not reached")

    long_len, short_len = 50_016, 7
    ring = (0, 1)  # this rank holds the share of ring member 0: [0, 12504) and [37512, 50016)
    chunk, chunk_layout = _prepare([_whole(1, short_len, 0), _share(0, long_len, ring, 0)], 0)
    q_chunk, k_chunk = qk(chunk, chunk_layout)
    whole, whole_layout = _prepare([_whole(0, long_len, 0)], 0)
    q_whole, k_whole = qk(whole, whole_layout)
    short, short_layout = _prepare([_whole(1, short_len, 0)], 0)
    q_short, k_short = qk(short, short_layout)
    at = chunk.positions[short_len:]
    out["chunk_positions"] = (int(at[0]), int(at[-1]))
    out["q_diff"] = float((q_chunk[short_len:] - q_whole[at]).abs().max())
    out["k_diff"] = float((k_chunk[short_len:] - k_whole[at]).abs().max())
    out["short_diff"] = float((q_chunk[:short_len] - q_short).abs().max())
    # the same rows at their packed row index (what plain Megatron RoPE would use) differ
    row = torch.arange(short_len, chunk.num_tokens) - short_len
    out["row_index_diff"] = float((q_chunk[short_len:] - q_whole[row]).abs().max())
    parallel.destroy_parallel()
    return out


def test_rope_at_true_positions_matches_the_whole_sequence():
    (out,) = run_local_world(_rope_checks, 1, timeout_s=120)
    assert out["arange_equal"] and out["scattered_equal"]
    assert out["runs"] == [(0, 3), (7, 2), (50_000, 1)]
    assert out["chunk_positions"] == (0, 50_015)
    # q and k reach 0.72 here. Run alone they agree exactly (0.0); two full-suite runs gave
    # 1.0e-4 (not reproduced alone; cause not pinned down: the size of one ulp of a rotary
    # angle at position ~1,000 times |q|). 1e-3 still sits two orders of magnitude below the
    # row-index error asserted next.
    assert out["q_diff"] < 1e-3 and out["k_diff"] < 1e-3 and out["short_diff"] < 1e-5, out
    assert out["row_index_diff"] > 0.1, out


# ---------------------------------------------------------------------- tensor parallel


def _tp2_vs_tp1(rank, world):
    from megatron.core import parallel_state

    from megatron_bytescale.megatron import model, parallel

    pieces = [_whole(0, 19, 0), _whole(1, 12, 0)]
    runs = {}
    for tp in (2, 1):
        parallel.init_parallel(tp=tp)
        hdp = parallel.hdp_rank()  # TP 2: both ranks are HDP rank 0; TP 1: HDP ranks 0 and 1
        gpt = model.build_gpt_model("tiny", seed=SEED)
        data, layout = _prepare([Piece(p.seq_id, p.seq_len, p.ranges, (hdp,)) for p in pieces], hdp)
        losses = _token_losses(gpt, data, layout)
        losses.sum().backward()
        runs[tp] = (losses.detach(), gpt, parallel_state.get_tensor_model_parallel_rank())
        parallel.destroy_parallel()
    (loss2, gpt2, tp_rank), (loss1, gpt1, _) = runs[2], runs[1]
    full = dict(gpt1.named_parameters())
    weight_diff = grad_diff = 0.0
    for name, p in gpt2.named_parameters():
        weight_diff = max(weight_diff, float((p.detach() - shard_like(full[name].detach(), p, tp_rank, 2)).abs().max()))
        grad_diff = max(grad_diff, float((p.grad - shard_like(full[name].grad, p, tp_rank, 2)).abs().max()))
    return {
        "loss_diff": float((loss2 - loss1).abs().max()),
        "weight_diff": weight_diff,
        "grad_diff": grad_diff,
        "sharded": sum(p.numel() for p in gpt2.parameters()) < sum(p.numel() for p in gpt1.parameters()),
    }


def test_tp2_gives_the_same_weights_loss_and_grads_as_tp1():
    for out in run_local_world(_tp2_vs_tp1, 2, timeout_s=150):
        assert out["sharded"]
        assert out["weight_diff"] == 0.0, out  # shards of the same full weights
        assert out["loss_diff"] < 1e-5 and out["grad_diff"] < 1e-5, out


# ---------------------------------------------------------------- ring across HDP ranks


def _ring_vs_one_rank(rank, world, tp):
    from megatron_bytescale.megatron import model, parallel

    parallel.init_parallel(tp=tp)
    hdp, hdp_size = parallel.hdp_rank(), parallel.hdp_world_size()
    groups = {
        "hdp": dist.get_process_group_ranks(parallel.hdp_group()),
        "tp": dist.get_process_group_ranks(parallel.parallel_state.get_tensor_model_parallel_group()),
    }
    gpt = model.build_gpt_model("tiny", seed=SEED)
    # sequence 0 (37 tokens) rings over both HDP ranks; 1 and 2 are whole on one rank each
    ring = tuple(range(hdp_size))
    mine = [_share(0, 37, ring, hdp), _whole(1 + hdp, 11 - 4 * hdp, hdp)]
    data, layout = _prepare(mine, hdp)
    losses = _token_losses(gpt, data, layout)
    losses.sum().backward()
    ring_grads = grads_of(gpt)
    for g in ring_grads.values():
        dist.all_reduce(g, group=parallel.hdp_group())  # the step's gradient: sum over HDP ranks
    mine_by_token = _by_token(data, losses)

    gpt.zero_grad()
    everything = [_whole(0, 37, hdp), _whole(1, 11, hdp), _whole(2, 7, hdp)]
    ref, ref_layout = _prepare(everything, hdp)  # one rank, every sequence whole
    ref_losses = _token_losses(gpt, ref, ref_layout)
    ref_losses.sum().backward()
    ref_by_token = _by_token(ref, ref_losses)
    loss_diff = max(float((v - ref_by_token[key]).abs()) for key, v in mine_by_token.items())
    return {
        "groups": groups,
        "tokens": len(mine_by_token),
        "loss_diff": loss_diff,
        "grad_diff": _max_diff(ring_grads, grads_of(gpt)),
    }


@pytest.mark.parametrize("tp", [1, 2], ids=["hdp2", "tp2xhdp2"])
def test_ring_pieces_on_two_hdp_ranks_score_like_one_rank(tp):
    outs = run_local_world(_ring_vs_one_rank, 2 * tp, tp, timeout_s=150)
    # every token of the batch is scored exactly once across the HDP ranks of one TP rank
    assert sum(o["tokens"] for o in outs[::tp]) == 37 + 11 + 7
    for o in outs:
        assert o["loss_diff"] < 1e-5 and o["grad_diff"] < 1e-5, o
    if tp == 2:  # Megatron's order tp-dp: TP ranks adjacent, the HDP group strides over them
        assert [o["groups"] for o in outs] == [
            {"hdp": [0, 2], "tp": [0, 1]},
            {"hdp": [1, 3], "tp": [0, 1]},
            {"hdp": [0, 2], "tp": [2, 3]},
            {"hdp": [1, 3], "tp": [2, 3]},
        ]


# -------------------------------------------------------- CPU patches: DDP, RNG tracker


def _ddp_and_rng(rank, world):
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_bytescale.megatron import model, parallel

    parallel.init_parallel()
    out = {}
    gpt = model.build_gpt_model("tiny", seed=SEED)
    ddp = DistributedDataParallel(gpt.config, DistributedDataParallelConfig(), gpt)
    data, layout = _prepare([_whole(rank, 9 + 5 * rank, rank)], rank)  # different data per rank
    _token_losses(ddp, data, layout).sum().backward()
    ddp.finish_grad_sync()  # Megatron DDP averages over the data-parallel (HDP) group
    synced = {n: p.main_grad.clone() for n, p in gpt.named_parameters()}
    own = {}
    plain = model.build_gpt_model("tiny", seed=SEED)
    _token_losses(plain, data, layout).sum().backward()
    for n, p in plain.named_parameters():
        own[n] = p.grad.clone()
        dist.all_reduce(own[n])
        own[n] /= world
    out["ddp_diff"] = _max_diff(synced, own)
    out["buffer_device"] = str(ddp.buffers[0].grad_data.device)

    # the RNG tracker keeps its streams apart from the default generator
    tracker = tensor_parallel.get_cuda_rng_tracker()
    before = torch.get_rng_state()
    with tracker.fork():
        first = torch.rand(4)
    out["default_untouched"] = torch.equal(before, torch.get_rng_state())
    with tracker.fork():
        second = torch.rand(4)
    out["stream_advances"] = not torch.equal(first, second)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    with tracker.fork():
        again = torch.rand(4)
    out["reseed_repeats"] = torch.equal(first, again)
    parallel.destroy_parallel()
    return out


def test_megatron_ddp_and_rng_tracker_work_on_cpu():
    for out in run_local_world(_ddp_and_rng, 2, timeout_s=120):
        assert out["buffer_device"] == "cpu"
        assert out["ddp_diff"] < 1e-6, out
        assert out["default_untouched"] and out["stream_advances"] and out["reseed_repeats"], out


# ------------------------------------------------------------------------- bad input


def _bad_inputs(rank, world):
    import dataclasses

    from megatron_bytescale.megatron import model, parallel
    from megatron_bytescale.megatron.core_attention import check_config

    errors = {}

    def expect(name, fn, kind):
        try:
            fn()
        except kind as exc:
            errors[name] = str(exc)
        else:
            errors[name] = None

    expect("build_before_init", lambda: model.build_gpt_model("tiny"), ConfigError)
    expect("tp_not_dividing", lambda: parallel.init_parallel(tp=3), ConfigError)
    parallel.init_parallel(tp=2)
    expect("other_sizes", lambda: parallel.init_parallel(tp=1), ConfigError)
    spec, arch = model.load_model("tiny")
    config = model.transformer_config(spec, arch)
    expect("dropout", lambda: check_config(dataclasses.replace(config, attention_dropout=0.1)), ConfigError)
    learned = dataclasses.replace(arch, position_embedding_type="learned_absolute")
    expect("learned_positions", lambda: model.transformer_config(spec, learned), ConfigError)
    three_heads = dataclasses.replace(spec, num_attention_heads=3, num_query_groups=3, kv_channels=16)
    expect("heads_vs_tp", lambda: model.build_gpt_model(three_heads), ConfigError)
    moe = dataclasses.replace(spec, num_experts=4, moe_router_topk=2)
    expect("moe_tp", lambda: model.transformer_config(moe, arch), ConfigError)

    gpt = model.build_gpt_model("tiny", seed=SEED)
    data, layout = _prepare([_whole(0, 10, 0)], 0)
    from megatron_bytescale.runtime.context import active_micro_batch

    def wrong_length():
        with active_micro_batch(layout, data.positions):
            gpt(data.tokens[None, :8], None, attention_mask=None)

    expect("wrong_length", wrong_length, BytescaleError)
    parallel.destroy_parallel()
    return errors


def test_bad_configurations_and_inputs_name_the_fix():
    errors, _ = run_local_world(_bad_inputs, 2, timeout_s=120)
    expected_words = {
        "build_before_init": "init_parallel",
        "tp_not_dividing": "does not divide",
        "other_sizes": "destroy_parallel",
        "dropout": "--attention-dropout 0.0",
        "learned_positions": "--position-embedding-type rope",
        "heads_vs_tp": "split over tp",
        "moe_tp": "sequence parallelism",
        "wrong_length": "active micro-batch has 10 positions",
    }
    for name, words in expected_words.items():
        assert errors[name] is not None, f"{name}: no error raised"
        assert words in errors[name], (name, errors[name])


def test_init_parallel_needs_a_world():
    from megatron_bytescale.megatron import parallel

    with pytest.raises(ConfigError, match="init_process_group"):
        parallel.init_parallel()


def test_active_micro_batch_checks_its_inputs_and_does_not_nest():
    from megatron_bytescale.runtime.context import active_micro_batch, current_micro_batch
    from megatron_bytescale.runtime.layout import MicroBatchLayout

    with pytest.raises(BytescaleError, match="no micro-batch is active"):
        current_micro_batch()
    layout = MicroBatchLayout.from_micro_batch(MicroBatch((_whole(0, 5, 0),)), 0)
    with active_micro_batch(layout, torch.arange(5), counter="c") as active:
        assert current_micro_batch() is active and active.counter == "c" and active.num_tokens == 5
        with pytest.raises(BytescaleError, match="already active"):
            with active_micro_batch(layout, torch.arange(5)):
                pass
    with pytest.raises(BytescaleError, match="no micro-batch is active"):
        current_micro_batch()
    with pytest.raises(BytescaleError, match="differ from the layout"):
        with active_micro_batch(layout, torch.arange(1, 6)):
            pass
    with pytest.raises(BytescaleError, match="1-D"):
        with active_micro_batch(layout, torch.arange(5)[None]):
            pass
    with pytest.raises(BytescaleError, match="integer"):
        with active_micro_batch(layout, torch.arange(5.0)):
            pass
