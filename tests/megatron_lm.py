"""The Megatron-LM checkout the Megatron-LM tests run against: ``MEGATRON_LM_DIR`` (CI runs the
suite's Megatron-LM tests once per tree under ../shared/megatron-lm: core_v0.16.1 and core_v0.19.0),
its API era and its patch series. Without the variable those tests skip, saying so."""

import os
from pathlib import Path

import pytest

from megatron_bytescale.megatron.patch_series import series, tree_era

ROOT = Path(__file__).resolve().parent.parent
MEGATRON_LM_DIR = os.environ.get("MEGATRON_LM_DIR")
HAVE_TREE = bool(MEGATRON_LM_DIR) and (Path(MEGATRON_LM_DIR) / "pretrain_gpt.py").is_file()
needs_tree = pytest.mark.skipif(
    not HAVE_TREE, reason="set MEGATRON_LM_DIR to a Megatron-LM checkout (core_v0.16.1 or core_v0.19.x)"
)


def era():
    """The checkout's era (megatron_bytescale.megatron_era.Era)."""
    return tree_era(MEGATRON_LM_DIR)


def patch_series() -> list[Path]:
    """The checkout's patch series, in order."""
    return series(era())


def prepare_text_dataset(prefix: Path, files, timeout: float = 300) -> str:
    """A Megatron indexed dataset at ``prefix`` from text files, by `bytescale prepare-data`."""
    import subprocess
    import sys

    command = [sys.executable, "-m", "megatron_bytescale.cli", "prepare-data", "--output", str(prefix), "--quiet"]
    subprocess.run([*command, "--text-files", *map(str, files)], check=True, capture_output=True, timeout=timeout)
    return str(prefix)


def patched_copy(tree: Path) -> Path:
    """A copy of the checkout at ``tree`` with its patch series applied (the checkout stays read-only)."""
    import shutil
    import subprocess

    shutil.copytree(MEGATRON_LM_DIR, tree, ignore=shutil.ignore_patterns("__pycache__", ".git"))
    for patch in patch_series():
        subprocess.run(["git", "apply", str(patch)], cwd=tree, check=True, capture_output=True)
    return tree
