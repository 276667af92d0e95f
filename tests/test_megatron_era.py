"""Which megatron-core API is imported (megatron_era.py), the refusal of unsupported versions at
start, and the triton stand-ins that let megatron-core import where triton is missing."""

import importlib
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_bytescale import megatron_era, triton_stand_ins
from megatron_bytescale.errors import ConfigError
from megatron_bytescale.megatron_era import Era, era_of, parse_version

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "version, expected",
    [
        ("0.16.1", Era.V016),
        ("0.16.4", Era.V016),
        ("0.19.0", Era.V019),
        ("0.19.2", Era.V019),
        ("0.19.1+5be9626", Era.V019),
    ],
)
def test_supported_versions_map_to_their_era(version, expected):
    assert era_of(parse_version(version)) is expected


@pytest.mark.parametrize("version", ["0.15.3", "0.16.0", "0.17.1", "0.18.2", "0.20.0", "1.0.0"])
def test_other_versions_are_refused_naming_the_supported_range(version):
    with pytest.raises(ConfigError) as info:
        era_of(parse_version(version))
    message = str(info.value)
    assert f"megatron-core {version} is not supported" in message and "0.16" in message and "0.19" in message
    assert "\n" not in message


def test_the_installed_megatron_core_is_read_without_importing_it():
    import megatron.core.package_info as info  # what `import megatron.core` loads here

    assert megatron_era.megatron_core_version() == (info.MAJOR, info.MINOR, info.PATCH)
    assert megatron_era.era() in Era


def _fake_megatron(root: Path, minor: int) -> Path:
    """A megatron-core of another minor version, first on PYTHONPATH (only its version file)."""
    core = root / "megatron" / "core"
    core.mkdir(parents=True)
    (core / "__init__.py").write_text(
        "raise ImportError('the version check must come before importing megatron.core')\n"
    )
    (core / "package_info.py").write_text(f"MAJOR = 0\nMINOR = {minor}\nPATCH = 1\nPRE_RELEASE = ''\n")
    (root / "pretrain_gpt.py").write_text("raise SystemExit('pretrain_gpt.py must not run')\n")
    return root


def test_an_unsupported_megatron_core_stops_the_launcher_at_start_with_one_line(tmp_path):
    tree = _fake_megatron(tmp_path, 17)
    env = {"PYTHONPATH": f"{tree}:{ROOT}", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_bytescale.launch", str(tree / "pretrain_gpt.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "megatron-core 0.17.1 is not supported" in lines[0] and "Traceback" not in proc.stderr


def test_stand_ins_answer_only_without_triton(monkeypatch):
    finder = triton_stand_ins._StandInFinder()
    name = "megatron.core.transformer.moe.ops.paged_stash"
    monkeypatch.setattr(triton_stand_ins, "_triton", True)
    assert finder.find_spec(name) is None
    monkeypatch.setattr(triton_stand_ins, "_triton", False)
    assert finder.find_spec(name) is not None
    assert finder.find_spec("megatron.core.transformer.moe.moe_layer") is None


@pytest.mark.parametrize(
    "name, calls, message",
    [
        (
            "megatron.core.transformer.custom_layers.batch_invariant_kernels",
            ("enable_batch_invariant_mode",),
            "--batch-invariant-mode needs triton",
        ),
        (
            "megatron.core.transformer.moe.ops.paged_stash",
            ("paged_stash_copy_kernel", "paged_stash_pop_kernel"),
            "MoE paged stashing",
        ),
    ],
)
def test_a_stand_in_kernel_refuses_in_one_line(monkeypatch, name, calls, message):
    monkeypatch.setattr(triton_stand_ins, "_triton", False)
    spec = triton_stand_ins._StandInFinder().find_spec(name)
    module = importlib.util.module_from_spec(spec)  # not put in sys.modules: the real one may be there
    spec.loader.exec_module(module)
    for call in calls:
        with pytest.raises(ConfigError, match=message):
            getattr(module, call)()
    if hasattr(module, "is_batch_invariant_mode_enabled"):
        assert module.is_batch_invariant_mode_enabled() is False
        with module.set_batch_invariant_mode(False):
            pass
