"""The HDP step: this rank's micro-batches, forward and backward, then one gradient reduction.

One implementation serves Megatron-LM (``hdp_forward_backward`` has the signature of
Megatron's ``forward_backward_func``), the CPU demo, ``bytescale verify`` and the tests.
Each micro-batch goes through megatron-core's own ``forward_step`` / ``backward_step`` with the
micro-batch's layout active, so the user's ``forward_step_func`` and loss function are used
unchanged. The loss is a per-token sum; the gradient reduction divides by the step's global
token count (all-reduced over the HDP group, design 2.5), so gradients do not depend on how
tokens were assigned to ranks. A rank may run any number of micro-batches, zero included: it
still joins the gradient reduction.

With pipeline parallelism each HDP rank is a pipeline: its stages receive the same StepBatch
and run its micro-batches through 1F1B, or the plan's per-stage orders (``runtime.pipeline``), ring attention joining
the same
stage of the other pipelines (the HDP group of a stage). The loss and the token count come from
the last stage; ``finalize_model_grads`` takes the count to every stage and sums tied
embedding gradients between the first and last stage, as Megatron's does.

With virtual pipeline stages the model is Megatron's list of chunks (one DDP module each):
the forward of chunk ``c`` runs ``model[c]``, the loss comes from the last virtual stage, and
``finalize_model_grads`` takes the whole list, as in Megatron's interleaved schedule.
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
from ..planner.contract import BACKWARD, crossing_order_mismatch, plan_pipeline_deadlock
from .batch import StepBatch
from .context import active_micro_batch
from .grad_sync import ParamGather, StepGradSync
from .layout import MicroBatchLayout
from .padding import pad_micro_batch, sequence_parallel_multiple
from .pipeline import StageLink, gradient_group, run_one_f_one_b
from .ring_comm import P2PCounter


@dataclass
class StepStats:
    """What one rank measured in one step."""

    micro_batches: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    p2p_bytes: int = 0
    p2p_bytes_by_transport: dict[str, int] = field(default_factory=dict)  # what the rings carried: "kv", "latent"
    offloaded_bytes: int = 0
    peak_resident_activation_bytes: int = 0
    compute_s: float = 0.0  # forward+backward wall time of this rank's micro-batches
    p2p_wait_s: float = 0.0  # time spent waiting on ring transfers (communication not hidden)
    pipeline_bytes: int = 0  # activations and their gradients sent to the neighbouring stages
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


def check_step_agreement(step: StepBatch | None, group, pp_group=None, chunks: int = 1) -> None:
    """Every rank must hold a usable delivery of the same plan before any ring starts.

    Problems found on one rank (no delivery, data not matching the plan, another plan than
    its peers) would otherwise leave its ring peers waiting in P2P; one tiny all-gather of
    plan digests makes every rank raise the same clear error instead. With pipelines, the
    stages of one pipeline must also hold the same plan and HDP rank (a second all-gather over
    ``pp_group``), and the plan's order must be free of deadlock under 1F1B. ``chunks``: the
    model chunks per device (virtual pipeline stages), which the plan must be made for. Every
    rank joins both all-gathers before any raises, so none is left waiting in one.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    stages = dist.get_world_size(pp_group) if pp_group is not None else 1
    problem = None
    if step is None:
        problem = (
            "no plan was delivered to this rank for this step: the data loader must give every HDP rank its StepBatch"
        )
    elif step.plan.num_ranks != world:
        problem = (
            f"the plan was made for {step.plan.num_ranks} HDP ranks but the HDP group has {world}: "
            "plan for as many ranks as world size / (TP x PP)"
        )
    elif step.rank != rank:
        problem = f"HDP rank {rank} received the micro-batches of rank {step.rank}"
    elif step.plan.virtual_stages != chunks:
        problem = (
            f"the plan was made for {step.plan.virtual_stages} virtual pipeline stages per device but the model "
            f"has {chunks} chunks: plan with PlannerConfig.virtual_stages={chunks} (Megatron's "
            "virtual_pipeline_model_parallel_size)"
        )
    else:
        try:
            step.check()
            expert_problem = _expert_parallel_problem(step.plan, group)
            if expert_problem:
                raise PlanError(expert_problem)
            if stages > 1 or step.plan.stage_orders is not None or chunks > 1:
                stuck = plan_pipeline_deadlock(step.plan, stages)
                schedule = (
                    "its stage orders"
                    if step.plan.stage_orders is not None
                    else "the interleaved order"
                    if chunks > 1
                    else "1F1B"
                )
                if stuck:
                    raise PlanError(
                        f"this plan's micro-batch order deadlocks under {schedule} with {stages} stages ({stuck}); "
                        "plan with pipeline_stages set to the pipeline-parallel size"
                    )
                orders = step.plan.decoded_stage_orders()
                mismatch = (
                    crossing_order_mismatch(orders[rank], step.plan.virtual_stages) if orders is not None else None
                )
                if mismatch:
                    raise PlanError(
                        f"the plan's stage orders for HDP rank {rank} cannot run: {mismatch}; "
                        "activations cross between stages in posting order"
                    )
        except PlanError as exc:
            problem = str(exc)
    device = _collective_device(group)
    mine = torch.tensor([_MISSING if problem else plan_digest(step.plan)], dtype=torch.int64, device=device)
    everyone = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=group)
    digests = [int(t.item()) for t in everyone]
    verdict = None
    failed = [r for r, d in enumerate(digests) if d == _MISSING]
    if problem:
        verdict = f"HDP rank {rank}: {problem}"
    elif failed:
        verdict = f"HDP ranks {failed} could not run this step (see their errors); no rank ran it"
    elif len(set(digests)) != 1:
        by_plan: dict[int, list[int]] = {}
        for r, d in enumerate(digests):
            by_plan.setdefault(d, []).append(r)
        verdict = (
            "HDP ranks disagree about this step's plan (ranks grouped by plan: "
            f"{sorted(by_plan.values())}); every rank must plan the same global batch from the same seed"
        )
    if stages > 1:  # the verdict of every stage's HDP group, with its plan and HDP rank
        mine = torch.tensor([int(verdict is None), digests[rank], rank], dtype=torch.int64, device=device)
        per_stage = [torch.zeros_like(mine) for _ in range(stages)]
        dist.all_gather(per_stage, mine, group=pp_group)
        stage_views = [tuple(int(v) for v in t.tolist()) for t in per_stage]
        if verdict is None and not all(ok for ok, _, _ in stage_views):
            verdict = f"HDP rank {rank}: another stage of this pipeline could not run this step (see its errors)"
        elif verdict is None and len(set(stage_views)) != 1:
            verdict = (
                f"HDP rank {rank}: the stages of this pipeline hold different plans or HDP ranks "
                f"(ok, digest, HDP rank per stage: {stage_views}); every stage of a pipeline must get the same "
                "StepBatch"
            )
    if verdict is not None:
        raise PlanError(verdict)


def _expert_parallel_problem(plan, group) -> str | None:
    """Why this rank cannot run ``plan``'s slots with Megatron's expert-parallel groups, or None.

    The plan's EP groups are blocks of ``plan.expert_parallel`` consecutive HDP ranks
    (``planner.expert.slots``); Megatron's must be the same, else an all-to-all would pair a
    rank's slot k with another slot list than planned and hang."""
    from megatron.core import parallel_state

    ep = 1
    if parallel_state.model_parallel_is_initialized():
        ep = parallel_state.get_expert_model_parallel_world_size()
    if plan.expert_parallel != ep:
        return (
            f"the plan has expert-parallel slots for EP {plan.expert_parallel}, Megatron runs EP {ep}: "
            "plan with expert_parallel set to --expert-model-parallel-size"
        )
    if ep == 1:
        return None
    world = list(range(dist.get_world_size()))
    hdp = dist.get_process_group_ranks(group) if group is not None else world
    members = dist.get_process_group_ranks(parallel_state.get_expert_model_parallel_group())
    if not set(members) <= set(hdp):
        return (
            "Megatron's expert-parallel group leaves this rank's HDP group: "
            "use --expert-tensor-parallel-size equal to TP"
        )
    mine = sorted(hdp.index(r) for r in members)
    first = mine[0] - mine[0] % ep
    if mine != list(range(first, first + ep)):
        return f"Megatron's expert-parallel group is HDP ranks {mine}; HDP plans for blocks of {ep} consecutive ranks"
    return None


def _pipeline_group(pg_collection):
    """Megatron's pipeline group of this rank, or None without pipeline parallelism."""
    group = getattr(pg_collection, "pp", None) if pg_collection is not None else None
    if group is None:
        from megatron.core import parallel_state

        if not parallel_state.model_parallel_is_initialized():
            return None
        group = parallel_state.get_pipeline_model_parallel_group()
    return group if dist.get_world_size(group) > 1 else None


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
    None (nothing delivered): every rank then raises the same PlanError.

    With pipeline parallelism this rank is one stage of its pipeline: the pipeline's
    micro-batches run through 1F1B (``runtime.pipeline``), ring attention joins this stage of
    the other pipelines, and the loss (and the token count) comes from the last stage.
    ``model``: one module, or Megatron's list of model chunks (virtual pipeline stages)."""
    from megatron.core.pipeline_parallel.schedules import (
        backward_step,
        check_first_val_step,
        deallocate_output_tensor,
        forward_step,
    )
    from megatron.core.utils import get_model_type

    from ..megatron_era import backward_step_takes_model_type

    global _last_stats
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    virtual = len(chunks)
    rank = dist.get_rank(group)
    pp_group = _pipeline_group(pg_collection)
    check_step_agreement(step, group, pp_group, virtual)

    stats = StepStats()
    counter = P2PCounter()
    forward_data_store: list = []
    total_tokens = torch.zeros(
        [], dtype=torch.int, device=_collective_device(group)
    )  # finalize_model_grads all-reduces it
    # megatron-core 0.16 passes the model type to backward_step; 0.19 dropped the argument
    model_type = (get_model_type(chunks[0]),) if backward_step_takes_model_type() else ()
    count = len(step.micro_batches)
    grads = gradient_group(pp_group, _collective_device(None)) if pp_group is not None else None
    link = StageLink(pp_group, _collective_device(group), chunks=virtual, grad_group=grads)
    running: dict[
        int, list
    ] = {}  # micro-batch -> [start, forward_end, forward_wait_s, offload handles, backward_wait_s, chunks left]
    active: dict[tuple[int, int], tuple] = {}  # (micro-batch, chunk) -> (layout, positions), for its backward
    order = step.plan.stage_order(rank, link.stage)  # None: 1F1B (interleaved with chunks)
    last_backward = next((op[1] for op in reversed(order) if op[0] == BACKWARD), None) if order else None
    # one per model chunk (each its own DDP); with several, buckets launch after the last backward
    syncs = [
        StepGradSync(
            chunk,
            [d.micro_batch for d in step.micro_batches],
            forward_only,
            last_backward,
            step.plan.expert_parallel,
            reduce_in_backward=virtual == 1,
        )
        for chunk in chunks
    ]
    multiple = sequence_parallel_multiple(config)  # sequence parallelism: tokens padded to TP
    # --overlap-param-gather: every chunk's all-gathers dispatched here on every rank, waited for
    # by the forward pre-hooks and, for what they did not reach, after the last forward
    gathers = ParamGather(chunks)
    gathers.dispatch()

    def forward(i: int, c: int, input_tensor):
        nonlocal total_tokens
        data = step.micro_batches[i]
        mb = data.micro_batch
        layout = MicroBatchLayout.from_micro_batch(mb, rank)
        data, layout = pad_micro_batch(data, layout, multiple)
        offload = offloader.micro_batch(mb.offload_ratio) if offloader is not None else contextlib.nullcontext()
        start, wait0 = time.perf_counter(), counter.wait_s
        with (
            active_micro_batch(layout, data.positions, group, counter, step.plan.seq_lens),
            offload as handle,
        ):
            output_tensor, num_tokens = forward_step(
                forward_step_func,
                iter([data]),
                chunks[c],
                count,
                input_tensor,
                forward_data_store,
                config,
                1,  # cp_group_size: HDP keeps Megatron's CP at 1
                collect_non_loss_data,
                is_first_microbatch=check_first_val_step(first_val_step, forward_only, i == 0),
                current_microbatch=i,
                vp_stage=c if virtual > 1 else None,
                is_last_stage=link.is_last(c),
            )
        total_tokens += num_tokens
        entry = running.setdefault(i, [start, 0.0, 0.0, [], 0.0, virtual])
        entry[1] = time.perf_counter()
        entry[2] += counter.wait_s - wait0
        entry[3].append(handle)
        stats.compute_s += entry[1] - start
        if c == 0:
            stats.tokens += mb.tokens
        if forward_only:
            _chunk_done(i, None)
        else:
            active[i, c] = (layout, data.positions)
        return output_tensor

    def backward(i: int, c: int, input_tensor, output_tensor, output_grad):
        start, wait0 = time.perf_counter(), counter.wait_s
        layout, positions = active.pop((i, c))
        # Activation recompute re-runs layer forwards here, ring attention included: the layout
        # is active again (and its recomputed KV hops are counted), offloading not.
        with (
            active_micro_batch(layout, positions, group, counter, step.plan.seq_lens),
            syncs[c].backward(i),
        ):
            grad = backward_step(input_tensor, output_tensor, output_grad, *model_type, config)
        stats.compute_s += time.perf_counter() - start
        _chunk_done(i, counter.wait_s - wait0)
        return grad

    def _chunk_done(i: int, backward_wait_s):
        """One chunk of micro-batch ``i`` finished (its backward, or its forward when forward
        only); the last one records the micro-batch's timing."""
        entry = running[i]
        entry[4] += backward_wait_s or 0.0
        entry[5] -= 1
        if entry[5]:
            return
        start, forward_end, forward_wait, handles, backward_wait, _ = running.pop(i)
        end = time.perf_counter()
        ring = step.micro_batches[i].micro_batch.ring is not None
        stats.timings.append(MicroBatchTiming(start, forward_end, end, forward_wait, backward_wait, ring))
        for handle in handles:
            if handle is not None:
                off = handle.stats()
                stats.offloaded_bytes += off.offloaded_bytes
                stats.peak_resident_activation_bytes = max(
                    stats.peak_resident_activation_bytes, off.peak_resident_bytes
                )

    def release(output_tensor):
        deallocate_output_tensor(output_tensor, config.deallocate_pipeline_outputs)

    # All micro-batches run under no_sync: ranks run different numbers of them, so the one
    # gradient reduction happens in finalize_model_grads, identically on every rank; with
    # --overlap-grad-reduce a local last micro-batch reduces during its backward (grad_sync).
    with _no_sync(config):
        run_one_f_one_b(
            count,
            link,
            forward,
            backward,
            dtype=config.pipeline_dtype or config.params_dtype,
            device=_model_device(chunks[0]),
            forward_only=forward_only,
            release=release,
            order=order,
        )
    gathers.finish()
    stats.timings.sort(key=lambda t: t.start)
    stats.micro_batches = count
    stats.loss_tokens = int(total_tokens.item())
    stats.p2p_bytes = counter.bytes_sent
    stats.p2p_bytes_by_transport = dict(counter.by_transport)
    stats.p2p_wait_s = counter.wait_s
    stats.pipeline_bytes = link.bytes_sent

    if config.finalize_model_grads_func is not None and not forward_only:
        for sync in syncs:  # chunk by chunk, the same order on every rank
            sync.launch_rest()
        config.finalize_model_grads_func(
            chunks, total_tokens if config.calculate_per_token_loss else None, pg_collection=pg_collection
        )
    _last_stats = stats
    return forward_data_store, stats


def _no_sync(config):
    """Megatron's ``no_sync_func``: one context, or with model chunks one per chunk (all entered)."""
    funcs = config.no_sync_func
    if funcs is None:
        return contextlib.nullcontext()
    if not isinstance(funcs, (list, tuple)):
        return funcs()
    stack = contextlib.ExitStack()
    for func in funcs:
        stack.enter_context(func())
    return stack


def _model_device(model) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


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

    if isinstance(model, list) and len(model) == 1:
        model = model[0]
    if isinstance(data_iterator, list):  # one per model chunk with virtual stages: the first delivers
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
        config=get_model_config(model[0] if isinstance(model, list) else model),
        group=group,
        forward_only=forward_only,
        collect_non_loss_data=collect_non_loss_data,
        first_val_step=first_val_step,
        offloader=offloader,
        pg_collection=pg_collection,
    )
    return store
