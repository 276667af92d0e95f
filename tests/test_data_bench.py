"""`bytescale dataloader-bench` in local mode (the Ray mode is compared in test_data_ray)."""

import json

import pytest

from megatron_bytescale import cli

from data_support import build_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return build_corpus(tmp_path_factory.mktemp("corpus"))


def bench(corpus, tmp_path, *extra):
    out = tmp_path / "bench.json"
    argv = [
        "dataloader-bench",
        "--ranks",
        "4",
        "--steps",
        "3",
        "--capacity",
        "1024",
        "--data",
        corpus,
        "--json",
        str(out),
    ]
    assert cli.main(argv + list(extra)) == 0
    return json.loads(out.read_text())


def test_bench_reports_timings_digest_and_bytes(corpus, tmp_path, capsys):
    result = bench(corpus, tmp_path, "--seed", "3")
    printed = capsys.readouterr().out
    for key in (
        "samples_digest",
        "plan_s_median",
        "delivery_s_median",
        "bytes_read_per_rank_max",
        "bytes_read_all_ranks",
    ):
        assert key in result and key in printed
    assert result["plan_s_median"] > 0 and result["delivery_s_median"] > 0
    step_bytes = result["bytes_if_every_rank_reads_all"] / 4
    # every token is read once, plus at most one label token per planned range
    assert step_bytes <= result["bytes_read_all_ranks"] < 1.05 * step_bytes
    assert result["bytes_read_per_rank_max"] < step_bytes
    assert bench(corpus, tmp_path, "--seed", "3")["samples_digest"] == result["samples_digest"]
    assert bench(corpus, tmp_path, "--seed", "4")["samples_digest"] != result["samples_digest"]


def test_bench_rejects_bad_counts(corpus, tmp_path, capsys):
    assert cli.main(["dataloader-bench", "--ranks", "0", "--data", corpus]) == 2
    assert "--ranks and --steps must be positive" in capsys.readouterr().err
