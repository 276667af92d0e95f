"""Megatron-LM glue: what ``pretrain_gpt.py`` calls to train with Hybrid Data Parallelism.

The patch series (``patches/``) and the launcher (``python -m megatron_bytescale.launch``)
use exactly these functions; the logic lives here, the patch only calls it. Every hook wraps
Megatron's own function and hands control back to it unchanged unless the run was started
with ``--hybrid-data-parallel``, so a patched checkout still trains as upstream does.

==========================  ==========================================================
Megatron's piece            HDP replacement (when --hybrid-data-parallel is set)
==========================  ==========================================================
extra_args_provider         ``extra_args_provider(base)``: base's flags + the HDP group
validate_args               ``install_argument_validation()``: Megatron's checks, then
                            ``validate_hdp_args``
model_provider              ``model_provider(base)``: layer spec with HDP core attention
                            (through Megatron's ``--spec`` hook), RoPE at true positions
datasets provider           ``datasets_provider(base)``: HDP loaders; one ``StepBatch``
                            per step and rank (``--dataloader-type external``)
forward_step                ``forward_step(base, loss_func)``: one ``MicroBatchData`` as a
                            packed [1, T] row; the loss stays pretrain_gpt's per-token sum
get_forward_backward_func   ``install_forward_backward()``: ``runtime.step.hdp_forward_backward``, whose
                            gradient reduction divides by the step's global token count
==========================  ==========================================================

The HDP group is Megatron's data-parallel group with context parallel (DP x CP, CP = 1).
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..errors import BytescaleError, ConfigError
from ..megatron_era import is_v019
from . import checkpoint_guard, flag_table, rank_guard
from .arguments import (
    add_hdp_arguments,
    chain_extra_args_providers,
    check_data_exists,
    check_global_batch,
    check_launch,
    check_schedule,
    cost_model_from_args,
    planner_config_from_args,
    validate_hdp_args,
)
from .step_timing import StepTimer, measured_elsewhere

# Megatron's ``--spec MODULE NAME`` reads ``vars(MODULE)[NAME]``: the HDP model provider puts
# the layer spec it built for this run here and points args.spec at it.
HDP_LAYER_SPEC = None
_SPEC_TARGET = [__name__, "HDP_LAYER_SPEC"]
LOSS_KEY = "lm loss"  # pretrain_gpt's loss report key


def _megatron_args():
    from megatron.training import get_args

    return get_args()


def hdp_enabled(args=None) -> bool:
    args = _megatron_args() if args is None else args
    return bool(getattr(args, "hybrid_data_parallel", False))


def _hdp_args(args=None):
    """Megatron's args if HDP is on (validated once, also when the yaml path skipped
    validate_args), else None."""
    args = _megatron_args() if args is None else args
    if not hdp_enabled(args):
        return None
    if getattr(args, "hdp_size", None) is None:
        validate_hdp_args(args)
    return args


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


# ------------------------------------------------------------------ arguments
def extra_args_provider(base: Callable | None = None) -> Callable:
    """``pretrain(..., extra_args_provider=extra_args_provider(base))``: base's flags, then ours."""
    return chain_extra_args_providers(base, add_hdp_arguments)


def validate_args_then_hdp(validate_args: Callable) -> Callable:
    """Wrap Megatron's ``validate_args(args, defaults)`` so ``validate_hdp_args`` runs right after it."""
    if getattr(validate_args, "_hdp_wrapped", False):
        return validate_args

    @functools.wraps(validate_args)
    def validate(args, defaults={}):  # noqa: B006 (Megatron's signature)
        hdp = getattr(args, "hybrid_data_parallel", False)
        try:
            if hdp:
                # the flag table's refusals on the values as parsed (Megatron's validate_args
                # asserts on some of them with a traceback), and any Megatron flag given that the
                # table does not classify
                flag_table.refuse(args, flag_table.given_flags(sys.argv[1:]), megatron_options())
                check_launch(args)  # before Megatron's asserts would fire with a traceback
                check_global_batch(args)
                check_schedule(args)  # Megatron's scheduler asserts it a minute later, in every rank
            # Megatron prints its ~200-line argument dump at the end of validate_args: held back
            # until the HDP checks pass, so a refusal is not buried under it
            dump = io.StringIO()
            try:
                with contextlib.redirect_stdout(dump) if hdp else contextlib.nullcontext():
                    result = validate_args(args, defaults)
            except BaseException:
                print(dump.getvalue(), end="", flush=True)
                raise
            validate_hdp_args(args)
            if hdp:
                check_data_exists(args)
                checkpoint_guard.hold_save_lock(args)
                checkpoint_guard.check_overwrite(args)
            print(dump.getvalue(), end="", flush=True)
        except ConfigError as exc:
            # a wrong launch stops here, before any worker trains, with one line: from the
            # launcher (megatron_bytescale.torchrun), else from rank 0
            rank_guard.report(str(exc))
        return result

    validate._hdp_wrapped = True
    return validate


def megatron_options() -> set[str] | None:
    """The option strings of the Megatron parser this rank runs (its modules are imported by
    now); None for a training package without Megatron's parser (the launcher tests' stand-in)."""
    import argparse

    from megatron.training import arguments

    add = getattr(arguments, "add_megatron_arguments", None)
    return None if add is None else set(add(argparse.ArgumentParser(allow_abbrev=False))._option_string_actions)


# ------------------------------------------------------------------ forward/backward
def get_forward_backward_func_or_hdp(original: Callable) -> Callable:
    """Wrap Megatron's ``get_forward_backward_func``: the HDP step when HDP is on."""
    if getattr(original, "_hdp_wrapped", False):
        return original

    @functools.wraps(original)
    def get_forward_backward_func(*args, **kwargs):
        if _hdp_args() is not None:
            return megatron_forward_backward
        return original(*args, **kwargs)

    get_forward_backward_func._hdp_wrapped = True
    return get_forward_backward_func


_offloaders: dict[int, Any] = {}


def _offloader(model):
    """One ActivationOffloader per model for --hdp-selective-offload (its layers: the decoder's,
    of every model chunk in order with virtual pipeline stages)."""
    args = _hdp_args()
    if args is None or not args.hdp_selective_offload:
        return None
    chunks = model if isinstance(model, list) else [model]
    key = id(chunks[0])
    if key not in _offloaders:
        from ..runtime.offload import ActivationOffloader, transformer_layers

        _offloaders[key] = ActivationOffloader([layer for chunk in chunks for layer in transformer_layers(chunk)])
    return _offloaders[key]


def megatron_forward_backward(**kwargs) -> list:
    """``runtime.step.hdp_forward_backward`` as Megatron's training loop calls it.

    Megatron's train_step and evaluate read ``losses[0].keys()`` on every rank and then
    all-reduce each key over the DP x CP group; a rank whose plan gives it no micro-batch this
    step answers with zero sums for the keys it last reported, so the all-reduce still matches.
    """
    from ..runtime.step import hdp_forward_backward
    from . import moe_statistics

    moe_statistics.install()  # a padding-only expert-parallel filler's router statistics: 0, not 0 / 0
    kwargs.setdefault("offloader", _offloader(kwargs.get("model")))
    args = _hdp_args()  # every --log-interval: the planner's predicted step time beside the measured one
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    gpus = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if args is not None and _step_timer.steps == 0:  # the profiling hint only where re-profiling can help
        from .arguments import default_hardware

        device = "cuda" if torch.cuda.is_available() else "cpu"
        hardware = getattr(args, "hdp_hardware", None) or default_hardware()
        _step_timer.measured_elsewhere = measured_elsewhere(getattr(args, "hdp_profile", None), hardware, device)
    losses = _step_timer.run(hdp_forward_backward, kwargs, getattr(args, "log_interval", None), rank, gpus)
    if losses:
        megatron_forward_backward.keys = tuple(losses[0].keys())
    elif not kwargs.get("collect_non_loss_data"):
        zeros = torch.zeros(2, dtype=torch.float32, device=_device())
        losses = [{key: zeros.clone() for key in megatron_forward_backward.keys}]
        if not kwargs.get("forward_only"):  # the routers' logged losses, as a filler records them
            model = kwargs.get("model")
            moe_statistics.record_idle_rank(model if isinstance(model, list) else [model])
    return losses


megatron_forward_backward.keys = (LOSS_KEY,)
_step_timer = StepTimer()


def install_argument_validation() -> None:
    """``validate_hdp_args`` right after Megatron's ``validate_args`` (idempotent). core_v0.16's
    ``initialize_megatron`` calls ``initialize.validate_args`` (imported there by name);
    core_v0.19's ``parse_and_validate_args`` calls ``arguments.validate_args``."""
    if is_v019():
        import megatron.training.arguments as module
    else:
        import megatron.training.initialize as module

    rank_guard.die_with_launcher()  # the first hooks every entry point installs
    rank_guard.record_uncaught()
    rank_guard.destroy_process_groups_at_exit()
    module.validate_args = validate_args_then_hdp(module.validate_args)


def install_forward_backward() -> None:
    """The HDP step from Megatron's ``get_forward_backward_func``, for train and evaluate, and
    checkpoints that keep every HDP rank's RNG state (``install_checkpoint_rng``); idempotent;
    runs without --hybrid-data-parallel keep Megatron's schedules and checkpoints."""
    import megatron.training.training as training

    training.get_forward_backward_func = get_forward_backward_func_or_hdp(training.get_forward_backward_func)
    from .elastic import install_elastic_resume

    # inside the verified load: the world it reads is the iteration that verifies
    install_elastic_resume(_hdp_args)  # a checkpoint from another world size: checked, announced, resharded
    install_checkpoint_rng()


def every_hdp_rank_rng(function: Callable) -> Callable:
    """Wrap Megatron's ``save_checkpoint`` / ``load_checkpoint`` so that, under HDP, they run as
    with ``--data-parallel-random-init``: checkpointing.py:347 then gathers the RNG state of every
    data-parallel rank and :1859 restores each rank its own. Megatron otherwise saves DP rank 0's
    state only and gives it to every rank on load, which is exact when all DP ranks draw the same
    random numbers; HDP ranks run different micro-batches (dropout draws differ), so a resume would
    not continue the uninterrupted run. The flag is set only during the call (the initial seeds
    stay Megatron's); checkpoints record it, so an HDP checkpoint loads only as HDP."""
    if getattr(function, "_hdp_wrapped", False):
        return function

    @functools.wraps(function)
    def call(*args, **kwargs):
        megatron_args = _hdp_args()
        if megatron_args is None or megatron_args.data_parallel_random_init:
            return function(*args, **kwargs)
        megatron_args.data_parallel_random_init = True
        try:
            return function(*args, **kwargs)
        finally:
            megatron_args.data_parallel_random_init = False

    call._hdp_wrapped = True
    return call


def install_checkpoint_rng() -> None:
    import megatron.training.training as training

    try:
        import megatron.training.checkpointing as checkpointing
    except ModuleNotFoundError:  # a stand-in training package without checkpoints
        return

    for module in (checkpointing, training):  # training.py:104-105 imports both by name
        module.save_checkpoint = checkpoint_guard.manifested_save(
            every_hdp_rank_rng(module.save_checkpoint), _hdp_args, _record_data_stream
        )
        module.load_checkpoint = checkpoint_guard.verified_load(every_hdp_rank_rng(module.load_checkpoint), _hdp_args)
    checkpointing.read_metadata = checkpoint_guard.chosen_tracker(checkpointing.read_metadata)


def check_megatron_version() -> None:
    """A megatron-core outside the supported range stops the process here, at start, with one
    line (``megatron_era``), not with a traceback at the first call whose API changed."""
    from ..megatron_era import era

    try:
        era()
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def install_cpu_backend() -> bool:
    """On a machine without CUDA, the CPU/gloo backend for Megatron's training loop
    (``cpu_compat.install_training``); nothing on a CUDA machine. Must run before
    ``megatron.training`` is imported (the launcher and the patched pretrain_gpt.py do so).
    The megatron-core version is checked first."""
    check_megatron_version()
    from . import cpu_compat

    return cpu_compat.install_training()


def install() -> None:
    """The CPU backend (without CUDA) and both runtime hooks into Megatron's training package
    (the launcher's entry point)."""
    install_cpu_backend()
    install_argument_validation()
    install_forward_backward()


# ------------------------------------------------------------------ model
def hdp_layer_spec(args, config=None, vp_stage=None):
    """The layer spec Megatron would pick for these flags, with HDP core attention."""
    from .layer_spec import hdp_gpt_layer_spec, with_hdp_core_attention

    use_te = args.transformer_impl == "transformer_engine"
    if args.num_experts:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        if config is None:
            from megatron.training.arguments import core_transformer_config_from_args

            config = core_transformer_config_from_args(args)
        return with_hdp_core_attention(
            get_gpt_decoder_block_spec(
                config,
                use_transformer_engine=use_te,
                normalization=args.normalization,
                qk_l2_norm=args.qk_l2_norm,
                vp_stage=vp_stage,
            )
        )
    if use_te:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return with_hdp_core_attention(
            get_gpt_layer_with_transformer_engine_spec(
                qk_layernorm=args.qk_layernorm,
                multi_latent_attention=args.multi_latent_attention,
                qk_l2_norm=args.qk_l2_norm,
            )
        )
    return hdp_gpt_layer_spec(
        qk_layernorm=args.qk_layernorm,
        normalization=args.normalization,
        qk_l2_norm=args.qk_l2_norm,
        multi_latent_attention=args.multi_latent_attention,
    )


def _install_model_hooks(args) -> None:
    """Hooks the model's build and forward need beyond the layer spec: multi-token prediction's
    (HDP attention in its layers, the roll along documents, the loss scale: ``mtp``)."""
    if args.mtp_num_layers:
        from . import mtp

        mtp.install()
        mtp.install_spec_hook("gpt_builders")  # core_v0.16's builder module, imported by pretrain_gpt.py


def model_provider(base: Callable) -> Callable:
    """Wrap pretrain_gpt's ``partial(model_provider, gpt_builder)``: under HDP the builder finds
    our layer spec through ``args.spec`` (Megatron's own custom-spec hook, refused as a user flag
    by validate_hdp_args) and the built model rotates q/k at each token's true position."""

    @functools.wraps(base)
    def provider(*args, **kwargs):
        hdp = _hdp_args()
        if hdp is None:
            return base(*args, **kwargs)
        global HDP_LAYER_SPEC
        _install_model_hooks(hdp)
        HDP_LAYER_SPEC = hdp_layer_spec(hdp, kwargs.get("config"), kwargs.get("vp_stage"))
        if hdp.mtp_num_layers:
            with _spec_from_builder_functions(HDP_LAYER_SPEC):
                model = base(*args, **kwargs)
        else:
            hdp.spec = list(_SPEC_TARGET)
            model = base(*args, **kwargs)
        if hdp.position_embedding_type == "rope":  # learned positions read position_ids directly
            from .rotary import use_true_positions

            use_true_positions(model)
        return model

    return provider


@contextlib.contextmanager
def _spec_from_builder_functions(spec):
    """core_v0.16's ``gpt_builder`` with multi-token prediction: given ``--spec`` it never sets
    the ``use_te`` its MTP branch reads (gpt_builders.py, an UnboundLocalError), so the HDP spec
    reaches it through the builder module's own spec functions instead (``args.spec`` unset),
    for this build only; its MTP branch then builds from Megatron's decoder specs, which the MTP
    spec hook (``mtp.install_spec_hook``) gives HDP attention."""
    builder = sys.modules.get("gpt_builders")
    names = ("_get_transformer_layer_spec", "get_gpt_decoder_block_spec")
    if builder is None or not all(hasattr(builder, n) for n in names):
        raise ConfigError(
            "--mtp-num-layers under HDP on core_v0.16 builds through pretrain_gpt.py's gpt_builders module, "
            "which this entry point did not load"
        )
    saved = {n: getattr(builder, n) for n in names}
    for n in names:
        setattr(builder, n, lambda *args, **kwargs: spec)
    try:
        yield
    finally:
        for n, function in saved.items():
            setattr(builder, n, function)


def _config_layer_spec(model_config, vp_stage=None):
    """core_v0.19: ``GPTModelConfig.transformer_layer_spec`` as a callable; the builder calls it
    with its model config and the chunk's ``vp_stage``."""
    return hdp_layer_spec(_hdp_args(), model_config.transformer, vp_stage)


HDP_GPT_BUILDER = "megatron_bytescale.megatron.gpt_builder.HDPGPTModelBuilder"


def model_config(config):
    """core_v0.19: under HDP, the ``GPTModelConfig`` pretrain_gpt.py builds from the flags gets
    the HDP layer spec, and a builder that rotates q/k at each token's true position (the
    config's ``builder`` is a class attribute naming the builder: this instance names ours, a
    subclass of Megatron's). Returns the config (changed in place)."""
    args = _hdp_args()
    if args is None:
        return config
    _install_model_hooks(args)
    config.transformer_layer_spec = _config_layer_spec
    object.__setattr__(config, "builder", HDP_GPT_BUILDER)
    return config


# ------------------------------------------------------------------ data
def per_token_loss(loss_mask: torch.Tensor, output_tensor: torch.Tensor, model=None):
    """pretrain_gpt's loss contract without its NaN/spike checks (used when no loss_func is
    given): the masked sum, the token count, and the report Megatron all-reduces."""
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {LOSS_KEY: torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def hdp_forward_step(data_iterator, model, loss_func: Callable = per_token_loss):
    """Megatron forward_step for one HDP micro-batch (``MicroBatchData``): the packed tokens as
    one [1, T] row with their true positions and no attention mask (our core attention masks
    documents and causality from the active layout)."""
    data = next(data_iterator)
    device = _device()
    tokens = data.tokens.to(device, non_blocking=True).unsqueeze(0)
    labels = data.labels.to(device, non_blocking=True).unsqueeze(0)
    loss_mask = data.loss_mask.to(device, non_blocking=True).unsqueeze(0)
    position_ids = data.positions.to(device, non_blocking=True).unsqueeze(0)
    extra = {}
    if data.padding_mask is not None and _is_moe(model):  # padding out of the router's statistics
        extra["padding_mask"] = data.padding_mask.to(device, non_blocking=True).unsqueeze(0)
    output = model(tokens, position_ids, None, labels=labels, loss_mask=loss_mask, **extra)
    return output, functools.partial(loss_func, loss_mask, model=model)


def _is_moe(model) -> bool:
    from megatron.core.utils import get_model_config

    return bool(getattr(get_model_config(model), "num_moe_experts", None))


def forward_step(base: Callable, loss_func: Callable | None = None) -> Callable:
    """Wrap pretrain_gpt's ``forward_step``: HDP micro-batches go through ``hdp_forward_step``
    with pretrain_gpt's own ``loss_func`` (per-token sums plus its NaN/spike checks)."""

    @functools.wraps(base)
    def step(data_iterator, model, *args, **kwargs):
        if _hdp_args() is None:
            return base(data_iterator, model, *args, **kwargs)
        if kwargs.get("return_schedule_plan"):
            raise ConfigError(
                "HDP micro-batches do not support MoE schedule plans (--overlap-moe-expert-parallel-comm)"
            )
        # a third positional argument (checkpoint_activations_microbatch) only comes from
        # Megatron's pipeline schedules, which HDP replaces
        return hdp_forward_step(data_iterator, model, loss_func or per_token_loss)

    return step


def hdp_rank() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_rank(with_context_parallel=True)


def _source_kwargs(args, spec) -> dict:
    """What opening a split needs beyond its paths: the model's vocabulary (indexed datasets),
    Megatron's tokenizer for mock tokens (its vocabulary and EOD) and for SFT conversations."""
    if spec.kind == "indexed":
        return {"vocab_size": getattr(args, "padded_vocab_size", None) or args.vocab_size}
    from megatron.training import get_tokenizer

    tokenizer = get_tokenizer()
    if spec.kind == "mock":
        return {"mock": {"vocab_size": int(tokenizer.vocab_size), "eod": int(tokenizer.eod)}}

    def tokenize(conversation):
        return tokenizer.tokenize_conversation(conversation, return_target=True, add_generation_prompt=False)

    # core_v0.16.1's SFTDataset ends every conversation with EOD, core_v0.19's does not
    return {"sft": {"tokenize": tokenize, "pad_id": tokenizer.pad, "eod": tokenizer.eod, "append_eod": not is_v019()}}


def open_split(args, spec):
    """One split's documents (``data.documents.StreamDocuments``) from its ``StreamSpec``."""
    from ..data.documents import open_stream

    if spec.kind == "sft":
        print(f"hdp: tokenizing the {spec.name} conversations of {', '.join(p.path for p in spec.parts)}", flush=True)
    return open_stream(spec, context_length=args.seq_length, seed=args.seed, **_source_kwargs(args, spec))


def build_loader(args, documents, rank: int, *, name: str = "train"):
    """The HDP loader (local or Ray) for one split's ``documents`` serving HDP rank ``rank``."""
    config, cost = planner_config_from_args(args), cost_model_from_args(args)
    common = dict(
        step_tokens=args.hdp_step_tokens,
        context_length=args.seq_length,
        seed=args.seed,
        rank=rank,
        cost=cost,
    )
    if args.hdp_dataloader == "ray":
        from ..data.ray_loader import RayDataLoader

        job = os.environ.get("SLURM_JOB_ID") or os.environ.get("MASTER_PORT", "0")
        return RayDataLoader(
            documents,
            config,
            **common,
            num_servers=args.hdp_ray_servers,
            lookahead=max(1, args.hdp_plan_ahead),
            name=f"bytescale-{job}-{name}",
            address=args.hdp_ray_address,
        )
    from ..data.local_loader import LocalDataLoader

    # the next steps are planned in a background process (data/plan_ahead.py), not a thread:
    # planning would hold the GIL the training loop launches its kernels with
    return LocalDataLoader(documents, config, **common, plan_ahead=args.hdp_plan_ahead)


def fast_forward(loader, args, documents, steps: int) -> None:
    """Move a fresh loader past the first ``steps`` steps (resuming at --load's iteration).
    Only the sample stream advances (document lengths only): nothing is planned or read."""
    if steps <= 0:
        return
    from ..data.sampler import loader_state

    sampler = documents.sampler(step_tokens=args.hdp_step_tokens, context_length=args.seq_length, seed=args.seed)
    position = sampler.start()
    for _ in range(steps):
        _, position = sampler.batch(position)
    loader.load_state_dict(loader_state(steps, position, sampler.fingerprint()))


def evaluations_before(iteration: int, args) -> int:
    """How many validations Megatron ran up to ``iteration``: one every --eval-interval
    iterations, none before --start-eval-at-iter (core_v0.19) when that is set."""
    done = iteration // args.eval_interval
    start = getattr(args, "start_eval_at_iter", None)
    if start:
        done -= min(done, (start - 1) // args.eval_interval)
    return done


_train_loader = None  # the training loader of this process: its position goes into each checkpoint


def _record_data_stream(folder, args, iteration: int) -> None:
    """checkpoint_guard's ``before_manifest``: what determines the training stream, and where it stands."""
    from . import data_stream

    data_stream.write(folder, args, iteration, _train_loader)


def resume_train(loader, args, documents, iteration: int) -> None:
    """Continue the training stream at --load's ``iteration``: from the position the checkpoint
    recorded when what determines the stream is unchanged (ConfigError naming what changed),
    else by replaying the stream to it (a checkpoint without a record)."""
    from . import data_stream
    from .checkpoint_guard import iteration_dir

    if not getattr(args, "load", None):  # (callers that set the iteration by hand) nothing recorded to read
        fast_forward(loader, args, documents, iteration)
        return
    point = data_stream.resume_point(iteration_dir(args.load, iteration), args, iteration)
    if point.line and torch.distributed.is_initialized() and torch.distributed.get_rank() == 0:
        print(point.line, flush=True)
    if point.position is None:
        fast_forward(loader, args, documents, iteration)
    elif point.position == data_stream.START:  # a new loader stands at its stream's beginning
        loader.load_state_dict(dict(loader.state_dict(), step=iteration))
    else:  # the loader's own state, at the recorded step and position
        loader.load_state_dict(dict(loader.state_dict(), step=iteration, position=point.position))


def _one_line_errors(iterator: Iterator) -> Iterator:
    """The loader's errors end the rank with one line through the launcher, not a traceback in
    every rank: bad data (status 2), a dead or silent planning process (status 1)."""
    while True:
        try:
            batch = next(iterator)
        except StopIteration:
            return
        except ConfigError as exc:
            rank_guard.report(str(exc))
        except BytescaleError as exc:
            rank_guard.report(str(exc), status=1)
        yield batch


def hdp_data_iterators(args, rank: int | None = None):
    """(train, valid, test) iterators of ``StepBatch`` for this HDP rank, one per split that has
    data (``data_config.data_config_from_args``: blends, ``--split``, mock data, SFT): training
    resumed at args.iteration (``resume_train``: from the position the checkpoint recorded);
    validation continued past the evaluations before it; the test split from its start (Megatron
    evaluates it once, after training)."""
    from .data_config import data_config_from_args

    global _train_loader
    rank = hdp_rank() if rank is None else rank
    config = data_config_from_args(args)
    iteration = getattr(args, "iteration", 0)
    iterators = []
    for name in ("train", "valid", "test"):
        spec = config.stream(name)
        if spec is None or (name != "train" and args.eval_iters <= 0) or (name == "train" and args.skip_train):
            iterators.append(None)
            continue
        documents = open_split(args, spec)
        loader = build_loader(args, documents, rank, name=name)
        if name == "train":
            if iteration > 0:
                resume_train(loader, args, documents, iteration)
            _train_loader = loader
        elif name == "valid" and args.eval_interval:
            # Megatron validated --eval-iters steps at every --eval-interval iteration before --load's
            # iteration: a resumed run continues the validation stream where those stopped
            fast_forward(loader, args, documents, evaluations_before(iteration, args) * args.eval_iters)
        iterators.append(iter(loader))
    return tuple(iterators)


def datasets_provider(base: Callable) -> Callable:
    """Wrap pretrain_gpt's ``train_valid_test_datasets_provider``: under HDP it returns the HDP
    iterators, which Megatron's ``--dataloader-type external`` passes through untouched (their
    errors end the rank in one line through the launcher, as bad data does here). Every
    rank builds its own (``is_distributed``): all TP ranks of one HDP rank read the same plan.
    With virtual pipeline stages Megatron asks once per model chunk (``vp_stage``); the HDP
    step reads the first chunk's iterator only, so the others get none."""

    @functools.wraps(base)
    def provider(train_val_test_num_samples, *args, **kwargs):
        hdp = _hdp_args()
        if hdp is None:
            return base(train_val_test_num_samples, *args, **kwargs)
        if kwargs.get("vp_stage") or (args and args[0]):
            return None, None, None
        try:  # bad data, a resume on another data stream, a loader that cannot start: one line
            train, valid, test = hdp_data_iterators(hdp)
        except ConfigError as exc:
            rank_guard.report(str(exc))
        except BytescaleError as exc:
            rank_guard.report(str(exc), status=1)
        return tuple(None if it is None else _one_line_errors(it) for it in (train, valid, test))

    provider.is_distributed = True
    return provider
