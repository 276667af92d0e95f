"""The README's first contact says what the project does: its install line brings the torch CI
tests with, as a CPU build on every supported Python; the commands it shows bare run bare; its
headline is a handful of results, each with its command; what its commands write stays out of
git. Pure text checks (no install, no network)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from megatron_bytescale.cli import SUBCOMMANDS

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def section(title: str) -> str:
    start = README.index(f"\n## {title}")
    end = README.find("\n## ", start + 1)
    return README[start : end if end > 0 else None]


def test_the_cpu_install_line_is_the_torch_ci_tests_with_from_pytorchs_cpu_index():
    (ci_torch,) = set(re.findall(r"pip install -q (torch==\S+)", (ROOT / ".ci/run").read_text()))
    lines = [line for line in README.splitlines() if line.startswith("pip install torch")]
    cpu = [line for line in lines if CPU_INDEX in line]
    assert cpu and all(
        line.split("#")[0].split() == ["pip", "install", ci_torch, "--index-url", CPU_INDEX] for line in cpu
    )
    # the first screen installs torch before the package, so pip never swaps it for another build
    first = section("See it work")
    assert first.index(CPU_INDEX) < first.index("pip install -e")


def test_the_readme_installs_extras_and_pythons_the_package_declares():
    pyproject = (ROOT / "pyproject.toml").read_text()  # read as text: tomllib is Python 3.11+
    extras_table = pyproject.split("[project.optional-dependencies]")[1].split("\n[")[0]
    declared = set(re.findall(r"^([a-z]+) = \[", extras_table, re.M))
    for extras in re.findall(r"pip install -e '\.\[([a-z,]+)\]'", README):
        assert set(extras.split(",")) <= declared, extras
    floor = re.search(r'requires-python = ">=\s*(3\.\d+)"', pyproject)[1]
    assert f"| >= {floor} |" in section("Install")  # the oldest supported Python row


@pytest.mark.parametrize("command", ["demo", "verify", "simulate"])
def test_the_commands_the_readme_shows_bare_run_bare(command):
    assert re.search(rf"`bytescale {command}`", README) or f"bytescale {command}\n" in README
    module = __import__(SUBCOMMANDS[command][0], fromlist=["add_arguments"])
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    parser.parse_args([])  # no required flag: the defaults are the README's figures


def test_every_bytescale_command_in_the_readme_exists():
    named = set(re.findall(r"bytescale ([a-z][a-z-]+)", README))
    assert named and named <= set(SUBCOMMANDS), named - set(SUBCOMMANDS)


def test_the_headline_is_at_most_six_results_each_with_its_command():
    bullets = re.findall(r"^\* (.*?)(?=^\* |\Z)", section("Headline results"), re.M | re.S)
    assert 1 <= len(bullets) <= 6
    for bullet in bullets:
        assert re.search(r"`(bytescale [a-z]+|python benchmarks/\S+)[^`]*`", bullet), bullet


def test_the_readme_is_short_and_shows_how_to_run_it_on_its_first_screen():
    assert len(README.splitlines()) < 200
    first = "\n".join(README.splitlines()[:40])
    assert "bytescale demo" in first and "pip install" in first


def test_what_the_readmes_commands_write_is_ignored_by_git():
    ignored = (ROOT / ".gitignore").read_text().split()
    for out in re.findall(r"--output (\w+)/", README):
        assert f"/{out}/" in ignored, out
    assert "/runs/" in ignored  # the demo's folder
