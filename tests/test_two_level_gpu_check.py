"""The two-level GPU check script imports, and its logic runs in its CPU smoke mode."""

import json

from gpu_scripts import load_gpu_script


def load_script():
    return load_gpu_script("check_two_level_attention")


def test_smoke_run_is_exact_and_writes_figures(tmp_path):
    out = tmp_path / "two_level.json"
    assert load_script().main(["--smoke", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert [(r["ring"], r["u"]) for r in figures["accuracy"]] == [(4, 2), (6, 3), (2, 2)]
    for rec in figures["accuracy"]:
        assert max(rec["two_level_err"].values()) < 1e-5, rec
        assert max(rec["two_level_vs_plain_ring"].values()) < 1e-5, rec
        assert max(rec["two_level_bf16_dkv_err"][k] for k in ("out", "dq")) < 1e-5, rec  # only dK/dV travel as bf16
    assert [(r["tokens"], r["u"]) for r in figures["speed"]] == [(96, 1), (96, 2), (96, 4)]
    assert all(r["fused_ms"] > 0 and r["per_rank_ms"] > 0 for r in figures["speed"])


def test_without_a_gpu_the_full_check_refuses_to_run(capsys, monkeypatch):
    script = load_script()
    monkeypatch.setattr(script.torch.cuda, "is_available", lambda: False)
    assert script.main([]) == 2
    assert "--smoke" in capsys.readouterr().err
