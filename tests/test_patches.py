"""The patch series against Megatron-LM, one per era (patches/core_v0.16/, patches/core_v0.19/).

Always, for each series: every patch parses (unidiff), is a numbered git format-patch of the
expected files only, its hunks are consistent (line counts, order, the header's diffstat), and
every ``hdp.<name>`` it calls exists in megatron_bytescale.megatron.pretrain_hooks.

With MEGATRON_LM_DIR set to a Megatron-LM checkout (skipped otherwise; a skip is not a pass):
the checkout's series applies in order with ``git apply --check`` on a copy of the files it
touches, and the patched pretrain_gpt.py compiles and defines every name the patch uses.
"""

import ast
import builtins
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from unidiff import PatchSet

from megatron_bytescale.megatron import pretrain_hooks
from megatron_bytescale.megatron.patch_series import series
from megatron_bytescale.megatron_era import Era

from megatron_lm import MEGATRON_LM_DIR, needs_tree, patch_series

ROOT = Path(__file__).resolve().parent.parent
SERIES = {era: series(era) for era in Era}
PATCHES = [path for paths in SERIES.values() for path in paths]
# the hooks each era's series wires (the launcher installs the same at runtime)
WIRED = {
    Era.V016: {
        "install_cpu_backend",
        "install_argument_validation",
        "install_forward_backward",
        "extra_args_provider",
        "model_provider",
        "datasets_provider",
        "forward_step",
    },
    Era.V019: {
        "install_cpu_backend",
        "install_argument_validation",
        "install_forward_backward",
        "extra_args_provider",
        "model_config",
        "datasets_provider",
        "forward_step",
    },
}
# patch number -> the Megatron-LM files it may touch (the training loop is hooked at runtime
# by pretrain_hooks.install_*; megatron/core is never patched)
EXPECTED_FILES = {1: {"pretrain_gpt.py"}, 2: {"pretrain_gpt.py"}, 3: {"pretrain_gpt.py"}}


@pytest.mark.parametrize("era", list(Era), ids=lambda e: e.value)
def test_the_series_is_there_and_numbered(era):
    paths = SERIES[era]
    assert [int(p.name[:4]) for p in paths] == sorted(EXPECTED_FILES)
    for i, path in enumerate(paths, start=1):
        head = path.read_text().splitlines()
        assert re.fullmatch(r"From [0-9a-f]{40} Mon Sep 17 00:00:00 2001", head[0]), path.name
        subject = next(line for line in head if line.startswith("Subject: "))
        assert subject.startswith(f"Subject: [PATCH {i}/{len(paths)}] "), subject


@pytest.mark.parametrize("path", PATCHES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_patch_parses_and_touches_only_expected_files(path):
    patch = PatchSet(path.read_text())
    assert len(patch) > 0
    touched = {f.path for f in patch}
    assert touched <= EXPECTED_FILES[int(path.name[:4])], touched
    assert not any(f.path.startswith("megatron/core/") for f in patch)
    assert all(f.is_modified_file for f in patch), "the series only edits existing Megatron files"


@pytest.mark.parametrize("path", PATCHES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_hunks_are_internally_consistent(path):
    text = path.read_text()
    patch = PatchSet(text)
    added = removed = 0
    for f in patch:
        previous_end = 0
        for hunk in f:
            source = [line for line in hunk if line.is_context or line.is_removed]
            target = [line for line in hunk if line.is_context or line.is_added]
            assert len(source) == hunk.source_length and len(target) == hunk.target_length
            assert hunk.source_start > previous_end, "hunks overlap or are out of order"
            previous_end = hunk.source_start + hunk.source_length - 1
            assert any(line.is_added or line.is_removed for line in hunk), "a hunk without changes"
            # context lines are the same on both sides, in order
            assert [line.value for line in hunk.source_lines() if line.is_context] == [
                line.value for line in hunk.target_lines() if line.is_context
            ]
        added += f.added
        removed += f.removed
    stat = re.search(r"(\d+) files? changed(?:, (\d+) insertions?\(\+\))?(?:, (\d+) deletions?\(-\))?", text)
    assert stat, "format-patch header has no diffstat"
    assert (int(stat.group(1)), int(stat.group(2) or 0), int(stat.group(3) or 0)) == (len(patch), added, removed)


def _hook_names(paths) -> set[str]:
    names = set()
    for path in paths:
        for f in PatchSet(path.read_text()):
            for hunk in f:
                for line in hunk:
                    if line.is_added:
                        names |= set(re.findall(r"\bhdp\.([A-Za-z_]\w*)", line.value))
    return names


@pytest.mark.parametrize("era", list(Era), ids=lambda e: e.value)
def test_patches_call_only_hooks_that_exist(era):
    names = _hook_names(SERIES[era])
    for name in names:
        assert callable(getattr(pretrain_hooks, name, None)), f"pretrain_hooks.{name} does not exist"
    # and every hook the launcher installs for that era is wired by the series too
    assert names == WIRED[era]


# ---------------------------------------------------------------- against a checkout
needs_checkout = needs_tree


@pytest.fixture
def patched_tree(tmp_path):
    """A copy of the files the series touches, with the series applied in order."""
    touched = set().union(*EXPECTED_FILES.values())
    for rel in touched:
        dst = tmp_path / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(Path(MEGATRON_LM_DIR) / rel, dst)
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    for path in patch_series():
        for args in (["--check"], []):
            proc = subprocess.run(["git", "apply", *args, str(path)], cwd=tmp_path, capture_output=True, text=True)
            assert proc.returncode == 0, f"{path.name} {' '.join(args)}: {proc.stderr}"
    return tmp_path


@needs_checkout
def test_series_applies_in_order_with_git_apply_check(patched_tree):
    text = (patched_tree / "pretrain_gpt.py").read_text()
    assert "from megatron_bytescale.megatron import pretrain_hooks as hdp" in text
    # and it reverses cleanly (nothing applied twice or fuzzily)
    for path in reversed(patch_series()):
        proc = subprocess.run(
            ["git", "apply", "-R", "--check", str(path)], cwd=patched_tree, capture_output=True, text=True
        )
        assert proc.returncode == 0, proc.stderr
        subprocess.run(["git", "apply", "-R", str(path)], cwd=patched_tree, check=True)
    assert (patched_tree / "pretrain_gpt.py").read_bytes() == (Path(MEGATRON_LM_DIR) / "pretrain_gpt.py").read_bytes()


@needs_checkout
def test_patched_pretrain_gpt_defines_every_name_the_patch_uses(patched_tree):
    tree = ast.parse((patched_tree / "pretrain_gpt.py").read_text())
    defined = set()
    top = list(tree.body)
    for node in tree.body:  # module-level try/except and if blocks (``__main__``) define names too
        if isinstance(node, ast.Try):
            top += node.body + [n for h in node.handlers for n in h.body] + node.orelse + node.finalbody
        elif isinstance(node, ast.If):
            top += node.body + node.orelse
            top += [n for child in node.body if isinstance(child, ast.If) for n in child.body + child.orelse]
    for node in top:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            defined |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.Assign):
            defined |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    calls = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and isinstance(n.func.value, ast.Name)
        and n.func.value.id == "hdp"
    ]
    assert {c.func.attr for c in calls} == _hook_names(patch_series())
    for call in calls:
        for arg in ast.walk(call):
            if isinstance(arg, ast.Name) and arg.id not in ("hdp",):
                assert arg.id in defined or hasattr(builtins, arg.id), f"{arg.id} is not defined in pretrain_gpt.py"


@needs_checkout
def test_bytescale_patches_applies_the_checkouts_series_once(tmp_path, capsys):
    import argparse

    from megatron_bytescale.commands import patches as command

    tree = tmp_path / "Megatron-LM"
    (tree / "megatron" / "core").mkdir(parents=True)
    for rel in ("pretrain_gpt.py", "megatron/core/package_info.py"):
        shutil.copy(Path(MEGATRON_LM_DIR) / rel, tree / rel)
    assert command.main(argparse.Namespace(megatron_lm=str(tree), apply=True)) == 0
    out = capsys.readouterr().out
    assert f"-> {patch_series()[0].parent}" in out and "applied 3 patches" in out
    assert "pretrain_hooks as hdp" in (tree / "pretrain_gpt.py").read_text()
    assert command.main(argparse.Namespace(megatron_lm=str(tree), apply=True)) == 0
    assert "already patched; nothing applied" in capsys.readouterr().out


def test_bytescale_patches_refuses_what_is_not_a_supported_checkout(tmp_path):
    import argparse

    from megatron_bytescale.commands import patches as command
    from megatron_bytescale.errors import ConfigError

    with pytest.raises(ConfigError, match="not a Megatron-LM checkout"):
        command.main(argparse.Namespace(megatron_lm=str(tmp_path), apply=False))
    (tmp_path / "megatron" / "core").mkdir(parents=True)
    (tmp_path / "pretrain_gpt.py").write_text("")
    (tmp_path / "megatron/core/package_info.py").write_text("MAJOR = 0\nMINOR = 18\nPATCH = 2\n")
    with pytest.raises(ConfigError, match="megatron-core 0.18.2 is not supported"):
        command.main(argparse.Namespace(megatron_lm=str(tmp_path), apply=True))
