"""The flag table (megatron/megatron_flags.tsv): every Megatron flag honoured, refused or of no
effect under HDP, consistent in itself, applied as written, and shown in docs/cluster.md.

That the table covers each tree's real parser is tests/test_arguments_megatron.py's
(``test_every_megatron_flag_is_classified``: it needs a Megatron-LM checkout)."""

import argparse
import re
from pathlib import Path

import pytest

from megatron_bytescale.errors import ConfigError
from megatron_bytescale.megatron import flag_table

ROOT = Path(__file__).resolve().parent.parent


def test_the_table_is_consistent():
    assert flag_table.problems() == []
    assert len(flag_table.rows()) > 900  # the union of the three trees' parsers


def test_docs_show_the_counts_of_the_table():
    assert flag_table.counts_markdown() in (ROOT / "docs/cluster.md").read_text()


def test_honoured_rows_name_tests_that_exist():
    named = 0
    for row in flag_table.rows().values():
        for path, name in re.findall(r"(tests/\w+\.py)::(\w+)", row.text):
            source = (ROOT / path).read_text()
            assert re.search(rf"^def {name}\(", source, re.M), (row.flag, path, name)
            named += 1
    assert named > 20


FIX_VERBS = re.compile(r"\b(drop|use|add|pass|run|choose|keep|upcycle|set)\b")


def test_each_refusal_is_one_line_naming_the_fix():
    for row in flag_table.rows().values():
        if row.verdict != "refused" or row.check:
            continue
        text = flag_table.message(row, "X")
        assert "\n" not in text and "--" in text and FIX_VERBS.search(text), (row.flag, text)


def test_every_refusal_message_is_written_once():
    """The table is the one source of its messages: none is repeated in the validator's code."""
    code = "".join(
        (ROOT / "megatron_bytescale/megatron" / name).read_text()
        for name in ("arguments.py", "pretrain_hooks.py", "preflight.py", "launch.py")
    )
    for row in flag_table.rows().values():
        if row.verdict == "refused" and not row.check and not row.text.startswith("="):
            head = max(row.text.split("{value}"), key=len)[:60]
            assert head not in code, (row.flag, head)


def _namespace(**values):
    return argparse.Namespace(**values)


@pytest.mark.parametrize(
    "values, message",
    [
        (dict(window_size="64,0"), "--window-size: HDP ring attention is full causal attention"),
        (dict(window_attn_skip_freq=2), "--window-size: HDP ring attention is full causal attention"),
        (dict(softmax_type="learnable"), "--softmax-type learnable: HDP ring attention merges blocks"),
        (
            dict(moe_router_load_balancing_type=["aux_loss", "global_aux_loss"]),
            "--moe-router-load-balancing-type aux_loss global_aux_loss: global_aux_loss",
        ),
        (dict(context_parallel_size=2), "--context-parallel-size 2 is a static CP mesh"),
        (dict(micro_batch_size=None), "use --micro-batch-size 1"),
        (dict(step_batch_size_schedule="0:8"), "--step-batch-size-schedule 0:8 is not supported"),
        (dict(iterations_to_skip=[3]), "--iterations-to-skip"),
    ],
)
def test_a_refused_value_is_one_line_from_its_row(values, message):
    with pytest.raises(ConfigError) as exc:
        flag_table.refuse(_namespace(**values))
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_allowed_values_pass():
    flag_table.refuse(
        _namespace(
            window_size=None,
            softmax_type="vanilla",
            moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"],
            context_parallel_size=1,
            micro_batch_size=1,
            calculate_per_token_loss=True,
            attention_dropout=0.0,
            position_embedding_type="rope",
            ckpt_format="torch_dist",
        )
    )


def test_a_megatron_flag_the_table_does_not_know_is_refused():
    given = flag_table.given_flags(["--num-layers", "4", "--hybrid-data-parallel", "--hdp-token-capacity=8K"])
    assert given == ["--num-layers", "--hybrid-data-parallel", "--hdp-token-capacity"]
    flag_table.refuse(_namespace(), given)  # Megatron's and HDP's own flags
    with pytest.raises(ConfigError, match=r"^--brand-new-trick: a Megatron flag megatron_bytescale has not classified"):
        flag_table.refuse(_namespace(), given + ["--brand-new-trick"])


def test_a_parser_spec_reads_a_command_line_as_its_parser():
    """parser_spec without Megatron: every kind of action of a parser survives spec_of, JSON and
    build_parser, and the rebuilt parser reads a command line to the same values (enum members by
    name; a converter function's value as its text)."""
    import enum
    import json

    from megatron_bytescale.megatron import parser_spec

    class Backend(enum.Enum):
        flash = 1
        local = 2

    def pair(text):
        return tuple(int(x) for x in text.split(","))

    parser = argparse.ArgumentParser(allow_abbrev=False)
    group = parser.add_argument_group(title="network size")
    group.add_argument("--num-layers", type=int, default=None)
    group.add_argument("--lr", type=float, default=1e-4)
    group.add_argument("--data-path", nargs="*", default=None)
    group.add_argument("--coeffs", type=float, nargs="+", default=0.0)
    group.add_argument("--ramp", type=int, nargs=3, default=None)
    group.add_argument("--impl", choices=["local", "te"], default="te")
    group.add_argument("--backend", type=lambda name: Backend[name], choices=list(Backend), default=Backend.local)
    group.add_argument("--window", type=pair, default=None)
    group.add_argument("--bf16", action="store_true")
    group.add_argument("--no-fusion", action="store_false", dest="fusion")
    group.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=False)
    spec = json.loads(json.dumps(parser_spec.spec_of(parser)))
    assert [a["group"] for a in spec["actions"]] == ["network size"] * 11
    rebuilt = parser_spec.build_parser(spec)
    argv = ["--num-layers", "4", "--data-path", "a", "b", "--coeffs", "1e-2", "1e-3", "--ramp", "1", "2", "3"]
    argv += ["--impl", "local", "--backend", "flash", "--window", "64,0", "--bf16", "--no-fusion", "--no-overlap"]
    theirs, ours = vars(parser.parse_args(argv)), vars(rebuilt.parse_args(argv))
    assert ours == {**theirs, "backend": "flash", "window": "64,0"}
    assert vars(rebuilt.parse_args([])) == {**vars(parser.parse_args([])), "backend": "local"}
    with pytest.raises(ConfigError, match="invalid choice"):
        rebuilt.parse_args(["--impl", "cuda"])
