"""Stand-ins for megatron-core's triton kernel modules where triton is not installed.

megatron-core imports a few modules of GPU kernels unconditionally on the training path, and
each of them starts with ``import triton``: from 0.17 on, ``megatron.core`` itself cannot be
imported without triton (``pipeline_parallel/schedules.py`` -> ``transformer/moe/paged_stash.py``
-> ``transformer/moe/ops/paged_stash.py``), and ``megatron/training/initialize.py`` imports
``batch_invariant_kernels`` in every release we support. triton comes with every CUDA build of
torch, so a GPU machine never meets this; the CPU build of torch has no triton (and its kernels
could not run there anyway).

Where ``import triton`` would fail, each module below is replaced by a stand-in that defines the
names megatron-core imports from it; a stand-in kernel raises a one-line ConfigError if it is
ever called (only the GPU features that need it call it: MoE paged stashing, batch-invariant
mode). This is part of the CPU backend (``megatron/cpu_compat.py`` holds the rest); it lives
here, in a module of the base layer that imports nothing but the standard library, because it
must be in place before anything imports ``megatron.core``, and ``megatron_bytescale``'s own
``__init__`` installs it.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

from .errors import ConfigError


def _refuse(feature: str):
    def kernel(*unused, **unused_kw):
        raise ConfigError(f"{feature} needs triton kernels on a GPU; triton is not installed: drop it on CPU")

    return kernel


def _paged_stash_ops(module: types.ModuleType) -> None:
    """``megatron.core.transformer.moe.ops.paged_stash`` (0.17+): the MoE paged-stash copy and
    pop kernels, and the block size ``transformer/moe/paged_stash.py`` imports beside them
    (the kernels' tile width; the stand-in keeps the value so that module's arithmetic holds)."""
    module.GLOBAL_BLOCK_SIZE = 1024
    module.paged_stash_copy_kernel = _refuse("MoE paged stashing (--moe-paged-stash)")
    module.paged_stash_pop_kernel = _refuse("MoE paged stashing (--moe-paged-stash)")


def _batch_invariant_kernels(module: types.ModuleType) -> None:
    """``megatron.core.transformer.custom_layers.batch_invariant_kernels``: batch-invariant mode
    reads as off and refuses to turn on."""
    enable = _refuse("--batch-invariant-mode")

    @contextlib.contextmanager
    def set_batch_invariant_mode(enabled: bool = True):
        if enabled:
            enable()
        yield

    module.enable_batch_invariant_mode = enable
    module.set_batch_invariant_mode = set_batch_invariant_mode
    module.disable_batch_invariant_mode = lambda *unused, **unused_kw: None
    module.is_batch_invariant_mode_enabled = lambda: False


STAND_INS = {
    "megatron.core.transformer.moe.ops.paged_stash": _paged_stash_ops,
    "megatron.core.transformer.custom_layers.batch_invariant_kernels": _batch_invariant_kernels,
}


class _StandInLoader(importlib.abc.Loader):
    def create_module(self, spec):
        return None  # the default module object

    def exec_module(self, module) -> None:
        module.__doc__ = "stand-in (megatron_bytescale.triton_stand_ins): triton is not installed"
        STAND_INS[module.__name__](module)


class _StandInFinder(importlib.abc.MetaPathFinder):
    """Answers for the modules of ``STAND_INS`` only, and only while triton cannot be found."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in STAND_INS or triton_installed():
            return None
        return importlib.machinery.ModuleSpec(fullname, _StandInLoader())


_triton: bool | None = None


def triton_installed() -> bool:
    global _triton
    if _triton is None:
        _triton = importlib.util.find_spec("triton") is not None
    return _triton


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (idempotent; cheap: no import happens here)."""
    if not any(isinstance(finder, _StandInFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _StandInFinder())
