"""``bytescale verify --two-level``: a user forces two-level attention on one sequence's ring."""

from __future__ import annotations

import json

import pytest

from megatron_bytescale import cli


def test_verify_two_level_is_exact_and_sends_what_the_plan_predicts(tmp_path, capsys):
    out = tmp_path / "verify.json"
    # two ranks, one group: the head all-to-all alone (the ring across groups is covered on 4 and
    # 6 ranks by tests/test_two_level_attention.py and test_two_level_step.py)
    rc = cli.main(
        [
            "verify",
            "--world-size",
            "2",
            "--lengths",
            "21,5,3",
            "--capacity",
            "12",
            "--two-level",
            "0:2",
            "--json",
            str(out),
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0, text
    report = json.loads(out.read_text())
    assert report["ok"] and report["two_level"] == {"seq": 0, "heads_split": 2}
    assert report["ranks_per_sequence"][0] == 2
    assert report["p2p_bytes"] == report["p2p_bytes_predicted"] > 0
    assert "two-level          : sequence 0's ring in groups of 2" in text


@pytest.mark.parametrize(
    "flag, words",
    [
        ("x", "give SEQ or SEQ:U"),
        ("7", "sequence 7 is not in the batch of 4"),
        ("1", "sequence 1 (5 tokens) runs whole on one rank"),
        ("0:3", "group size 3 must be >= 2 and divide sequence 0's ring of 4 ranks"),
        ("0:4", "group size 4 must divide the 4 query and 2 KV heads"),
    ],
)
def test_bad_two_level_requests_are_one_line_errors(flag, words, capsys):
    argv = ["verify", "--world-size", "4", "--lengths", "45,5,9,3", "--capacity", "12", "--two-level", flag]
    assert cli.main(argv) == 2
    assert words in capsys.readouterr().err
