"""Resuming an HDP checkpoint on another world size (TP and PP unchanged).

HDP has no fixed context-parallel mesh: the planner forms rings of any size over the HDP
ranks it is given, and an HDP step is exact against one rank on the same global batch. So a
run that wrote its checkpoint on N HDP ranks can continue on M, and the losses follow the
N-rank run's as long as every piece of state is global or resharded:

* model and distributed-optimizer state: Megatron's torch_dist checkpoints reshard both over
  the data-parallel group (the optimizer's default ``dp_reshardable`` sharding type allows
  "resharding only in the DP dimension", exactly this case; ``--ckpt-fully-parallel-save/-load``
  spread the writing and reading and keep that type). Other formats (the legacy ``torch``,
  whose resharding is not tested here) are refused on another world size, in one line;
* data position: the HDP loader's position is global (``pretrain_hooks.fast_forward`` replays
  the global batch sampler to ``--load``'s iteration), so the next global batch is the same;
* LR schedule and consumed samples: global (samples), with one condition Megatron sets: its
  micro-batch calculator needs ``--global-batch-size`` divisible by the data-parallel size
  (checked at launch, ``arguments.check_global_batch``);
* RNG: HDP checkpoints keep every HDP rank's RNG state (``every_hdp_rank_rng``). On another
  world size they are not loaded (as ``--no-load-rng``): the new plan puts different tokens on
  different ranks, so no assignment of the old per-rank streams would reproduce the N-rank
  run's dropout masks. With dropout off (hidden and attention) nothing random happens in a
  step and the resumed losses equal the uninterrupted run's; with dropout on the resumed run
  draws new masks from each rank's fresh seed-derived stream: a different, equally valid
  trajectory from the checkpoint on.

Each resume on another world size, and each restart by torchrun's elastic agent
(``TORCHELASTIC_RESTART_COUNT`` > 0), prints one line on rank 0: the world that wrote the
checkpoint, this world and the checkpoint's iteration (``resume_line``).

Megatron APIs used here (one place, for porting): ``megatron.training.get_args``,
``megatron.training.checkpointing._load_base_checkpoint(load_dir, args, rank0=True)`` (the
checkpoint's common state: ``args``, ``iteration``) and ``load_checkpoint`` (wrapped), and
``args.no_load_rng``.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import ConfigError

RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"  # set by torchrun's elastic agent in every worker


@dataclass(frozen=True)
class SavedWorld:
    """What the checkpoint in --load records about the world that wrote it."""

    iteration: int
    world_size: int
    hdp_size: int  # Megatron's data_parallel_size (DP x CP with CP = 1 under HDP)
    tp: int
    pp: int
    hdp: bool  # written under --hybrid-data-parallel


def saved_world(args, load_dir: str | None) -> SavedWorld | None:
    """The world of the checkpoint Megatron is about to load from ``load_dir`` (the tracker's
    iteration, or ``args.ckpt_step``: the one ``checkpoint_guard.verified_load`` chose, which
    wraps this load), or None when there is none. Reads only the common state (rank 0's part)."""
    tracker = os.path.join(load_dir or "", "latest_checkpointed_iteration.txt")
    if not load_dir or not (os.path.isfile(tracker) or getattr(args, "ckpt_step", None)):
        return None
    from megatron.training.checkpointing import _load_base_checkpoint

    state, _, release, _ = _load_base_checkpoint(load_dir, args, rank0=True)
    if state is None or release or "args" not in state:
        return None
    saved = state["args"]
    return SavedWorld(
        iteration=int(state.get("iteration", 0)),
        world_size=int(getattr(saved, "world_size", 0)),
        hdp_size=int(getattr(saved, "data_parallel_size", 0)),
        tp=int(getattr(saved, "tensor_model_parallel_size", 1)),
        pp=int(getattr(saved, "pipeline_model_parallel_size", 1)),
        hdp=bool(getattr(saved, "hybrid_data_parallel", False)),
    )


def check_resize(saved: SavedWorld, args) -> None:
    """Refuse, in one line naming the fix, a resume on another world that Megatron cannot reshard."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if (saved.tp, saved.pp) != (tp, pp):
        raise ConfigError(
            f"the checkpoint at iteration {saved.iteration} was written with TP {saved.tp} x PP {saved.pp}, this run "
            f"has TP {tp} x PP {pp}: an HDP resume on another world keeps TP and PP; set "
            f"--tensor-model-parallel-size {saved.tp} --pipeline-model-parallel-size {saved.pp}"
        )
    if args.ckpt_format != "torch_dist":
        raise ConfigError(
            f"--ckpt-format {args.ckpt_format}: a checkpoint written on {saved.hdp_size} HDP ranks resumes on "
            f"{args.data_parallel_size} only from torch_dist checkpoints (the format whose resharding is tested); "
            f"resume on {saved.hdp_size * tp * pp} ranks, or save with --ckpt-format torch_dist"
        )


def resume_line(saved: SavedWorld | None, args) -> str:
    """The one line a resize or an elastic restart prints (old world, new world, iteration)."""
    restart = int(os.environ.get(RESTART_COUNT, "0") or 0)
    head = f"elastic restart {restart}" if restart else "elastic resume"
    world, hdp = args.world_size, args.data_parallel_size
    if saved is None:
        return (
            f"{head}: world {world} ({hdp} HDP ranks), no checkpoint in --load {args.load}: "
            "training starts at iteration 0"
        )
    rng = (
        "RNG states restored per HDP rank"
        if saved.hdp_size == hdp
        else "RNG states not restored (the plan moves tokens between ranks: dropout masks differ from the old world's)"
    )
    return (
        f"{head}: world {saved.world_size} -> {world} (HDP ranks {saved.hdp_size} -> {hdp}, "
        f"TP {args.tensor_model_parallel_size}, PP {args.pipeline_model_parallel_size}), "
        f"resuming from checkpoint iteration {saved.iteration} in {args.load}; {rng}"
    )


def elastic_load(function: Callable, hdp_args: Callable) -> Callable:
    """Wrap Megatron's ``load_checkpoint``: under HDP (``hdp_args()`` gives Megatron's args, or
    None without HDP), a checkpoint from another world size is checked (``check_resize``),
    announced in one line and loaded without its RNG states."""
    if getattr(function, "_hdp_elastic", False):
        return function

    @functools.wraps(function)
    def call(*fargs, **kwargs):
        args = hdp_args()
        load_arg = kwargs.get("load_arg", fargs[3] if len(fargs) > 3 else "load")
        # --finetune loads the model alone (no optimizer, RNG or iteration), which Megatron's
        # distributed checkpoints reshard to any TP/PP/DP layout: nothing to check or announce
        if args is None or load_arg != "load" or getattr(args, "finetune", False):
            return function(*fargs, **kwargs)
        saved = saved_world(args, args.load)
        resized = saved is not None and saved.hdp_size != args.data_parallel_size
        if resized:
            try:
                check_resize(saved, args)
            except ConfigError as exc:
                if args.rank == 0:
                    print(f"error: {exc}", file=sys.stderr, flush=True)
                raise SystemExit(2) from None
        if (resized or os.environ.get(RESTART_COUNT, "0") not in ("", "0")) and args.rank == 0:
            print(resume_line(saved, args), flush=True)
        if not resized or args.no_load_rng:
            return function(*fargs, **kwargs)
        args.no_load_rng = True
        try:
            return function(*fargs, **kwargs)
        finally:
            args.no_load_rng = False

    call._hdp_elastic = True
    return call


def install_elastic_resume(hdp_args: Callable) -> None:
    """``elastic_load`` around Megatron's ``load_checkpoint`` (idempotent; training.py imports it
    by name, so both modules get the wrapper)."""
    import megatron.training.training as training

    try:
        import megatron.training.checkpointing as checkpointing
    except ModuleNotFoundError:  # a stand-in training package without checkpoints
        return
    for module in (checkpointing, training):
        module.load_checkpoint = elastic_load(module.load_checkpoint, hdp_args)
