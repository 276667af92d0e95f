import json

import pytest

from megatron_bytescale.cli import main

SMALL = [
    "simulate",
    "--gpus",
    "16",
    "--gpus-per-node",
    "4",
    "--context",
    "64K",
    "--capacity",
    "8K",
    "--global-batch-tokens",
    "512K",
]


def test_simulate_prints_a_table_and_writes_json_and_plot(tmp_path, capsys):
    out, png = tmp_path / "sim.json", tmp_path / "sim.png"
    rc = main(SMALL + ["--steps", "2", "--seed", "3", "--json", str(out), "--plot", str(png)])
    text = capsys.readouterr().out
    assert rc == 0
    for name in ("static", "megatron-dcp", "hdp-sharding", "hdp-naive", "hdp-balanced"):
        assert name in text
    data = json.loads(out.read_text())
    assert data["config"]["gpus"] == 16 and data["config"]["capacity"] == 8192 and data["config"]["d_hdp"] == 16
    keys = {
        "step_time_s",
        "lower_bound_s",
        "busy_max_s",
        "busy_mean_s",
        "exposed_comm_s",
        "p2p_bytes",
        "offload_bytes",
        "microbatches_max",
        "plan_time_s",
    }
    static = data["results"]["static"]["per_batch"]
    for name, res in data["results"].items():
        assert keys <= set(res), name
        assert res["step_time_s"] >= res["lower_bound_s"] > 0
        # every batch's figures are kept, and the headline ratios are ratios of totals over them
        rows = res["per_batch"]
        assert len(rows) == 2 and all(keys <= set(r) for r in rows)
        total = sum(r["step_time_s"] for r in rows)
        assert res["total_step_time_s"] == pytest.approx(total)
        assert res["x_lower_bound"] == pytest.approx(total / sum(r["lower_bound_s"] for r in rows))
        assert res["speedup_vs_static"] == pytest.approx(sum(r["step_time_s"] for r in static) / total)
        per_batch = sorted(s["step_time_s"] / r["step_time_s"] for s, r in zip(static, rows))
        assert res["speedup_vs_static_per_batch_median"] == pytest.approx(sum(per_batch) / 2)
    assert data["results"]["static"]["offload_bytes"] == 0
    assert [b["tokens"] for b in data["batches"]] == [512 * 1024] * 2
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"


def test_simulate_reads_a_lengths_file(tmp_path, capsys):
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(["1000", "3000", "20000", "70000"]) + "\n")
    rc = main(SMALL + ["--steps", "1", "--strategies", "static,hdp-balanced", "--lengths-file", str(lengths)])
    assert rc == 0
    assert f"lengths file {lengths}" in capsys.readouterr().out


@pytest.mark.parametrize(
    "change, problem",
    [
        ({"--model": "gpt-9"}, "unknown model 'gpt-9'"),
        ({"--gpus": "18"}, "18 GPUs do not divide by TP x PP = 1 x 4"),
        ({"--capacity": "0"}, "capacity must be positive"),
        ({"--context": "4K"}, "context 4096 is smaller than the capacity 8192"),
        ({"--context": "1M"}, "does not fit on 16 HDP ranks of capacity 8192"),
        ({"--strategies": "static,fancy"}, "unknown strategy 'fancy'"),
        ({"--steps": "0"}, "--steps must be positive"),
    ],
)
def test_simulate_errors(change, problem, capsys):
    argv = list(SMALL)
    if change.get("--gpus") == "18":
        argv += ["--pp", "4"]
    for flag, value in change.items():
        if flag in argv:
            argv[argv.index(flag) + 1] = value
        else:
            argv += [flag, value]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "bytescale simulate: error:" in err and problem in err


def test_simulate_malformed_lengths_file(tmp_path, capsys):
    bad = tmp_path / "bad.txt"
    bad.write_text("100\n-5\n")
    assert main(SMALL + ["--lengths-file", str(bad)]) == 2
    assert f"lengths file {bad}, line 2: length -5 must be positive" in capsys.readouterr().err


def _documents(sizes):
    from megatron_bytescale.data.corpus import SourceDocument

    return [SourceDocument(f"doc{i}", (lambda n=n: iter([b"x" * n]))) for i, n in enumerate(sizes)]


def test_simulate_on_a_megatron_dataset_draws_the_training_batches(tmp_path, capsys):
    # a shadow run: the batches are GlobalBatchSampler's over the dataset's documents, each cut
    # at the 64K context as training would cut it (a 100K-byte document -> 64K + 36K windows)
    from megatron_bytescale.data.indexed import DocumentDataset, write_indexed_dataset
    from megatron_bytescale.data.sampler import GlobalBatchSampler, Position

    prefix = str(tmp_path / "docs")
    write_indexed_dataset(prefix, _documents([100_000, 3_000, 20_000, 500, 70_000, 9_000] * 4), source="test")
    out, png = tmp_path / "shadow.json", tmp_path / "shadow.png"
    rc = main(
        SMALL
        + [
            "--steps",
            "2",
            "--seed",
            "5",
            "--data-path",
            prefix,
            "--json",
            str(out),
            "--plot",
            str(png),
            "--strategies",
            "static,megatron-dcp,hdp-balanced",
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0
    assert f"shadow run on {prefix}: 24 documents" in text
    assert "HDP (hdp-balanced)" in text and "than static DP x CP" in text and "than Megatron's dynamic CP" in text
    data = json.loads(out.read_text())
    sampler = GlobalBatchSampler(
        DocumentDataset(prefix).lengths, step_tokens=512 * 1024, context_length=64 * 1024, seed=5
    )
    samples, pos = sampler.batch(Position())
    second, _ = sampler.batch(pos)
    want = [
        {"sequences": len(b), "longest": max(x.length for x in b), "tokens": sum(x.length for x in b)}
        for b in (samples, second)
    ]
    assert data["batches"] == want
    assert all(b["longest"] <= 64 * 1024 for b in data["batches"])
    assert data["dataset"]["documents_over_context"] == 8  # the 100K and 70K documents, four of each
    assert png.stat().st_size > 10_000


def test_simulate_refuses_a_missing_dataset(tmp_path, capsys):
    assert main(SMALL + ["--data-path", str(tmp_path / "nothing")]) == 2
    assert "bytescale simulate: error:" in capsys.readouterr().err
