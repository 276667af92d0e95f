"""Every runtime workaround that lets megatron-core 0.16.1 run on CPU with gloo, in one place.

megatron-core assumes a CUDA device in a few spots on the paths we use: GPTModel with the local
layer spec (dense at any TP size, MoE at TP 1), Megatron DDP (with or without the
distributed-optimizer buffer layout), ``model_parallel_cuda_manual_seed``. We never edit
megatron-core: ``install()`` patches those spots at runtime, once, and only when CUDA is
absent, so a GPU run executes megatron-core untouched. Each patch says what megatron-core does
and why we override it.

What running GPTModel forward+backward (+ DDP grad sync) on CPU needed:

* ``RotaryEmbedding.get_emb`` moves ``inv_freq`` to ``torch.cuda.current_device()``;
* Megatron DDP allocates its param/grad buffers on ``torch.cuda.current_device()``;
* sequence parallelism's all-gather / reduce-scatter allocate their outputs on
  ``torch.cuda.current_device()`` (megatron-core's torch norm refuses sequence parallelism:
  ``layer_spec.SequenceParallelTorchNorm`` takes its place, not a patch);
* the MoE router moves its gating weight to ``torch.cuda.current_device()`` every forward;
* ``model_parallel_cuda_manual_seed`` stores CUDA generator states in the RNG tracker;
* activation recompute (``tensor_parallel.checkpoint``) saves and restores the CUDA generator
  state around the recomputed forward (the CPU state and the tracker's streams it keeps too);
* the MoE router names ``te_general_gemm`` that megatron-core only defines when Transformer
  Engine is installed (a NameError on GPUs without TE too: that one fix applies everywhere);
* the local ``DotProductAttention`` builds its mask on CUDA: not patched, HDP replaces core
  attention altogether (``core_attention.HDPCoreAttention``);
* weights: build with ``use_cpu_initialization=True`` (``model.build_gpt_model`` does), else
  every TP layer allocates its weight on CUDA. That path is also what gives the same full
  weights for any TP size, so it is a choice, not a patch.

Not covered (they stay CUDA-only): Megatron's optimizers (``MixedPrecisionOptimizer``,
``DistributedOptimizer``, ``clip_grads``: CUDA tensors and ``torch.cuda.*Tensor`` type checks
throughout), CUDA graphs, Transformer Engine, fused kernels.
"""

from __future__ import annotations

import contextlib
import importlib
import threading

import torch
from megatron.core.tensor_parallel import random as megatron_random

_lock = threading.Lock()
_installed = False


def cuda_in_use() -> bool:
    return torch.cuda.is_available()


class _CudaOnCpu:
    """``torch.cuda`` as the patched megatron-core modules see it: the current device is the CPU."""

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device() -> torch.device:
        return torch.device("cpu")


class _TorchOnCpu:
    """``torch`` as the patched megatron-core modules see it: all real except ``torch.cuda``."""

    cuda = _CudaOnCpu()

    def __getattr__(self, name):
        return getattr(torch, name)


# megatron-core modules whose tensors are allocated on ``torch.cuda.current_device()``; inside
# these modules only, that call answers "cpu" (their module-level ``torch`` is a thin proxy).
ALLOCATE_ON_CPU = (
    # RotaryEmbedding.get_emb moves inv_freq to the current CUDA device on first use.
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    # Megatron DDP allocates its contiguous param/grad buffers on the current CUDA device.
    "megatron.core.distributed.param_and_grad_buffer",
    # the MoE router moves its gating weight to the current CUDA device in every forward.
    "megatron.core.transformer.moe.router",
    # sequence parallelism: the all-gather / reduce-scatter outputs (and the global memory
    # buffer they may come from) are allocated on the current CUDA device.
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.utils",
)


class CpuRNGStatesTracker(megatron_random.CudaRNGStatesTracker):
    """megatron-core's RNG tracker with its named streams kept as CPU generator states.

    megatron-core keeps named CUDA generator states (data-parallel, tensor-parallel, expert) and
    forks into them around dropout in tensor-parallel regions; on CPU the same streams live on
    the CPU default generator, swapped in and out the same way, so a fork draws from its own
    stream and leaves the default one where it was.
    """

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise RuntimeError(f"RNG seed {seed} is already tracked")
        if name in self.states_:
            raise RuntimeError(f"RNG state {name!r} is already tracked")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = megatron_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
        if name not in self.states_:
            raise RuntimeError(
                f"RNG state {name!r} is not tracked: call megatron.core.tensor_parallel."
                "model_parallel_cuda_manual_seed(seed) after init_parallel()"
            )
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


def _initialize_cpu_rng_tracker(*unused, force_reset: bool = False, **unused_kw) -> None:
    """Replacement for megatron-core's ``initialize_rng_tracker`` on CPU (same signature)."""
    if force_reset or not megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED:
        megatron_random._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
        megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def _no_cuda_rng_state(*unused, **unused_kw) -> torch.Tensor:
    """Replacement for megatron-core's ``_get_cuda_rng_state`` on CPU: there is no CUDA
    generator; the CPU generator and the tracker's streams are saved beside it anyway."""
    return torch.empty(0, dtype=torch.uint8)


def _set_no_cuda_rng_state(*unused, **unused_kw) -> None:
    """Replacement for megatron-core's ``_set_cuda_rng_state`` on CPU: nothing to restore."""


def _define_names_missing_without_te() -> None:
    """megatron-core 0.16.1's MoE router tests ``te_general_gemm is not None`` but only defines
    the name when Transformer Engine imports (NameError otherwise, on CPU and on GPUs without
    TE alike); define it as None, the value its code expects for "no TE"."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def install() -> bool:
    """Install the workarounds once (idempotent). On a CUDA machine only the Transformer-Engine
    name fix above applies (and only where TE is absent); everything CPU-specific is skipped.

    Returns True when the CPU workarounds are active in this process.
    """
    global _installed
    with _lock:
        if _installed:
            return not cuda_in_use()
        _define_names_missing_without_te()
        if not cuda_in_use():
            cpu_torch = _TorchOnCpu()
            for name in ALLOCATE_ON_CPU:
                importlib.import_module(name).torch = cpu_torch
            # initialize_rng_tracker() builds a CudaRNGStatesTracker whose add()/fork() read and
            # write CUDA generator states; on CPU the tracked streams must be CPU generator states.
            megatron_random.initialize_rng_tracker = _initialize_cpu_rng_tracker
            if megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED and not isinstance(
                megatron_random._CUDA_RNG_STATE_TRACKER, CpuRNGStatesTracker
            ):
                _initialize_cpu_rng_tracker(force_reset=True)
            # tensor_parallel.checkpoint (activation recompute) brackets the recomputed forward
            # with the CUDA generator state; on CPU that state does not exist.
            megatron_random._get_cuda_rng_state = _no_cuda_rng_state
            megatron_random._set_cuda_rng_state = _set_no_cuda_rng_state
        _installed = True
        return not cuda_in_use()
