"""Which megatron-core API this process runs against: the one place that knows.

Megatron-LM changed the APIs the plugin touches between the releases we support:

=====================  =====================================  ==================================
                       core_v0.16 (``Era.V016``)              core_v0.19 (``Era.V019``)
=====================  =====================================  ==================================
arguments              parsed inside ``pretrain()``            parsed by pretrain_gpt.py itself
                       (``initialize.validate_args``,          (``arguments.parse_and_validate_args``,
                       ``extra_args_provider=`` of pretrain)   then ``pretrain(config container, ...)``)
model                  ``model_provider`` -> ``gpt_builder``   ``GPTModelConfig`` + ``GPTModelBuilder``
                       (layer spec from ``args.spec``)         (layer spec a field of the config)
``backward_step``      ``(input, output, grad, model_type,     ``(input, output, grad, config)``
                       config)``
training utilities     ``megatron/training/utils.py``          ``megatron/training/utils/`` (a package)
=====================  =====================================  ==================================

core_v0.17 and core_v0.18 sit between the two (0.17 has 0.16's pretrain and 0.19's
``backward_step``; 0.18 rewrote pretrain_gpt.py) and are refused with the supported range.

The version is read from the ``megatron/core/package_info.py`` that ``import megatron.core``
would load (a Megatron-LM checkout on PYTHONPATH wins over the installed wheel), without
importing megatron-core: the era must be known before megatron-core is imported (the CPU
backend and the patches depend on it). Standard library only (base layer).
"""

from __future__ import annotations

import ast
import enum
import functools
import importlib.util
import sys
from pathlib import Path

from .errors import ConfigError

SUPPORTED = "megatron-core 0.16.x (core_v0.16.1) or 0.19.x (core_v0.19.0 and later 0.19 releases)"


class Era(enum.Enum):
    V016 = "core_v0.16"
    V019 = "core_v0.19"

    @property
    def patch_dir(self) -> str:
        """The patch series for pretrain_gpt.py of this era (``patches/<dir>/``)."""
        return self.value


def parse_version(text: str) -> tuple[int, int, int]:
    try:
        parts = tuple(int(p) for p in text.split("+")[0].split(".")[:3])
    except ValueError:
        raise ConfigError(f"megatron-core version {text!r} is not MAJOR.MINOR.PATCH") from None
    if len(parts) != 3:
        raise ConfigError(f"megatron-core version {text!r} is not MAJOR.MINOR.PATCH")
    return parts  # type: ignore[return-value]


def era_of(version: tuple[int, int, int]) -> Era:
    """The API era of a megatron-core version; a one-line ConfigError outside the supported range."""
    major, minor, _ = version
    if (major, minor) == (0, 16) and version >= (0, 16, 1):
        return Era.V016
    if (major, minor) == (0, 19):
        return Era.V019
    shown = ".".join(map(str, version))
    raise ConfigError(
        f"megatron-core {shown} is not supported: use {SUPPORTED} "
        "(pip install 'megatron-core>=0.16.1,<0.20' and the matching Megatron-LM tag)"
    )


def _package_info_path() -> Path | None:
    module = sys.modules.get("megatron.core.package_info")
    if module is not None and getattr(module, "__file__", None):
        return Path(module.__file__)
    try:
        spec = importlib.util.find_spec("megatron.core")  # imports the namespace package `megatron` only
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "package_info.py"
    return path if path.is_file() else None


def _read_version(path: Path) -> tuple[int, int, int]:
    """MAJOR, MINOR, PATCH as assigned in package_info.py (parsed, not run: it calls git)."""
    values = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in ("MAJOR", "MINOR", "PATCH") and isinstance(node.value, ast.Constant):
                values[node.targets[0].id] = node.value.value
    try:
        return int(values["MAJOR"]), int(values["MINOR"]), int(values["PATCH"])
    except (KeyError, TypeError, ValueError):
        raise ConfigError(f"{path}: no MAJOR/MINOR/PATCH version found; is this megatron-core?") from None


@functools.lru_cache(maxsize=1)
def megatron_core_version() -> tuple[int, int, int]:
    """The version of the megatron-core that ``import megatron.core`` loads here."""
    path = _package_info_path()
    if path is None:
        raise ConfigError(f"megatron-core is not installed: pip install 'megatron-core>=0.16.1,<0.20' ({SUPPORTED})")
    return _read_version(path)


def era() -> Era:
    """The era of the megatron-core this process imports (checked once; ConfigError if unsupported)."""
    return era_of(megatron_core_version())


def is_v019() -> bool:
    return era() is Era.V019


def backward_step_takes_model_type() -> bool:
    """megatron-core's ``schedules.backward_step`` took ``model_type`` before 0.17."""
    return era() is Era.V016
