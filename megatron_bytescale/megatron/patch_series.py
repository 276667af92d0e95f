"""``bytescale patches MEGATRON_LM_DIR [--apply]``: the patch series for a Megatron-LM checkout.

Each supported era of Megatron-LM has its own series of patches to ``pretrain_gpt.py``
(``patches/core_v0.16/``, ``patches/core_v0.19/``: pretrain_gpt.py was rewritten between them).
This reads the checkout's megatron-core version, prints which series fits it and, with
``--apply``, applies the series to a copy first and then to the checkout (nothing is applied if any
patch would not apply cleanly). A checkout already patched is left as it is.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import ConfigError
from ..megatron_era import Era, _read_version, era_of

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
