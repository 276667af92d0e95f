"""Multi-latent attention, MTP and the large MoE shapes in the cost model, checked against hand
arithmetic on tiny-mla's shapes and against the bytes ``bytescale verify --model tiny-mla``
measures (docs/results.md: K/V ring 3,712,000 B, latent ring 928,000 B)."""

import pytest
from test_sim_timeline import MS, cost_model

from megatron_bytescale.errors import ConfigError, PlanError
from megatron_bytescale.planner.contract import MicroBatch, Plan, ring_pieces, whole_piece
from megatron_bytescale.planner.cost_model import FORWARD_SHARE, CostModel, layer_shape
from megatron_bytescale.planner.planner import PlannerConfig, plan_step
from megatron_bytescale.planner.ring_traffic import p2p_bytes_per_rank
from megatron_bytescale.planner.specs import MODEL_DIR, HardwareSpec, ModelSpec, moe_layer_count, read_args_file
from megatron_bytescale.sim.cluster import Cluster
from megatron_bytescale.sim.timeline import critical_path, simulate

H100 = HardwareSpec.load("h100")
F, B = FORWARD_SHARE, 1 - FORWARD_SHARE


def tiny_mla(*extra: str) -> ModelSpec:
    return ModelSpec.from_args(read_args_file(MODEL_DIR / "tiny-mla.args") + list(extra), name="tiny-mla")


def test_tiny_mla_flops_and_ring_widths_by_hand():
    # h 64, 4 heads, q latent 32, kv latent 32, qk 16 + rope 8, v 16, SwiGLU FFN 128
    spec = ModelSpec.load("tiny-mla")
    assert spec.is_mla and spec.ring_values_per_token() == {"kv": 4 * (16 + 8 + 16), "latent": 32 + 8}
    cm = CostModel.analytic(spec, H100)
    flops = H100.flops
    q = 64 * 32 + 32 * 4 * (16 + 8)  # query down and up projections
    kv = 64 * (32 + 8) + 32 * 4 * (16 + 16)  # latent + rotary key down, K (no rope) and V up
    out = 4 * 16 * 64
    mlp = 3 * 64 * 128
    assert cm.b1 == pytest.approx(3 * 2 * (q + kv + out + mlp) / flops)
    assert cm.a1 == pytest.approx(3 * 2 * 4 * (24 + 16) / 2 / flops)  # QK^T over 24 dims, PV over 16
    assert (cm.kv_bytes_per_token, cm.grad_bytes_per_token) == (160 * 2, 160 * 4)
    assert (cm.latent_bytes_per_token, cm.latent_grad_bytes_per_token) == (40 * 2, 40 * 4)
    assert cm.o_bytes_per_token == 4 * 16 * 2 and cm.q_bytes_per_token == 4 * 24 * 2
    # re-expanding one received token: 32 x (4 x (16 + 16)) multiply-adds, once forward, three
    # times backward (again, and both gradients)
    assert cm.expand_s_per_token == pytest.approx(4 * 2 * 32 * 4 * 32 / flops)
    assert cm.expand_time(10) == pytest.approx(cm.expand_s_per_token * 10 / 4)
    assert cm.ring_transports == ("kv", "latent")
    # TP 2: K and V of half the heads, the latent whole on each TP rank
    tp2 = CostModel.analytic(spec, H100, tp=2)
    assert tp2.kv_bytes_per_token == cm.kv_bytes_per_token / 2 and tp2.latent_bytes_per_token == 80
    # a GQA model has no latent ring
    gqa = CostModel.analytic(ModelSpec.load("tiny"), H100)
    assert gqa.ring_transports == ("kv",)
    with pytest.raises(ConfigError, match="latent ring needs a multi-latent"):
        gqa.ring_bytes("latent")


def test_mtp_depths_are_layers_with_their_projection():
    base, mtp = ModelSpec.load("tiny-mla"), tiny_mla("--mtp-num-layers", "2")
    assert mtp.mtp_num_layers == 2 and mtp.attention_layers == 4
    a, b = CostModel.analytic(base, H100), CostModel.analytic(mtp, H100)
    assert b.num_layers == 4  # 2 layers + 2 MTP depths on the one stage
    per_layer = a.b1 * H100.flops / 6  # multiply-adds per token of one layer
    # the four layers' work plus two [embedding, hidden] -> hidden projections, averaged
    assert b.b1 * H100.flops / 6 == pytest.approx((4 * per_layer + 2 * 2 * 64 * 64) / 4)
    assert CostModel.analytic(mtp, H100, pp=2).num_layers == 1 + 2  # the MTP depths sit on the last stage


def test_latent_and_kv_ring_bytes_match_what_verify_measures():
    # bytescale verify --world-size 3 --lengths 300,90,45,200 --capacity 128 --model tiny-mla
    # moved 3,712,000 B on the K/V ring and 928,000 B on the latent ring (fp32 blocks on CPU,
    # fp32 accumulators): the same plan, the cost model's widths in fp32
    spec = ModelSpec.load("tiny-mla")
    cm = CostModel.analytic(spec, H100)
    plan = plan_step([300, 90, 45, 200], PlannerConfig(num_ranks=3, capacity=128, ranks_per_node=3, offload=False), cm)
    moved = {}
    for transport in ("kv", "latent"):
        moved[transport] = sum(
            p2p_bytes_per_rank(
                plan.with_ring_transport(transport),
                cm.kv_bytes_per_token * 2,  # bf16 -> fp32 blocks
                cm.grad_bytes_per_token,
                spec.num_layers,
                latent_bytes_per_token=cm.latent_bytes_per_token * 2,
                latent_grad_bytes_per_token=cm.latent_grad_bytes_per_token,
            )
        )
    assert moved == {"kv": 3_712_000, "latent": 928_000}
    with pytest.raises(PlanError, match="carries 'latent'"):
        p2p_bytes_per_rank(plan.with_ring_transport("latent"), 1.0, 1.0, 1)


def test_two_level_traffic_sends_outputs_of_the_value_head_dim():
    # ring of 4 in groups of 2, blocks of 2 tokens; q 3 B, output 1 B, KV 4 B, grad 2 B per token
    seq = ring_pieces(0, 8, (0, 1, 2, 3), heads_split=2)
    plan = Plan(num_ranks=4, capacity=100, num_layers=1, seq_lens=(8,), ranks=tuple((MicroBatch((p,)),) for p in seq))
    same = p2p_bytes_per_rank(plan, 4.0, 2.0, 1, q_bytes_per_token=3.0)
    less = p2p_bytes_per_rank(plan, 4.0, 2.0, 1, q_bytes_per_token=3.0, o_bytes_per_token=1.0)
    # per member, at 1/u of the heads: the output back for the group's other 2 tokens, and its
    # own 2 tokens' dout out: 2 * 2 token-widths of (3 - 1) B / 2 less
    assert [s - t for s, t in zip(same, less)] == pytest.approx([(2 + 2) * (3 - 1) / 2] * 4)


def latent_cost(**kw) -> CostModel:
    """test_sim_timeline's round numbers (linear 1 ms per token, NVLink 1000 B/s, network 100
    B/s), no attention FLOPs, K/V 8 B and dK/dV 16 B per token, latent 1 B and its gradient 2 B,
    re-expansion 4 ms per received token (1 ms forward, 3 ms backward)."""
    base = dict(
        kv_bytes_per_token=8.0,
        grad_bytes_per_token=16.0,
        latent_bytes_per_token=1.0,
        latent_grad_bytes_per_token=2.0,
        expand_s_per_token=4 * MS,
    )
    return cost_model(**{**base, **kw})


def ring_of_two(transport: str) -> Plan:
    r0, r1 = ring_pieces(0, 8, (0, 1))  # 4 tokens each
    return Plan(
        num_ranks=2,
        capacity=100,
        num_layers=1,
        seq_lens=(8,),
        ranks=((MicroBatch((r0,)),), (MicroBatch((r1,)),)),
    ).with_ring_transport(transport)


def test_latent_ring_moves_less_and_pays_the_re_expansion():
    cm = latent_cost()
    kv = simulate(ring_of_two("kv"), Cluster(2), cm)
    # K/V: forward linear F*4 ms + hop 4*8 B / 1000 B/s = 32 ms, then step 1 (no compute);
    # backward B*4 ms + hop 4*24 B = 96 ms, then the dK/dV hop home 4*16 B = 64 ms
    assert kv.step_time == pytest.approx(F * 4 * MS + 32 * MS + B * 4 * MS + 96 * MS + 64 * MS)
    lat = simulate(ring_of_two("latent"), Cluster(2), cm)
    # latent: hops of 4 B (4 ms) and 12 B (12 ms), the accumulator home 8 B (8 ms); step 1
    # re-expands the 4 received tokens: 4 ms forward, 12 ms backward
    assert lat.step_time == pytest.approx(F * 4 * MS + 4 * MS + 4 * MS + B * 4 * MS + 12 * MS + 12 * MS + 8 * MS)
    assert list(lat.busy) == pytest.approx([4 * MS + 16 * MS] * 2)  # linear + re-expansion, all compute
    assert list(lat.comm) == pytest.approx([4 * MS + 12 * MS + 8 * MS] * 2)
    # expensive re-expansion: the K/V ring wins, and the critical path takes the better ring
    slow = latent_cost(expand_s_per_token=100 * MS)
    assert simulate(ring_of_two("latent"), Cluster(2), slow).step_time > kv.step_time
    for model, cheaper in ((cm, "latent"), (slow, "kv")):
        # the cost model's one-ring formula is the timeline's, and picks the faster transport
        for t in ("kv", "latent"):
            assert model.ring_layer_time(8, 2, False, t) == pytest.approx(
                simulate(ring_of_two(t), Cluster(2), model).step_time
            )
        assert model.cheaper_transport(8, 2, False) == cheaper
        alone = min(
            critical_path([8], Cluster(2), model),
            critical_path([8], Cluster(2), model.with_overrides(latent_bytes_per_token=0.0)),
        )
        assert critical_path([8], Cluster(2), model) == pytest.approx(alone)


def test_local_work_of_a_latent_model_has_no_re_expansion():
    plan = Plan(num_ranks=1, capacity=100, num_layers=1, seq_lens=(5,), ranks=((MicroBatch((whole_piece(0, 5, 0),)),),))
    assert simulate(plan, Cluster(1), latent_cost()).step_time == pytest.approx(5 * MS)


def test_large_model_shapes():
    v3 = ModelSpec.load("deepseek-v3")
    assert (v3.num_experts, v3.moe_router_topk, v3.dense_layers, v3.mtp_num_layers) == (256, 8, 3, 1)
    assert v3.ring_values_per_token() == {"kv": 128 * (192 + 128), "latent": 576}  # ~71x fewer values
    tp8 = CostModel.analytic(v3, H100, tp=8)  # 16 heads a rank: the latent still under 1/8 of K and V
    assert tp8.latent_bytes_per_token / tp8.kv_bytes_per_token == pytest.approx(576 / 5120)
    assert 576 / 5120 < 1 / 8
    shape = layer_shape(v3)
    total = shape["params"] + 2 * v3.vocab_size * v3.hidden_size
    active = (shape["attention_params"] + shape["mlp_macs"] + shape["extra_macs"]) * v3.attention_layers
    assert 671e9 < total < 690e9 and 35e9 < active < 38e9  # 671B + the 14B MTP module; 37B active
    for name, (lo, hi), (alo, ahi) in (
        ("qwen3-235b-a22b", (234e9, 236e9), (20e9, 22e9)),
        ("qwen3-30b-a3b", (30e9, 31e9), (2.5e9, 3e9)),
        ("deepseek-v2-lite-dense", (2.5e9, 2.7e9), (2e9, 2.3e9)),
    ):
        spec = ModelSpec.load(name)
        shape = layer_shape(spec)
        assert lo < shape["params"] + 2 * spec.vocab_size * spec.hidden_size < hi, name
        assert alo < (shape["attention_params"] + shape["mlp_macs"]) * spec.attention_layers < ahi, name
    assert moe_layer_count("2", 5, "m") == 3 and moe_layer_count("[1,0]*2+[1]", 5, "m") == 3
    for bad in ("__import__('os')", "[2]*5", "[1]*4", "0"):
        with pytest.raises(ConfigError, match="moe-layer-freq"):
            moe_layer_count(bad, 5, "m")


def test_simulator_costs_each_ring_transport_of_an_mla_model():
    from megatron_bytescale.sim.simulate import SimConfig, default_strategies, run

    assert "hdp-latent" in default_strategies(1, "deepseek-v3") and "hdp-latent" not in default_strategies(1, "tiny")
    cfg = SimConfig(
        gpus=8,
        context=64 << 10,
        capacity=8 << 10,
        global_batch_tokens=256 << 10,
        model="deepseek-v2-lite-dense",
        strategies=("hdp-balanced", "hdp-latent", "hdp-auto"),
        steps=1,
    )
    report = run(cfg, progress=False)
    kv, latent = report.steps["hdp-balanced"][0], report.steps["hdp-latent"][0]
    # the same plan, its rings carrying 576 values per token instead of 16 x (192 + 128)
    assert kv["p2p_bytes"] > 0 and latent["p2p_bytes"] == pytest.approx(kv["p2p_bytes"] * 576 / 5120)
    assert latent["busy_max_s"] > kv["busy_max_s"]  # the re-expansion is compute
    assert len(report.steps["hdp-auto"]) == 1
    gqa = run(SimConfig(**{**cfg.__dict__, "model": "tiny", "context": 8 << 10, "capacity": 2 << 10}), progress=False)
    assert "multi-latent attention" in gqa.errors["hdp-latent"]


def test_auto_transport_gives_each_ring_the_faster_one():
    from megatron_bytescale.planner.planner import with_cheaper_transports

    # ranks 0, 1 share a node (fast links: K and V cost nothing to move, re-expanding does);
    # ring (1, 2) crosses to the next node, where K and V crawl and the latent wins
    cm = latent_cost(bw_intra_node=1e12)
    a0, a1 = ring_pieces(0, 8, (0, 1))
    b1, b2 = ring_pieces(1, 8, (1, 2))
    plan = Plan(
        num_ranks=3,
        capacity=100,
        num_layers=1,
        seq_lens=(8, 8),
        ranks=((MicroBatch((a0,)),), (MicroBatch((a1,)), MicroBatch((b1,))), (MicroBatch((b2,)),)),
    )
    assert (cm.cheaper_transport(8, 2, False), cm.cheaper_transport(8, 2, True)) == ("kv", "latent")
    chosen = with_cheaper_transports(plan, cm, ranks_per_node=2).validate()
    assert [[mb.transport for mb in mbs] for mbs in chosen.ranks] == [["kv"], ["kv", "latent"], ["latent"]]
    # through plan_step, on tiny-mla's verify batch: every ring carries its cheaper transport
    spec = ModelSpec.load("tiny-mla")
    h100 = CostModel.analytic(spec, H100)
    config = PlannerConfig(num_ranks=3, capacity=128, ranks_per_node=3, offload=False, ring_transport="auto")
    auto = plan_step([300, 90, 45, 200], config, h100).validate()
    rings = {mb.ring_key: mb for mbs in auto.ranks for mb in mbs if mb.ring_key}
    assert rings and all(
        mb.transport == h100.cheaper_transport(sum(p.seq_len for p in mb.pieces), len(key[0]), False)
        for key, mb in rings.items()
    )
