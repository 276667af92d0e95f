"""``bytescale patches MEGATRON_LM_DIR [--apply]``: the patch series for a Megatron-LM checkout
(``megatron/patch_series.py`` finds it; this prints it and applies it)."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
from pathlib import Path

from ..errors import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "megatron_lm", metavar="MEGATRON_LM_DIR", help="a Megatron-LM checkout (core_v0.16.1 or core_v0.19.x)"
    )
    parser.add_argument(
        "--apply", action="store_true", help="apply the series with git apply (after checking all of it)"
    )


def main(args: argparse.Namespace) -> int:
    from ..megatron.launch import PATCH_MARKER
    from ..megatron.patch_series import series, tree_era

    tree = Path(args.megatron_lm)
    era = tree_era(tree)
    paths = series(era)
    print(f"{tree}: megatron-core {era.value} -> {paths[0].parent}")
    for path in paths:
        print(f"  {path.name}")
    if not args.apply:
        return 0
    if PATCH_MARKER in (tree / "pretrain_gpt.py").read_text():
        print(f"{tree / 'pretrain_gpt.py'} is already patched; nothing applied")
        return 0
    # the series edits one file in turn: apply it to a copy first, so a patch that does not
    # apply leaves the checkout untouched
    with tempfile.TemporaryDirectory() as scratch:
        shutil.copy(tree / "pretrain_gpt.py", scratch)
        for where in (Path(scratch), tree):
            for path in paths:
                proc = subprocess.run(["git", "apply", str(path)], cwd=where, capture_output=True, text=True)
                if proc.returncode:
                    raise ConfigError(
                        f"{path.name} does not apply to {tree / 'pretrain_gpt.py'}: "
                        f"{proc.stderr.strip().splitlines()[-1]}"
                    )
    print(f"applied {len(paths)} patches to {tree / 'pretrain_gpt.py'}")
    return 0
