"""``bytescale patches MEGATRON_LM_DIR [--apply]``: the patch series for a Megatron-LM checkout.

Each supported era of Megatron-LM has its own series of patches to ``pretrain_gpt.py``
(``patches/core_v0.16/``, ``patches/core_v0.19/``: pretrain_gpt.py was rewritten between them).
This reads the checkout's megatron-core version, prints which series fits it and, with
``--apply``, applies the series to a copy first and then to the checkout (nothing is applied if any
patch would not apply cleanly). A checkout already patched is left as it is.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
from pathlib import Path

from ..errors import ConfigError
from ..megatron_era import Era, _read_version, era_of
from .launch import PATCH_MARKER

PATCHES = Path(__file__).resolve().parents[2] / "patches"


def tree_era(tree: str | Path) -> Era:
    info = Path(tree) / "megatron" / "core" / "package_info.py"
    if not (Path(tree) / "pretrain_gpt.py").is_file() or not info.is_file():
        raise ConfigError(
            f"{tree}: not a Megatron-LM checkout (pretrain_gpt.py and megatron/core/package_info.py expected)"
        )
    return era_of(_read_version(info))


def series(era: Era, root: Path = PATCHES) -> list[Path]:
    paths = sorted((root / era.patch_dir).glob("*.patch"))
    if not paths:
        raise ConfigError(f"no patch series for {era.value} under {root}: use a source checkout of megatron_bytescale")
    return paths


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "megatron_lm", metavar="MEGATRON_LM_DIR", help="a Megatron-LM checkout (core_v0.16.1 or core_v0.19.x)"
    )
    parser.add_argument(
        "--apply", action="store_true", help="apply the series with git apply (after checking all of it)"
    )


def main(args: argparse.Namespace) -> int:
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
