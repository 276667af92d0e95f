import json

import pytest

from megatron_bytescale.errors import ConfigError
from megatron_bytescale.planner.cost_model import CostModel
from megatron_bytescale.planner.specs import HardwareSpec, ModelSpec

# the design's table (docs/design.md, section 3): layers, heads, KV groups, hidden, experts, top-k
BRIEF = {
    "llama-7b": (32, 32, 8, 4096, 0, 1),
    "llama-13b": (40, 40, 8, 5120, 0, 1),
    "llama-30b": (60, 56, 8, 6656, 0, 1),
    "llama-70b": (80, 64, 8, 8192, 0, 1),
    "mistral-8x7b": (32, 32, 8, 4096, 8, 2),
    "mistral-8x22b": (56, 48, 8, 6144, 8, 2),
    "deepseek-v3": (61, 128, 128, 7168, 256, 8),
    "deepseek-v2-lite-dense": (27, 16, 16, 2048, 0, 1),
    "qwen3-235b-a22b": (94, 64, 4, 4096, 128, 8),
    "qwen3-30b-a3b": (48, 32, 4, 2048, 128, 8),
}


@pytest.mark.parametrize("name", sorted(BRIEF))
def test_model_configs_match_the_design(name):
    m = ModelSpec.load(name)
    got = (m.num_layers, m.num_attention_heads, m.num_query_groups, m.hidden_size, m.num_experts, m.active_experts)
    assert got == BRIEF[name]


def test_unknown_model_and_hardware_name_the_choices():
    with pytest.raises(ConfigError, match="unknown model 'gpt-5'.*llama-7b"):
        ModelSpec.load("gpt-5")
    with pytest.raises(ConfigError, match="unknown hardware"):
        HardwareSpec.load("tpu")


def test_analytic_cost_model_is_plausible():
    cm = CostModel.analytic(ModelSpec.load("llama-7b"), HardwareSpec.load("h100"))
    # near Korthikanti et al.'s 34*h bytes per token per layer (bf16), less their dropout masks
    assert 26 * 4096 < cm.a2 < 34 * 4096
    # only the 8 KV heads travel: 2 * 8 * 128 * 2 bytes
    assert cm.kv_bytes_per_token == 4096
    # attention dominates beyond a few tens of K tokens for a 7B model
    assert cm.a1 * 8192**2 < cm.b1 * 8192 < cm.a1 * 65536**2
    tp2 = CostModel.analytic(ModelSpec.load("llama-7b"), HardwareSpec.load("h100"), tp=2)
    assert tp2.a1 == pytest.approx(cm.a1 / 2) and tp2.a2 == pytest.approx(cm.a2 / 2)
    assert tp2.kv_bytes_per_token == cm.kv_bytes_per_token / 2
    with pytest.raises(ConfigError, match="pipeline stages"):
        CostModel.analytic(ModelSpec.load("llama-7b"), HardwareSpec.load("h100"), pp=3)


def test_profile_round_trip_and_malformed_profiles(tmp_path):
    cm = CostModel.analytic(ModelSpec.load("llama-13b"), HardwareSpec.load("h800"))
    path = tmp_path / "profile.json"
    cm.to_profile(path, source="test")
    assert CostModel.from_profile(path) == cm
    data = json.loads(path.read_text())
    del data["a2"]
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="required field 'a2' is missing"):
        CostModel.from_profile(path)
    data["a2"] = "lots"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="field 'a2' must be a number"):
        CostModel.from_profile(path)
    data["a2"], data["a_typo"] = 1.0, 2.0
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=r"unknown field\(s\) \['a_typo'\]"):
        CostModel.from_profile(path)
    path.write_text("a1: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        CostModel.from_profile(path)


@pytest.mark.parametrize("granularity,method", [("full", "uniform"), ("selective", None)])
def test_every_layer_time_the_planner_uses_counts_the_recompute(granularity, method):
    """One cost formula: a short sequence before packing, a ring share on the ring sizer's
    curve (ring size 1: the whole sequence) and a micro-batch's layer time all include the
    forwards activation recompute runs again, so the balance scheduler weighs them alike."""
    from megatron_bytescale.planner.sizing.curves import ring_curves_of

    base = CostModel.analytic(ModelSpec.load("llama-7b"), HardwareSpec.load("h100"))
    cost = base.with_recompute(granularity, method)
    s = 4096
    whole = cost.num_layers * cost.layer_time(s, s * s)
    assert whole > base.num_layers * base.layer_time(s, s * s)  # recompute costs time
    assert cost.short_time(s, s) == pytest.approx(whole, rel=1e-12)
    _, times, _, _ = ring_curves_of(cost, [s], [1], [1], [False], 8, [])
    assert times[0] == pytest.approx(whole, rel=1e-12)
