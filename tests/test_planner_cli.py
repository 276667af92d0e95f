import json
import re

import pytest

from megatron_bytescale.cli import main
from megatron_bytescale.planner.contract import Plan

BASE = ["plan", "--model", "llama-7b", "--gpus", "16", "--capacity", "8K"]


def test_plan_prints_a_table_and_writes_valid_json(tmp_path, capsys):
    out = tmp_path / "plan.json"
    rc = main(BASE + ["--lengths", "1K,300K,4K,9K,8K,100K,70000", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0
    assert "rank" in text and "micro-batches" in text
    assert "s1[0:" in text and "ring 16#0" in text  # the 300K sequence's zigzag pieces, ring size and index
    assert "offload" in text
    assert "estimated step: max" in text
    plan = Plan.from_json(out).validate()
    assert plan.num_ranks == 16 and plan.seq_lens == (1024, 307200, 4096, 9216, 8192, 102400, 70000)
    assert plan.meta["strategy"] == "hdp-balanced"


def test_tp_pp_and_no_offload(tmp_path, capsys):
    out = tmp_path / "p.json"
    rc = main(
        BASE
        + ["--tp", "2", "--pp", "2", "--lengths", "20K,2K", "--no-offload", "--balance", "none", "--json", str(out)]
    )
    assert rc == 0
    plan = json.loads(out.read_text())
    assert plan["num_ranks"] == 4 and plan["num_layers"] == 16  # 16 GPUs / (TP 2 x PP 2); 32 layers / 2 stages
    assert plan["meta"]["strategy"] == "hdp-naive" and plan["meta"]["ranks_per_node"] == 4
    assert all(mb["offload_ratio"] == 0 for mbs in plan["ranks"] for mb in mbs)


def test_lengths_file(tmp_path, capsys):
    f = tmp_path / "lens.txt"
    f.write_text("4096\n\n131072\n  77 \n")
    assert main(BASE + ["--lengths-file", str(f)]) == 0
    assert "3 sequences" in capsys.readouterr().out


@pytest.mark.parametrize(
    "content, message",
    [
        ("4096\n12K\n", r"lens.txt, line 2: '12K' is not a whole number"),
        ("4096\n0\n", r"lens.txt, line 2: length 0 must be positive"),
        ("1 2\n", r"lens.txt, line 1: '1 2' is not a whole number"),
        ("\n\n", r"lens.txt: holds no lengths"),
    ],
)
def test_malformed_lengths_file_names_file_and_line(tmp_path, capsys, content, message):
    f = tmp_path / "lens.txt"
    f.write_text(content)
    assert main(BASE + ["--lengths-file", str(f)]) == 2
    assert re.search(message, capsys.readouterr().err)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--lengths", "1K,3M"], r"sequence 1 has 3145728 tokens, longer than the 2M context .*pass --cut"),
        (["--lengths", "1K,abc"], r"cannot read sequence length 'abc'"),
        (["--lengths", "1K", "--tp", "3"], r"--gpus 16 does not divide by TP x PP = 3"),
        (
            ["--lengths", "4M", "--context", "4M"],
            r"capacity too small: sequence of 4194304 tokens needs .*; raise --capacity ",
        ),
        (["--lengths", "4K,,4K"], r"--lengths 4K,,4K: item 2 of 3 is empty \(two commas in a row, or one at an end\)"),
        (["--lengths", "4K,"], r"--lengths 4K,: item 2 of 2 is empty"),
        (["--lengths-file", "/nonexistent/lens.txt"], r"lengths file /nonexistent/lens.txt: no such file"),
        (["--lengths", "1K", "--capacity", "0"], r"--capacity must be positive"),
    ],
)
def test_errors_name_the_problem_and_the_fix(capsys, extra, message):
    args = BASE + extra
    if "--capacity" in extra:
        args = [a for a in BASE if a not in ("--capacity", "8K")] + extra
    assert main(args) == 2
    assert re.search(message, capsys.readouterr().err)


def test_cut_sequences_to_the_context(tmp_path, capsys):
    out = tmp_path / "p.json"
    # 2M tokens on 16 ranks need r = 1 and 131,072 tokens per rank: 469 GB of pinned host
    # memory per GPU, over the hardware spec's 128 GB; a 1T budget lets them plan
    args = BASE + ["--lengths", "1K,3M", "--cut", "--json", str(out)]
    assert main(args) == 2
    assert "needs 51 ranks" in capsys.readouterr().err
    assert main(args + ["--host-memory-per-gpu", "1T"]) == 0
    plan = Plan.from_json(out).validate()
    assert plan.seq_lens == (1024, 2 * 1024 * 1024)
    assert plan.host_capacity == int(2**40 // (32 * 119_296))


def test_host_memory_bounds_every_offloaded_micro_batch(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert (
        main(
            [
                "plan",
                "--model",
                "llama-7b",
                "--gpus",
                "64",
                "--capacity",
                "8K",
                "--lengths",
                "2M",
                "--balance",
                "none",
                "--host-memory-per-gpu",
                "96G",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    plan = Plan.from_json(out).validate()
    per_token = 32 * 119_296  # activation bytes of one token over the 32 layers of LLaMA-7B
    worst = max(mb.tokens * mb.offload_ratio * 30 / 32 * per_token for mbs in plan.ranks for mb in mbs)
    assert 0 < worst <= 96 * 2**30


def test_global_batch_tokens_plans_a_lengths_file_step_by_step(tmp_path, capsys):
    """Steps of at most --global-batch-tokens, in file order, each printed as planned; --json
    holds one plan per line (what one step would plan alone)."""
    f = tmp_path / "lens.txt"
    lengths = [4096, 1000, 3000, 8192, 500, 600, 20000, 7]
    f.write_text("".join(f"{n}\n" for n in lengths))
    out = tmp_path / "plans.jsonl"
    assert (
        main(
            BASE
            + ["--lengths-file", str(f), "--global-batch-tokens", "20000", "--context", "20000", "--json", str(out)]
        )
        == 0
    )
    text = capsys.readouterr().out
    expected = [[4096, 1000, 3000, 8192, 500, 600], [20000], [7]]  # 17,388 tokens, then 20,000 would exceed
    assert [int(n) for n in re.findall(r"^step \d+: .*?HDP ranks, (\d+) sequences", text, re.M)] == [
        len(s) for s in expected
    ]
    assert text.rstrip().endswith("3 steps planned; plans written to " + str(out) + ", one JSON object per line")
    plans = [Plan.from_json(line) for line in out.read_text().splitlines()]
    assert [list(p.seq_lens) for p in plans] == expected
    assert main(BASE + ["--lengths", "4096,1000,3000,8192,500,600", "--json", str(tmp_path / "one.json")]) == 0

    def placement(plan):  # all but the planning time
        d = plan.to_dict()
        d["meta"].pop("plan_time_s", None)
        return d

    assert placement(Plan.from_json(tmp_path / "one.json")) == placement(plans[0])
