"""The HDP step: this rank's micro-batches, forward and backward, then one gradient reduction.

One implementation serves Megatron-LM (``hdp_forward_backward`` has the signature of
Megatron's ``forward_backward_func``), the CPU demo, ``bytescale verify`` and the tests.
Each micro-batch goes through megatron-core's own ``forward_step`` / ``backward_step`` with the
micro-batch's layout active, so the user's ``forward_step_func`` and loss function are used
unchanged. The loss is a per-token sum; the gradient reduction divides by the step's global
token count (all-reduced over the HDP group, design 2.5), so gradients do not depend on how
tokens were assigned to ranks. A rank may run any number of micro-batches, zero included: it
still joins the gradient reduction.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..errors import PlanError
from .batch import StepBatch
from .context import active_micro_batch
from .grad_sync import StepGradSync
from .layout import MicroBatchLayout
from .padding import pad_micro_batch, sequence_parallel_multiple
from .ring_comm import P2PCounter


@dataclass
class StepStats:
    """What one rank measured in one step."""

    micro_batches: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    p2p_bytes: int = 0
    offloaded_bytes: int = 0
    peak_resident_activation_bytes: int = 0
    compute_s: float = 0.0  # forward+backward wall time of this rank's micro-batches
    p2p_wait_s: float = 0.0  # time spent waiting on ring transfers (communication not hidden)
    timings: list[MicroBatchTiming] = field(default_factory=list)


@dataclass(frozen=True)
class MicroBatchTiming:
    """Wall-clock times (``time.perf_counter``) of one micro-batch on this rank."""

    start: float
    forward_end: float
    end: float
    forward_wait_s: float  # of the forward, seconds waiting on ring transfers
    backward_wait_s: float
    ring: bool


_last_stats: StepStats | None = None


def last_step_stats() -> StepStats | None:
    """Stats of the most recent step on this rank (for logging from Megatron's training loop)."""
    return _last_stats


_MISSING = -1  # digest sent by a rank that cannot run the step


def plan_digest(plan) -> int:
    """Hash of what the ranks execute (placement), not of ``meta``: ranks that plan for
    themselves (the local loader) record different planning times there."""
    placement = {k: v for k, v in plan.to_dict().items() if k != "meta"}
    text = json.dumps(placement, separators=(",", ":"), sort_keys=True)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "little")


def _collective_device(group) -> torch.device:
    """Where this group's collectives take their tensors: NCCL only moves CUDA tensors."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_step_agreement(step: StepBatch | None, group) -> None:
    """Every rank must hold a usable delivery of the same plan before any ring starts.

    Problems found on one rank (no delivery, data not matching the plan, another plan than
    its peers) would otherwise leave its ring peers waiting in P2P; one tiny all-gather of
    plan digests makes every rank raise the same clear error instead.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    problem = None
    if step is None:
        problem = "no plan was delivered to this rank for this step: the data loader must give every HDP rank its StepBatch"
    elif step.plan.num_ranks != world:
        problem = (
            f"the plan was made for {step.plan.num_ranks} HDP ranks but the HDP group has {world}: "
            "plan for as many ranks as world size / (TP x PP)"
        )
    elif step.rank != rank:
        problem = f"HDP rank {rank} received the micro-batches of rank {step.rank}"
    else:
        try:
            step.check()
        except PlanError as exc:
            problem = str(exc)
    mine = torch.tensor([_MISSING if problem else plan_digest(step.plan)], dtype=torch.int64, device=_collective_device(group))
    everyone = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=group)
    digests = [int(t.item()) for t in everyone]
    if problem:
        raise PlanError(f"HDP rank {rank}: {problem}")
    failed = [r for r, d in enumerate(digests) if d == _MISSING]
    if failed:
        raise PlanError(f"HDP ranks {failed} could not run this step (see their errors); no rank ran it")
    if len(set(digests)) != 1:
        by_plan: dict[int, list[int]] = {}
        for r, d in enumerate(digests):
            by_plan.setdefault(d, []).append(r)
        raise PlanError(
            "HDP ranks disagree about this step's plan (ranks grouped by plan: "
            f"{sorted(by_plan.values())}); every rank must plan the same global batch from the same seed"
        )


def run_hdp_step(
    step: StepBatch | None,
    *,
    forward_step_func,
    model,
    config,
    group=None,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    first_val_step=None,
    offloader=None,
    pg_collection=None,
) -> tuple[list, StepStats]:
    """Run one rank's share of a step; returns (forward_data_store, stats). ``step`` may be
    None (nothing delivered): every rank then raises the same PlanError."""
    from megatron.core.pipeline_parallel.schedules import backward_step, check_first_val_step, forward_step
    from megatron.core.utils import get_model_type

    global _last_stats
    rank = dist.get_rank(group)
    check_step_agreement(step, group)

    stats = StepStats()
    counter = P2PCounter()
    forward_data_store: list = []
    total_tokens = torch.zeros([], dtype=torch.int, device=_collective_device(group))  # finalize_model_grads all-reduces it
    model_type = get_model_type(model)
    no_sync = config.no_sync_func or contextlib.nullcontext
    count = len(step.micro_batches)
    # All micro-batches run under no_sync: ranks run different numbers of them, so the one
    # gradient reduction happens in finalize_model_grads, identically on every rank; with
    # --overlap-grad-reduce a local last micro-batch reduces during its backward (grad_sync).
    sync = StepGradSync(model, [d.micro_batch for d in step.micro_batches], forward_only)
    multiple = sequence_parallel_multiple(config)  # sequence parallelism: tokens padded to TP
    with no_sync():
        for i, data in enumerate(step.micro_batches):
            mb = data.micro_batch
            layout = MicroBatchLayout.from_micro_batch(mb, rank)
            data, layout = pad_micro_batch(data, layout, multiple)
            offload = offloader.micro_batch(mb.offload_ratio) if offloader is not None else contextlib.nullcontext()
            start, wait0 = time.perf_counter(), counter.wait_s
            with active_micro_batch(layout, data.positions, group=group, counter=counter), offload:
                output_tensor, num_tokens = forward_step(
                    forward_step_func,
                    iter([data]),
                    model,
                    count,
                    None,
                    forward_data_store,
                    config,
                    1,  # cp_group_size: HDP keeps Megatron's CP at 1
                    collect_non_loss_data,
                    is_first_microbatch=check_first_val_step(first_val_step, forward_only, i == 0),
                    current_microbatch=i,
                )
            forward_end, wait1 = time.perf_counter(), counter.wait_s
            if not forward_only:
                # Activation recompute re-runs layer forwards here, ring attention included: the
                # layout is active again (and its recomputed KV hops are counted), offloading not.
                with active_micro_batch(layout, data.positions, group=group, counter=counter), sync.backward(i):
                    backward_step(None, output_tensor, None, model_type, config)
            end = time.perf_counter()
            total_tokens += num_tokens
            stats.timings.append(MicroBatchTiming(start, forward_end, end, wait1 - wait0, counter.wait_s - wait1, mb.ring is not None))
            stats.compute_s += end - start
            stats.tokens += mb.tokens
            if offloader is not None:
                off = offloader.last_stats()
                stats.offloaded_bytes += off.offloaded_bytes
                stats.peak_resident_activation_bytes = max(stats.peak_resident_activation_bytes, off.peak_resident_bytes)
    stats.micro_batches = count
    stats.loss_tokens = int(total_tokens.item())
    stats.p2p_bytes = counter.bytes_sent
    stats.p2p_wait_s = counter.wait_s

    if config.finalize_model_grads_func is not None and not forward_only:
        sync.launch_rest()
        config.finalize_model_grads_func(
            [model], total_tokens if config.calculate_per_token_loss else None, pg_collection=pg_collection
        )
    _last_stats = stats
    return forward_data_store, stats


def hdp_forward_backward(
    *,
    forward_step_func,
    data_iterator,
    model,
    num_microbatches=None,  # unused: each rank runs the micro-batches its plan gives it
    seq_length=None,  # unused
    micro_batch_size=None,  # unused
    decoder_seq_length=None,  # unused
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    first_val_step=None,
    pg_collection=None,
    offloader=None,
    **unused,
):
    """Drop-in for Megatron's ``forward_backward_func`` under ``--hybrid-data-parallel``.

    ``data_iterator`` yields one ``StepBatch`` per step for this rank.
    """
    from megatron.core import parallel_state
    from megatron.core.utils import get_model_config

    if isinstance(model, list):
        if len(model) != 1:
            raise PlanError("HDP does not support virtual pipeline model chunks; drop --num-layers-per-virtual-pipeline-stage")
        model = model[0]
    if isinstance(data_iterator, list):
        data_iterator = data_iterator[0]
    group = getattr(pg_collection, "dp_cp", None) if pg_collection is not None else None
    if group is None:
        group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    try:
        step = next(data_iterator)
    except StopIteration:
        step = None
    store, _ = run_hdp_step(
        step,
        forward_step_func=forward_step_func,
        model=model,
        config=get_model_config(model),
        group=group,
        forward_only=forward_only,
        collect_non_loss_data=collect_non_loss_data,
        first_val_step=first_val_step,
        offloader=offloader,
        pg_collection=pg_collection,
    )
    return store
