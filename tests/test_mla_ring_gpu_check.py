"""The MLA ring GPU check script imports, and its logic runs in its CPU smoke mode: both ring
transports exact, the latent ring sending (latent + rope) / (heads x (qk + rope + v)) of the
K/V ring's bytes."""

import json

from gpu_scripts import load_gpu_script


def load_script():
    return load_gpu_script("check_mla_ring")


def test_smoke_run_is_exact_and_writes_figures(tmp_path):
    out = tmp_path / "mla_ring.json"
    assert load_script().main(["--smoke", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert [(r["ring"], r["transport"]) for r in figures["accuracy"]] == [
        (n, t) for n in (2, 3, 4) for t in ("kv", "latent")
    ]
    for rec in figures["accuracy"]:
        assert max(rec["ring_err"].values()) < 1e-5, rec
        assert max(rec["ring_vs_one_call"].values()) < 1e-5, rec
    speed = figures["speed"]
    assert [(r["tokens"], r["ring"], r["transport"]) for r in speed] == [
        (96, n, t) for n in (2, 4) for t in ("kv", "latent")
    ]
    assert all(r["fused_ms"] > 0 and r["per_rank_ms"] > 0 and max(r["ring_vs_one_call"].values()) < 1e-5 for r in speed)
    widths = figures["values_per_token"]
    for n in (2, 4):
        kv, latent = (
            next(r["bytes_sent"] for r in speed if (r["ring"], r["transport"]) == (n, t)) for t in ("kv", "latent")
        )
        assert latent * widths["kv"] == kv * widths["latent"] > 0


def test_without_a_gpu_the_full_check_refuses_to_run(capsys, monkeypatch):
    script = load_script()
    monkeypatch.setattr(script.torch.cuda, "is_available", lambda: False)
    assert script.main([]) == 2
    assert "--smoke" in capsys.readouterr().err
