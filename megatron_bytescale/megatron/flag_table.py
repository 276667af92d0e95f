"""What ``--hybrid-data-parallel`` does with every flag of Megatron-LM's parser.

``megatron_flags.tsv`` (beside this module) has one row per option string of Megatron's
``add_megatron_arguments`` in the trees it names (core_v0.16.1, core_v0.19.0 and the newer
dev tree), each *honoured*, *refused* (a rule says when, and the row holds the one-line
message naming the fix) or *no-effect* under HDP (with why); the file's header says the
format. ``tests/test_flag_table.py`` reads each tree's real parser and fails on any flag the
table does not classify, so a new Megatron release cannot be accepted silently.

``refuse(args, given)`` applies the rules to the values as parsed, before Megatron's
``validate_args`` fills its own defaults in (it sets ``--split`` when a ``--data-path`` is
given, for one): the launcher runs it on the command line before any rank starts
(``preflight``), and every rank again right before Megatron's validation
(``pretrain_hooks.validate_args_then_hdp``). A Megatron flag given on the command line that the
table does not know (a newer Megatron, an extra argument provider) is refused too. Rules of the
form ``check:NAME`` are decided, with their own messages, by ``arguments.CHECKS[NAME]`` (they
combine several flags, and ``validate_hdp_args`` runs them after Megatron's validation).
"""

from __future__ import annotations

import ast
import functools
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError

TABLE = Path(__file__).resolve().parent / "megatron_flags.tsv"
VERDICTS = ("honoured", "refused", "no-effect")
TREES = {"16": "core_v0.16.1", "19": "core_v0.19.0", "dev": "dev_d48bd6b"}
_RULE = re.compile(r"^(not in|in|has|==|!=) (.+)$")


@dataclass(frozen=True)
class Row:
    flag: str
    trees: tuple[str, ...]
    dest: str  # Megatron's attribute; 'a|b' where trees name it differently
    verdict: str
    rule: str  # '-', 'check:NAME' or '<operator> <literal>'
    text: str

    @property
    def dests(self) -> tuple[str, ...]:
        return tuple(self.dest.split("|"))

    @property
    def check(self) -> str | None:
        return self.rule[len("check:") :] if self.rule.startswith("check:") else None

    @property
    def condition(self) -> tuple[str, object] | None:
        """(operator, literal) of a value rule, else None."""
        m = _RULE.match(self.rule)
        return (m.group(1), ast.literal_eval(m.group(2))) if m else None


@functools.cache
def rows() -> dict[str, Row]:
    """The table, by option string."""
    table = {}
    for n, line in enumerate(TABLE.read_text().splitlines(), 1):
        if not line or line.startswith("#"):
            continue
        fields = line.split("\t")
        if len(fields) != 6:
            raise ValueError(f"{TABLE.name}:{n}: expected 6 tab-separated fields, got {len(fields)}")
        flag, trees, dest, verdict, rule, text = fields
        table[flag] = Row(flag, tuple(trees.split(",")), dest, verdict, rule, text)
    return table


def problems() -> list[str]:
    """What is wrong with the table itself (the tests require none)."""
    from .arguments import CHECKS

    found, table = [], rows()
    for row in table.values():
        where = f"{row.flag}:"
        if row.verdict not in VERDICTS:
            found.append(f"{where} verdict {row.verdict!r} is not one of {VERDICTS} (review the row)")
        if not row.text.strip():
            found.append(f"{where} no text")
        if set(row.trees) - set(TREES):
            found.append(f"{where} unknown trees {row.trees}")
        if row.rule != "-" and row.check is None:
            try:
                operator, _ = row.condition or (None, None)
            except (ValueError, SyntaxError):
                operator = None
            if operator is None:
                found.append(f"{where} rule {row.rule!r} is not '-', 'check:NAME' or '<operator> <literal>'")
        if row.check is not None and row.check not in CHECKS:
            found.append(f"{where} check {row.check!r} is not in arguments.CHECKS")
        if row.verdict == "refused" and row.rule == "-":
            found.append(f"{where} refused without a rule")
        if row.verdict != "refused" and row.condition is not None:
            found.append(f"{where} a value rule on a row that is not refused")
        if row.text.startswith("="):
            other = table.get(row.text[1:])
            if other is None or other.verdict != "refused" or other.text.startswith("="):
                found.append(f"{where} shares the message of {row.text[1:]}, which is not a refused row with its own")
    used = {row.check for row in table.values() if row.check}
    found += [f"arguments.CHECKS[{name!r}] is referenced by no row" for name in sorted(set(CHECKS) - used)]
    return found


def message(row: Row, value) -> str:
    text = rows()[row.text[1:]].text if row.text.startswith("=") else row.text
    shown = " ".join(map(str, value)) if isinstance(value, (list, tuple)) else value
    return text.replace("{value}", str(shown))


def _refuses(operator: str, literal, value) -> bool:
    if operator == "==":
        return value == literal
    if operator == "!=":
        return value != literal
    if operator == "in":
        return value in literal
    if operator == "not in":
        return value not in literal
    items = value if isinstance(value, (list, tuple)) else [value]  # has
    return any(item in literal for item in items)


_MISSING = object()


def refuse(args, given=None, known=None) -> None:
    """ConfigError (one line naming the fix) for the first refused Megatron flag of ``args``,
    or for a flag in ``given`` (option strings on the command line) the table does not
    classify. ``known``: the option strings of the parser that read ``args``; a rule applies
    only to a flag of that parser (trees may give one attribute name different meanings: the
    dev tree's opt-in --use-layer-wise-param-layout is core_v0.19's default-on layout of
    another optimizer). ``check:`` rules are ``validate_hdp_args``'s."""
    table = rows()
    if given:
        from .arguments import hdp_option_strings

        unknown = sorted(set(given) - set(table) - hdp_option_strings())
        if unknown:
            raise ConfigError(
                f"{', '.join(unknown)}: a Megatron flag megatron_bytescale has not classified under "
                "--hybrid-data-parallel (a newer Megatron-LM, or an extra argument provider); drop it, or add its "
                "row to megatron/megatron_flags.tsv with the test that shows HDP honours it"
            )
    for row in table.values():
        condition = row.condition
        if condition is None or (known is not None and row.flag not in known):
            continue
        for dest in row.dests:
            value = getattr(args, dest, _MISSING)
            if value is not _MISSING and _refuses(*condition, value):
                raise ConfigError(message(row, value))


def given_flags(argv) -> list[str]:
    """The option strings of a command line (``--flag`` and ``--flag=value``)."""
    return [word.split("=", 1)[0] for word in argv if word.startswith("--") and len(word) > 2]


def counts() -> dict[str, Counter]:
    """Verdicts per tree."""
    out = {tree: Counter() for tree in TREES.values()}
    for row in rows().values():
        for tree in row.trees:
            out[TREES[tree]][row.verdict] += 1
    return out


COUNTS_BEGIN = "<!-- flag-table counts: generated from megatron/megatron_flags.tsv (flag_table.counts_markdown) -->"
COUNTS_END = "<!-- end of flag-table counts -->"


def counts_markdown() -> str:
    """The per-tree counts as docs/cluster.md shows them (a test checks the docs match)."""
    lines = [
        COUNTS_BEGIN,
        "| tree | flags | honoured | refused | no effect under HDP |",
        "|---|---|---|---|---|",
    ]
    for tree, c in counts().items():
        lines.append(f"| {tree} | {sum(c.values())} | {c['honoured']} | {c['refused']} | {c['no-effect']} |")
    lines.append(COUNTS_END)
    return "\n".join(lines)


def draft(spec_actions, tree: str) -> list[str]:
    """TSV rows (verdict '?', which ``problems`` refuses until each is reviewed) for the option
    strings of a parser spec's actions that the table lacks: what `python -m
    megatron_bytescale.megatron.flag_table --draft TREE_KEY SPEC.json` prints. (A flag the table
    has but not for ``tree`` needs the tree added to its row by hand, after checking it means the
    same there.)"""
    table = rows()
    out = []
    for action in spec_actions:
        for option in action["options"]:
            if option.startswith("--") and option not in table:
                out.append("\t".join([option, tree, action["dest"], "?", "-", f"(group: {action.get('group')})"]))
    return out


def main(argv=None) -> int:
    import json
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 3 or argv[0] != "--draft" or argv[1] not in TREES:
        print(
            "usage: python -m megatron_bytescale.megatron.flag_table --draft {16,19,dev} SPEC.json  "
            "(SPEC.json: `python -m megatron_bytescale.megatron.parser_spec --print TREE`)",
            file=sys.stderr,
        )
        return 2
    spec = json.loads(Path(argv[2]).read_text())
    print("\n".join(draft(spec["actions"], argv[1])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
