"""Every runtime workaround that lets megatron-core (0.16 and 0.19) run on CPU with gloo, in one place.

megatron-core assumes a CUDA device in a few spots on the paths we use: GPTModel with the local
layer spec (dense at any TP size, MoE at TP 1), Megatron DDP (with or without the
distributed-optimizer buffer layout), ``model_parallel_cuda_manual_seed``. We never edit
megatron-core: ``install()`` patches those spots at runtime, once, and only when CUDA is
absent, so a GPU run executes megatron-core untouched. Each patch says what megatron-core does
and why we override it.

What running GPTModel forward+backward (+ DDP grad sync) on CPU needed:

* ``RotaryEmbedding.get_emb`` (and YaRN's) moves ``inv_freq`` to ``torch.cuda.current_device()``;
* Megatron DDP allocates its param/grad buffers on ``torch.cuda.current_device()``;
* sequence parallelism's all-gather / reduce-scatter allocate their outputs on
  ``torch.cuda.current_device()`` (megatron-core's torch norm refuses sequence parallelism:
  ``layer_spec.SequenceParallelTorchNorm`` takes its place, not a patch);
* the MoE router moves its gating weight to ``torch.cuda.current_device()`` every forward;
* with pipeline parallelism, word embeddings tied to the output layer are moved to CUDA
  (``weight.data.cuda()``) before the first and last stage all-reduce them at construction;
* ``model_parallel_cuda_manual_seed`` stores CUDA generator states in the RNG tracker;
* activation recompute (``tensor_parallel.checkpoint``) saves and restores the CUDA generator
  state around the recomputed forward (the CPU state and the tracker's streams it keeps too);
* the MoE all-to-all token dispatcher (expert parallelism) creates a ``torch.cuda.Stream`` for
  its device-to-host copies of the split sizes and synchronises on an event of it, and those
  copies (``maybe_move_tensor_to_cpu``) make numpy split sizes only from CUDA tensors, while
  ``all_to_all_single`` takes no tensor as split sizes;
* the MoE router names ``te_general_gemm`` that megatron-core only defines when Transformer
  Engine is installed (a NameError on GPUs without TE too: that one fix applies everywhere);
* core_v0.16.1's multi-latent attention believes Transformer Engine present whenever its
  extension module imports (a TypeError building the layer without TE, on GPUs too: applied
  everywhere, ``_mla_without_te``);
* the local ``DotProductAttention`` builds its mask on CUDA: not patched, HDP replaces core
  attention altogether (``core_attention.HDPCoreAttention``);
* weights: build with ``use_cpu_initialization=True`` (``model.build_gpt_model`` does), else
  every TP layer allocates its weight on CUDA. That path is also what gives the same full
  weights for any TP size, so it is a choice, not a patch.

Megatron-LM's training loop (``install_training()``, below: ``pretrain_gpt.py`` through
``initialize_megatron``, parallel state, DDP, the distributed optimizer, timers, checkpointing in
torch and torch_dist formats, RNG state, evaluation) is covered too, on gloo. It is installed only
by our launcher (``python -m megatron_bytescale.launch``) and the patched ``pretrain_gpt.py``,
before ``megatron.training`` is imported, and never when CUDA is present (except the torch-Adam
resume fix: that megatron-core bug hits GPUs without Apex/TE too). Its shims, each naming the
functions it serves (by name, in both eras): the Megatron modules in ``TRAINING_MODULES`` see a ``torch`` whose
``cuda`` answers for the CPU (current device, one device per rank, no-op streams/synchronize,
zero memory stats, the CPU generator's RNG state) and whose tensor factories read a CUDA
``device=`` as the CPU; ``initialize_megatron(allow_no_cuda=True)``; gloo for NCCL; the C++
dataset helpers from the megatron-core wheel instead of ``make`` in the checkout; ``.cuda()``
returns its module/tensor; the optimizers' ``torch.cuda.FloatTensor`` type-name checks; the
torch-Adam resume of the distributed optimizer. The triton kernel modules megatron-core imports
(batch-invariant kernels, 0.19's MoE paged stash) are stood in for by ``triton_stand_ins.py``,
which must act before megatron-core is first imported and so is installed by the package itself.

Not covered (they stay CUDA-only): CUDA graphs, Transformer Engine, fused kernels; bf16/fp16 on
CPU is untested (the CPU runs are fp32).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import sys
import threading
import types

import torch
from megatron.core.tensor_parallel import random as megatron_random

_lock = threading.Lock()
_installed = False


def cuda_in_use() -> bool:
    return torch.cuda.is_available()


class _NoStream:
    """``torch.cuda.Stream`` / ``current_stream()`` on CPU: work is already in program order."""

    def __init__(self, *unused, **unused_kw):
        pass

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event=None):
        return event


class _NoEvent(_NoStream):
    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other) -> float:
        return 0.0


class _CudaOnCpu:
    """``torch.cuda`` as the patched megatron-core modules see it: the current device is the CPU,
    and its streams are no-ops (work on the CPU already runs in program order)."""

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device() -> torch.device:
        return torch.device("cpu")

    # core_v0.19's DDP bucket group waits on the current stream for CUDA-graph replays and
    # runs its reductions under a side stream (param_and_grad_buffer: start_grad_sync)
    current_stream = staticmethod(lambda *a, **k: _NoStream())
    stream = staticmethod(lambda *a, **k: contextlib.nullcontext())


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
    # so does YaRN's (multi-latent attention's --rope-type yarn), and its __init__ builds there
    "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding",
    # multi-token prediction's loss tracker (and core_v0.19's acceptance counts) live there
    "megatron.core.transformer.multi_token_prediction",
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


def _tied_embeddings_stay_on_cpu(setup):
    """Wrap ``LanguageModule.setup_embeddings_and_output_layer``: with PP > 1 it moves the tied
    word-embedding weight to CUDA (``weight.data = weight.data.cuda()``)
    before all-reducing it over the embedding group; on CPU ``.cuda()`` returns the tensor
    itself during that call only (the all-reduce then runs on gloo)."""
    if getattr(setup, "_cpu_wrapped", False):
        return setup

    @functools.wraps(setup)
    def on_cpu(self, *args, **kwargs):
        cuda = torch.Tensor.cuda
        torch.Tensor.cuda = lambda tensor, *unused, **unused_kw: tensor
        try:
            return setup(self, *args, **kwargs)
        finally:
            torch.Tensor.cuda = cuda

    on_cpu._cpu_wrapped = True
    return on_cpu


class _DispatcherStream:
    """The all-to-all dispatcher's side stream on CPU: its copies already ran in program order."""

    def __init__(self, *unused, **unused_kw):
        pass

    def wait_stream(self, other) -> None:
        pass

    def record_event(self, event=None):
        return _DispatcherStream()  # an "event": synchronize() returns at once

    def synchronize(self) -> None:
        pass


class _DispatcherCuda(_CudaOnCpu):
    Stream = _DispatcherStream
    current_stream = staticmethod(lambda *a, **k: None)  # never the side stream: it "waits" on it
    stream = staticmethod(lambda *a, **k: contextlib.nullcontext())


class _DispatcherTorch:
    """``torch`` as megatron-core's token dispatcher sees it on CPU (MoE all-to-all, EP > 1):
    real but for ``torch.cuda``'s stream and current device."""

    cuda = _DispatcherCuda()

    def __getattr__(self, name):
        return getattr(torch, name)


def _splits_to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
    """megatron-core's ``maybe_move_tensor_to_cpu`` on CPU: the tensor is already on the host;
    ``as_numpy`` (split sizes for ``all_to_all_single``) still gives numpy, as on a GPU."""
    if as_numpy and torch.is_tensor(tensor):
        return tensor.detach().numpy()
    return tensor


def _define_names_missing_without_te() -> None:
    """megatron-core 0.16.1's MoE router tests ``te_general_gemm is not None`` but only defines
    the name when Transformer Engine imports (NameError otherwise, on CPU and on GPUs without
    TE alike); define it as None, the value its code expects for "no TE"."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _mla_without_te() -> None:
    """megatron-core 0.16.1's ``multi_latent_attention`` sets its own ``HAVE_TE`` when
    ``megatron.core.extensions.transformer_engine`` imports, and that module imports without
    Transformer Engine too (its TE classes are then mock stand-ins, not types), so
    ``MLASelfAttention.__init__`` fails on every machine without TE at
    ``isinstance(self.linear_proj, TELinear)`` (multi_latent_attention.py:185, a TypeError).
    The module's flag is set to the extension's own ``HAVE_TE``, which is what its code means
    by "TE present" (core_v0.19 imports that flag itself)."""
    from megatron.core.extensions import transformer_engine as te_extension
    from megatron.core.transformer import multi_latent_attention

    if not te_extension.HAVE_TE and getattr(multi_latent_attention, "HAVE_TE", False):
        multi_latent_attention.HAVE_TE = False


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
        _mla_without_te()
        if not cuda_in_use():
            cpu_torch = _TorchOnCpu()
            for name in ALLOCATE_ON_CPU:
                importlib.import_module(name).torch = cpu_torch
            # MoEAlltoAllTokenDispatcher.__init__ creates a CUDA stream for its split-size copies
            dispatcher = importlib.import_module("megatron.core.transformer.moe.token_dispatcher")
            dispatcher.torch = _DispatcherTorch()
            dispatcher.maybe_move_tensor_to_cpu = _splits_to_host
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
            from megatron.core.models.common.language_module.language_module import LanguageModule

            LanguageModule.setup_embeddings_and_output_layer = _tied_embeddings_stay_on_cpu(
                LanguageModule.setup_embeddings_and_output_layer
            )
        _installed = True
        return not cuda_in_use()


# ====================================================================== Megatron-LM's training loop
# ``install_training()``: what ``pretrain_gpt.py`` (Megatron-LM core_v0.16 or core_v0.19, megatron/training
# and the megatron-core parts it drives: DDP, the distributed optimizer, timers, checkpointing)
# needs to run on CPU with gloo. Called only by our launcher and by the patched pretrain_gpt.py,
# before ``megatron.training`` is imported, and a no-op when CUDA is present.

_training_installed = False


def _to_cpu_device(device):
    """A ``device=`` argument Megatron gives as CUDA ('cuda', 'cuda:N', torch.device('cuda'), an
    int index) as the CPU; anything else unchanged."""
    if isinstance(device, int) and not isinstance(device, bool):
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


def _on_cpu(factory):
    def make(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        return factory(*args, **kwargs)

    make.__name__ = getattr(factory, "__name__", "factory")
    return make


def _zero(*unused, **unused_kw) -> int:
    return 0


def _nothing(*unused, **unused_kw) -> None:
    return None


class _TrainingCuda:
    """``torch.cuda`` as Megatron's training modules see it on CPU (everything else is real)."""

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    current_device = staticmethod(lambda: torch.device("cpu"))
    # _initialize_distributed skips mpu.initialize_model_parallel and _set_random_seed the model-parallel RNG
    # seeds when device_count() is 0: each rank has one device, its CPU
    device_count = staticmethod(lambda: 1)
    set_device = staticmethod(_nothing)
    synchronize = staticmethod(_nothing)
    empty_cache = staticmethod(_nothing)
    reset_peak_memory_stats = staticmethod(_nothing)
    reset_max_memory_allocated = staticmethod(_nothing)
    memory_allocated = staticmethod(_zero)
    max_memory_allocated = staticmethod(_zero)
    memory_reserved = staticmethod(_zero)
    max_memory_reserved = staticmethod(_zero)
    memory_stats = staticmethod(lambda *a, **k: {})
    # get_device_arch_version (read by validate_args when TP > 1): no GPU arch
    get_device_properties = staticmethod(
        lambda *a, **k: types.SimpleNamespace(major=0, minor=0, name="cpu", total_memory=0, multi_processor_count=1)
    )
    get_device_capability = staticmethod(lambda *a, **k: (0, 0))
    Stream = _NoStream
    Event = _NoEvent
    current_stream = staticmethod(lambda *a, **k: _NoStream())
    default_stream = staticmethod(lambda *a, **k: _NoStream())
    stream = staticmethod(lambda *a, **k: contextlib.nullcontext())
    nvtx = types.SimpleNamespace(
        range_push=_nothing, range_pop=_nothing, range=lambda *a, **k: contextlib.nullcontext()
    )
    # checkpointing.py get_rng_state / _load_base_checkpoint's RNG restore: the CPU generator
    # stands in for the CUDA one (the CPU generator is what dropout draws from here)
    get_rng_state = staticmethod(lambda *a, **k: torch.get_rng_state())
    set_rng_state = staticmethod(lambda state, *a, **k: torch.set_rng_state(state))
    # DistributedOptimizer and optimizer/__init__ compare param.type() with the CUDA names
    FloatTensor = torch.FloatTensor
    HalfTensor = torch.HalfTensor
    BFloat16Tensor = torch.BFloat16Tensor


_TENSOR_FACTORIES = (
    "tensor",
    "as_tensor",
    "zeros",
    "ones",
    "empty",
    "full",
    "arange",
    "rand",
    "randn",
    "randint",
    "zeros_like",
    "ones_like",
    "empty_like",
    "full_like",
    "empty_strided",
    "linspace",
)


class _TrainingTorch:
    """``torch`` as Megatron's training modules see it on CPU: the real module except
    ``torch.cuda`` (``_TrainingCuda``) and tensor factories whose CUDA ``device=`` means CPU."""

    cuda = _TrainingCuda()

    def __getattr__(self, name):
        return getattr(torch, name)


for _name in _TENSOR_FACTORIES:
    setattr(_TrainingTorch, _name, staticmethod(_on_cpu(getattr(torch, _name))))

# Megatron modules whose module-level ``torch`` becomes ``_TrainingTorch`` on CPU, each with the
# functions whose CUDA calls it serves (by name: the same names in core_v0.16 and core_v0.19; a
# module one era lacks is skipped by install_training).
TRAINING_MODULES = {
    "megatron.training.initialize": "initialize_megatron (MoE loss scale), _initialize_distributed (device_count "
    "0 would skip mpu.initialize_model_parallel; set_device), _set_random_seed",
    "megatron.training.training": "pretrain (start timestamps), get_model (DDP side stream), train_step and "
    "evaluate (loss dicts), training_log (memory_stats), checkpoint_and_decide_exit "
    "(exit flags), build_train_valid_test_data_loaders (do_train flags, eval_iters)",
    "megatron.training.utils": "(core_v0.16) calc_params_l2_norm, reduce_max_stat_across_model_parallel_group, "
    "logical_and_across_model_parallel_group, report_memory, get_device_arch_version",
    # core_v0.19: training/utils.py became a package; the same functions live in these modules
    "megatron.training.utils.common_utils": "(core_v0.19) calc_params_l2_norm, report_memory, get_device_arch_version",
    "megatron.training.utils.utils": "(core_v0.19) the model-parallel reductions of the loss and grad statistics",
    "megatron.training.models.dist_utils": "(core_v0.19) prepare_existing_model_chunks_for_distributed_training "
    "(chunks moved to current_device, DDP side stream)",
    "megatron.training.checkpointing": "read_metadata (iteration tensor), get_rng_state, load_checkpoint "
    "(set_rng_state, empty_cache)",
    "megatron.training.inprocess_restart": "inprocess_restart (device_count), maybe_force_nccl_backend_init",
    "megatron.core.timers": "Timer.start / Timer.stop (synchronize), _get_elapsed_time_all_ranks (all-gather buffer)",
    "megatron.core.optimizer.optimizer": "MixedPrecisionOptimizer.__init__ (found-inf), get_loss_scale, offload_to_cpu",
    "megatron.core.optimizer.distrib_optimizer": "get_parameter_state_dp_zero, load_state_dict (state buffers)",
    "megatron.core.optimizer.clip_grads": "get_grad_norm_fp32, count_zeros_fp32 (norm tensors)",
    "megatron.core.distributed.distributed_data_parallel": "_allocate_buffers_for_parameters (current_device), "
    "offload_grad_buffers / restore_grad_buffers",
    "megatron.core.tensor_parallel.random": "_get_cuda_rng_state, CudaRNGStatesTracker.add, "
    "model_parallel_cuda_manual_seed's get/set_rng_state",
    "megatron.core.tensor_parallel.layers": "the parallel layers' __init__ (weights on current_device without "
    "use_cpu_initialization)",
    "megatron.core.rerun_state_machine": "validate_result, _reduce_any (result tensors), _save_state / "
    "_restore_state (RNG state)",
    "megatron.core.utils": "GlobalMemoryBuffer.get_tensor, local_multi_tensor_l2_norm, StragglerDetector "
    "(Events, current_device)",
    "megatron.core.dist_checkpointing.strategies.filesystem_async": "preload_tensors (synchronize)",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver": "verify_global_md_reuse, "
    "save_state_dict_async_finalize (flags on 'cuda')",
    "megatron.core.dist_checkpointing.strategies.fully_parallel": "FullyParallelLoadStrategyWrapper.load (synchronize)",
    "megatron.core.dist_checkpointing.strategies.async_utils": "schedule_async_call, maybe_finalize_async_calls, "
    "sync_all_async_calls, async_loop",
    "megatron.core.dist_checkpointing.exchange_utils": "_get_empty_tensor_for_exchange, "
    "exchange_loaded_tensors_gather_rounds (buffers on 'cuda')",
    "megatron.core.dist_checkpointing.tensor_aware_state_dict": "_insert_sharded_data (synchronize)",
    "megatron.core.transformer.moe.moe_utils": "track_moe_metrics (tensors on device='cuda')",
}


def install_training() -> bool:
    """The CPU backend for Megatron-LM's training loop (idempotent). When CUDA is present only
    the torch-Adam resume fix applies, and only where megatron-core runs that fallback (no Apex,
    no TE: the same megatron-core bug on any device); nothing CPU-specific is installed.
    Returns True when the CPU backend is active."""
    global _training_installed
    with _lock:
        if _training_installed:
            return not cuda_in_use()
        _training_installed = True
    _load_torch_adam_state()
    _mla_without_te()  # a megatron-core fault on any device without Transformer Engine
    if cuda_in_use():
        return False
    install()
    cpu_torch = _TrainingTorch()
    for name in TRAINING_MODULES:
        try:
            importlib.import_module(name).torch = cpu_torch
        except ModuleNotFoundError:  # a trimmed or stand-in Megatron-LM without that module
            continue
    _patch_training_functions()
    _keep_on_cpu()
    _answer_cuda_type_names()
    return True


def _load_torch_adam_state() -> None:
    """Resuming the distributed optimizer when megatron-core falls back to torch Adam (no Apex,
    no Transformer Engine: always on CPU, and on GPUs without them). Faults of core_v0.16
    and core_v0.19, all on that path only:

    * ``DistributedOptimizer.load_state_dict`` gives every
      parameter the *same* ``step`` tensor; torch Adam then adds 1 to it once per parameter and
      step, so the bias correction after a resume is wrong (and the next save sees the count
      run away). Here each parameter gets its own copy.
    * ``_set_main_param_and_optimizer_states`` (torch format via
      ``load_parameter_state_from_dp_zero``) copies every key of the live state, ``step``
      included, from the file, which holds only param/exp_avg/exp_avg_sq: KeyError 'step'; and it
      copies into leaf parameters that require grad outside ``no_grad``; from a torch_dist file
      (dp_reshardable) it copies a ``step`` that is the load template's, not the file's. Here it
      copies the live keys the file has except ``step`` (which Megatron means to come from the
      param groups), under ``no_grad``.
    * ``DistributedOptimizer.state_dict`` reads ``step`` from every parameter's state
      and asserts one value; before the first step (torch_dist load builds its template from
      it) torch Adam has no state yet: the assert fails. Here a parameter without state gets
      what torch Adam's first step would create (step 0, zero moments), which the load then
      overwrites.
    """
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:  # Apex/TE's Adam keeps one step per param group
        return
    dist_opt = distrib_optimizer.DistributedOptimizer
    original_load = dist_opt.load_state_dict

    @functools.wraps(original_load)
    def load_state_dict(self, state_dict):
        result = original_load(self, state_dict)
        inner = getattr(self, "optimizer", None)
        if isinstance(inner, torch.optim.Optimizer):
            for state in inner.state.values():
                if torch.is_tensor(state.get("step")):
                    state["step"] = state["step"].detach().clone()
        return result

    dist_opt.load_state_dict = load_state_dict
    original_state_dict = dist_opt.state_dict

    @functools.wraps(original_state_dict)
    def state_dict(self):
        inner = getattr(self, "optimizer", None)
        if isinstance(inner, torch.optim.Optimizer):
            for group in inner.param_groups:
                for param in group["params"]:
                    state = inner.state[param]
                    if "step" not in state:  # what torch Adam's first step creates
                        state["step"] = torch.tensor(0.0)
                        state.setdefault("exp_avg", torch.zeros_like(param, memory_format=torch.preserve_format))
                        state.setdefault("exp_avg_sq", torch.zeros_like(param, memory_format=torch.preserve_format))
        return original_state_dict(self)

    dist_opt.state_dict = state_dict
    original_set = dist_opt._set_main_param_and_optimizer_states

    @functools.wraps(original_set)
    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return original_set(self, model_param, tensors)
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        destination = {"param": main_param, **self.optimizer.state[main_param]}
        with torch.no_grad():
            for key, tensor in destination.items():
                # the file's entries may carry metadata ('padding'); torch Adam's 'step' comes
                # from the param groups (set by load_state_dict), while the entry's
                # 'step' is the load template's own value (a LocalNonpersistentObject)
                if key in tensors and key != "step":
                    tensor.copy_(tensors[key])

    dist_opt._set_main_param_and_optimizer_states = _set_main_param_and_optimizer_states


_real_tensor_type = torch.Tensor.type


def _cuda_type_name(self, dtype=None, non_blocking=False, **kwargs):
    """``Tensor.type()`` with no argument answers the CUDA name ('torch.cuda.FloatTensor');
    with an argument it converts, as torch does."""
    if dtype is None and not kwargs:
        name = _real_tensor_type(self)
        return (
            name.replace("torch.", "torch.cuda.", 1)
            if not self.is_cuda and not name.startswith("torch.cuda.")
            else name
        )
    return _real_tensor_type(self, dtype, non_blocking, **kwargs)


@contextlib.contextmanager
def _cuda_type_names():
    torch.Tensor.type = _cuda_type_name
    try:
        yield
    finally:
        torch.Tensor.type = _real_tensor_type


def _with_cuda_type_names(function):
    @functools.wraps(function)
    def call(*args, **kwargs):
        with _cuda_type_names():
            return function(*args, **kwargs)

    return call


def _answer_cuda_type_names() -> None:
    """Megatron's optimizers sort parameters by ``param.type()`` against CUDA type names and
    raise on anything else: DistributedOptimizer._build_model_and_main_param_groups and
    __init__, Float16OptimizerWithFloat16Params.__init__, clip_grad_by_total_norm_fp32. During
    those calls only, a CPU tensor's ``type()`` gives the CUDA name of its dtype."""
    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer

    dist_opt = distrib_optimizer.DistributedOptimizer
    build = dist_opt.__dict__["_build_model_and_main_param_groups"].__func__
    dist_opt._build_model_and_main_param_groups = classmethod(_with_cuda_type_names(build))
    dist_opt.__init__ = _with_cuda_type_names(dist_opt.__init__)
    optimizer.Float16OptimizerWithFloat16Params.__init__ = _with_cuda_type_names(
        optimizer.Float16OptimizerWithFloat16Params.__init__
    )
    wrapped_clip = _with_cuda_type_names(clip_grads.clip_grad_by_total_norm_fp32)
    clip_grads.clip_grad_by_total_norm_fp32 = wrapped_clip
    optimizer.clip_grad_by_total_norm_fp32 = wrapped_clip  # optimizer.py imports it by name


def _keep_on_cpu() -> None:
    """``.cuda()`` on modules and tensors returns them as they are: get_model
    (``model_module.cuda(...)``), the training loop, checkpointing and the optimizer move things
    with ``.cuda()``. This is process-wide, which is safe only because it runs where CUDA is
    absent: there every ``.cuda()`` call could only raise."""

    def module_cuda(self, device=None):
        return self

    def tensor_cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
        return self

    torch.nn.Module.cuda = module_cuda
    torch.Tensor.cuda = tensor_cuda


def _patch_training_functions() -> None:
    import megatron.training.initialize as initialize
    import megatron.training.training as training

    if not hasattr(initialize, "_initialize_distributed"):  # a stand-in, not Megatron-LM's loop
        return

    # initialize.py:62 asserts torch.cuda.is_available() unless allow_no_cuda
    original_initialize = initialize.initialize_megatron

    @functools.wraps(original_initialize)
    def initialize_megatron(*args, **kwargs):
        kwargs["allow_no_cuda"] = True
        return original_initialize(*args, **kwargs)

    initialize.initialize_megatron = initialize_megatron
    training.initialize_megatron = initialize_megatron  # training.py imports it by name

    # _initialize_distributed: init_process_group(backend=args.distributed_backend); NCCL needs GPUs
    original_distributed = initialize._initialize_distributed

    @functools.wraps(original_distributed)
    def _initialize_distributed(*args, **kwargs):
        megatron_args = initialize.get_args()
        if megatron_args.distributed_backend == "nccl":
            megatron_args.distributed_backend = "gloo"
        return original_distributed(*args, **kwargs)

    initialize._initialize_distributed = _initialize_distributed

    # _compile_dependencies compiles the C++ dataset helpers with `make` inside the checkout (and
    # builds fused CUDA kernels): on CPU the helpers come from the megatron-core wheel
    # (``load_dataset_helpers``) and there are no kernels to build.
    def _compile_dependencies():
        load_dataset_helpers()

    initialize._compile_dependencies = _compile_dependencies


def load_dataset_helpers() -> None:
    """Make ``megatron.core.datasets.helpers_cpp`` importable: as it is when the checkout has it
    built, else the compiled module shipped in the megatron-core wheel (same sources at
    release), loaded under that name."""
    name = "megatron.core.datasets.helpers_cpp"
    if name in sys.modules:
        return
    try:
        importlib.import_module(name)
        return
    except ImportError:
        pass
    from importlib import metadata

    from ..errors import ConfigError

    files = [
        f
        for f in (metadata.distribution("megatron-core").files or ())
        if f.name.startswith("helpers_cpp") and f.suffix in (".so", ".pyd")
    ]
    if not files:
        raise ConfigError(
            "Megatron's C++ dataset helpers are neither built in the checkout nor shipped in the installed "
            "megatron-core wheel: run `make -C $MEGATRON_LM_DIR/megatron/core/datasets` (needs pybind11)"
        )
    path = str(files[0].locate())
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
