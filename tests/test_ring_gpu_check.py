"""The GPU check script imports, and its logic (the shared ring code) runs in its CPU smoke mode."""

import json

from gpu_scripts import load_gpu_script


def load_script():
    return load_gpu_script("check_ring_attention")


def test_smoke_run_is_exact_and_writes_figures(tmp_path):
    out = tmp_path / "ring.json"
    assert load_script().main(["--smoke", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert [r["ring"] for r in figures["accuracy"]] == [2, 3, 4]
    for rec in figures["accuracy"]:
        assert max(rec["ring_err"].values()) < 1e-5, rec
        assert max(rec["ring_vs_one_call"].values()) < 1e-5, rec
    assert [(r["tokens"], r["ring"]) for r in figures["speed"]] == [(96, 2), (96, 4)]
    assert all(r["fused_ms"] > 0 and r["per_rank_ms"] > 0 for r in figures["speed"])


def test_without_a_gpu_the_full_check_refuses_to_run(capsys, monkeypatch):
    script = load_script()
    monkeypatch.setattr(script.torch.cuda, "is_available", lambda: False)
    assert script.main([]) == 2
    assert "--smoke" in capsys.readouterr().err
