"""Loading the scripts under scripts/gpu/ as modules, to run their CPU smoke modes."""

import importlib.util
from pathlib import Path

GPU_SCRIPTS = Path(__file__).resolve().parents[1] / "scripts" / "gpu"


def load_gpu_script(name: str):
    """The module of ``scripts/gpu/<name>.py``, freshly executed."""
    spec = importlib.util.spec_from_file_location(name, GPU_SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
