"""``bytescale verify``: HDP on N gloo ranks against one rank and the static mesh, as a user runs it."""

from __future__ import annotations

import json

import pytest

from megatron_bytescale import cli
from megatron_bytescale.errors import BytescaleError
from megatron_bytescale.verify import parse_lengths, passed, verify

KEYS = {
    "loss_ref",
    "loss_hdp",
    "max_abs_grad_diff",
    "max_rel_grad_diff",
    "p2p_bytes",
    "p2p_bytes_static",
    "ranks_per_sequence",
}


def test_verify_command_passes_and_writes_its_report(tmp_path, capsys):
    out = tmp_path / "verify.json"
    rc = cli.main(["verify", "--world-size", "3", "--lengths", "29,5,9,3,17", "--capacity", "12", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    report = json.loads(out.read_text())
    assert set(report) >= KEYS and report["ok"]
    assert report["loss_hdp"] == pytest.approx(report["loss_ref"], abs=1e-5)
    assert report["max_rel_grad_diff"] < 1e-5
    assert report["ranks_per_sequence"][0] == 3 and report["ranks_per_sequence"][1:4] == [1, 1, 1]
    # the static mesh rings every sequence over all CP ranks: more traffic for the same batch
    assert report["p2p_bytes"] == report["p2p_bytes_predicted"] > 0
    assert report["p2p_bytes_static"] > report["p2p_bytes"]
    assert "OK: HDP matches one rank" in text


def test_verify_runs_a_multi_latent_attention_model_over_both_ring_transports(tmp_path, capsys):
    """tiny-mla: the K/V ring and the latent ring each match one rank and send what the plan
    predicts; the latent ring's bytes are (latent + rope) / (heads x (qk + rope + v)) of the K/V
    ring's: 40 / 160 values per token."""
    out = tmp_path / "verify.json"
    argv = ["verify", "--world-size", "2", "--lengths", "41,9,23", "--capacity", "24", "--model", "tiny-mla"]
    rc = cli.main([*argv, "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    runs = json.loads(out.read_text())["ring_transports"]
    assert set(runs) == {"kv", "latent"} and runs["kv"]["values_per_token"] == 160
    for run in runs.values():
        assert run["max_rel_grad_diff"] < 1e-5 and run["p2p_bytes"] == run["p2p_bytes_predicted"] > 0
    assert runs["latent"]["p2p_bytes"] * 160 == runs["kv"]["p2p_bytes"] * 40
    assert "bytes by transport : K/V ring" in text and "0.250 of the K/V ring's" in text


def test_verify_with_offloading_is_still_exact():
    report = verify([20, 6, 3], world_size=2, capacity=12, offload_ratio=0.5)
    assert not passed(report), report
    assert report["offloaded_bytes"] > 0


def test_a_mismatch_is_reported_as_a_failure():
    report = {"loss_hdp": 1.0, "loss_ref": 1.5, "max_rel_grad_diff": 0.1, "p2p_bytes": 10, "p2p_bytes_predicted": 12}
    failures = passed(report)
    assert len(failures) == 3 and "loss differs" in failures[0] and "gradients differ" in failures[1]


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--world-size", "2", "--capacity", "8", "--lengths", "4,0"], "must be positive"),
        (["--world-size", "3", "--tp", "2", "--capacity", "8", "--lengths", "4"], "multiple of --tp 2"),
        (["--world-size", "2", "--capacity", "8", "--lengths", "4", "--offload-ratio", "1.5"], "in [0, 1]"),
        (["--world-size", "2", "--capacity", "8", "--lengths-file", "/nonexistent/lengths.txt"], "lengths.txt"),
        (
            ["--world-size", "2", "--tp", "0", "--capacity", "8", "--lengths", "4"],
            "--tp 0: the tensor-parallel size must be at least 1",
        ),
        (
            ["--world-size", "1000000", "--capacity", "8", "--lengths", "4"],
            "--world-size 1000000: this machine can hold at most",
        ),
        (
            ["--world-size", "2", "--capacity", "8", "--lengths", "4", "--dtype", "fp64"],
            "--dtype fp64 is not supported",
        ),
        (["--world-size", "2", "--capacity", "8", "--lengths", "4", "--offload-ratio", "nan"], "in [0, 1], got nan"),
        (["--world-size", "2", "--capacity", "nan", "--lengths", "4"], "cannot read --capacity 'nan'"),
        (["--world-size", "2", "--capacity", "8", "--lengths", "1,1,1"], "no token carries a label"),
        (
            ["--world-size", "2", "--capacity", "8", "--lengths", "40"],
            "the 40-token sequence does not fit on 2 HDP ranks of --capacity 8; raise --capacity or --world-size, or "
            "pass --offload-ratio R",
        ),
        (
            ["--world-size", "2", "--capacity", "8", "--lengths", "4", "--json", "/nonexistent/v.json"],
            "folder /nonexistent does not exist",
        ),
    ],
)
def test_bad_input_is_a_clear_error(argv, words, capsys):
    assert cli.main(["verify", *argv]) == 2
    assert words in capsys.readouterr().err


def test_a_bad_lengths_file_line_is_quoted_by_a_short_prefix(tmp_path, capsys):
    f = tmp_path / "lengths.txt"
    f.write_text("12\n" + "9x" * 2_500_000 + "\n")
    assert cli.main(["verify", "--world-size", "2", "--capacity", "8", "--lengths-file", str(f)]) == 2
    err = capsys.readouterr().err
    assert "line 2" in err and "(5,000,000 characters)" in err and len(err) < 400


def test_offload_ratio_plans_with_offloading_so_a_long_sequence_fits():
    # 40 tokens at capacity 12 need 4 ranks without offloading; offloading 0.9 fits them on 2
    report = verify([40, 6, 3], world_size=2, capacity=12, offload_ratio=0.9)
    assert not passed(report), report
    assert report["ranks_per_sequence"][0] == 2 and report["offloaded_bytes"] > 0
    assert report["offload_ratios"] and min(report["offload_ratios"]) >= 0.9
    assert "needs CP >= 4" in report["static_skipped"]  # the static mesh cannot hold it: not run


def test_bf16_against_a_bf16_reference():
    report = verify([20, 5, 9], world_size=2, capacity=12, dtype="bf16")
    assert report["dtype"] == "bf16" and not passed(report), report
    assert 0 < report["max_rel_grad_diff"] < 5e-2  # bf16 rounding differs, within the stated tolerance


def test_a_static_mesh_mismatch_and_an_empty_comparison_fail():
    good = {
        "loss_hdp": 1.0,
        "loss_ref": 1.0,
        "loss_static": 1.0,
        "max_rel_grad_diff": 0.0,
        "static_max_rel_grad_diff": 0.0,
        "p2p_bytes": 10,
        "p2p_bytes_predicted": 10,
        "label_tokens": 5,
    }
    assert passed(good) == []
    assert passed({**good, "static_max_rel_grad_diff": 0.1}) == [
        "static DPxCP gradients differ: max relative difference 1.00e-01 > 1e-05"
    ]
    assert passed({**good, "loss_static": 2.0}) == ["loss differs: static DPxCP 2.00000000 vs one rank 1.00000000"]
    assert "no token carries a label" in passed({**good, "label_tokens": 0})[0]


def test_lengths_parse_with_suffixes():
    assert parse_lengths("1K, 300,2", None) == [1024, 300, 2]
    with pytest.raises(BytescaleError, match="one of them"):
        parse_lengths("1,2", "lengths.txt")
