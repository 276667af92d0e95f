"""From a stream position to one step's plan, and from a plan to one rank's tensors.

Both loaders share this: :class:`StepPlanner` turns a :class:`~.sampler.Position` into a
:class:`StepPlan` (the step's samples and the planner's Plan over their lengths) and is a
pure function of (seed, document lengths, position) - every rank computes the same plan.
:func:`deliver` builds one rank's ``MicroBatchData`` list, reading only that rank's tokens.

The planning function is a parameter (``plan_fn(seq_lens) -> Plan``); the default is the
HDP planner, ``planner.planner.plan_step`` with a ``PlannerConfig`` and a ``CostModel``.
"""

from __future__ import annotations

import functools
import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..errors import PlanError
from ..planner.contract import Plan
from ..runtime.batch import MicroBatchData, build_micro_batch_data
from ..runtime.batch import StepBatch as RuntimeStepBatch
from .sampler import GlobalBatchSampler, Position, Sample

PlanFn = Callable[[Sequence[int]], Plan]
# (doc_id, start, end) -> token ids of that document's tokens [start, end)
DocReader = Callable[[int, int, int], np.ndarray]


def default_cost_model():
    """Analytic cost model of the tiny model on an H200 (override with a measured profile)."""
    from ..planner.cost_model import CostModel
    from ..planner.specs import HardwareSpec, ModelSpec

    return CostModel.analytic(ModelSpec.load("tiny"), HardwareSpec.load("h200"))


def default_plan_fn(planner_config, cost=None) -> PlanFn:
    """The HDP planner (``plan_step``) bound to ``planner_config`` and ``cost``."""
    from ..planner.planner import plan_step

    return functools.partial(plan_step, config=planner_config, cost=cost if cost is not None else default_cost_model())


@dataclass(frozen=True)
class StepPlan:
    step: int
    samples: tuple[Sample, ...]  # sequence id i of the plan is samples[i]
    plan: Plan
    start: Position  # where this step's samples begin in the stream
    end: Position  # where the next step's begin
    plan_s: float  # seconds the planning function took

    @property
    def tokens(self) -> int:
        return sum(s.length for s in self.samples)


@dataclass
class StepBatch(RuntimeStepBatch):
    """What one rank receives for one step: the runtime's ``StepBatch`` (plan, rank,
    micro_batches, step) plus where the data came from and what delivering it cost."""

    samples: tuple[Sample, ...] = ()  # sequence id i of the plan is samples[i]
    bytes_read: int = 0  # token bytes this rank read (or pulled) for the step
    plan_s: float = 0.0  # seconds the planning function took for this step
    plan_wait_s: float = 0.0  # exposed planning: seconds this rank waited for the step's plan
    delivery_s: float = 0.0  # wall time from asking for the step to holding its tensors
    next_position: Position | None = field(default=None, repr=False)

    def __iter__(self):
        return iter(self.micro_batches)


class StepPlanner:
    def __init__(self, sampler: GlobalBatchSampler, plan_fn: PlanFn, num_ranks: int | None = None):
        self.sampler = sampler
        self.plan_fn = plan_fn
        self.num_ranks = num_ranks

    def plan(self, step: int, position: Position) -> StepPlan:
        samples, end = self.sampler.batch(position)
        lens = [s.length for s in samples]
        t0 = time.perf_counter()
        plan = self.plan_fn(lens)
        return self.checked(step, samples, plan, position, end, time.perf_counter() - t0)

    def checked(self, step: int, samples, plan: Plan, position: Position, end: Position, plan_s: float) -> StepPlan:
        """The step's plan, once it is known to plan exactly these samples for these ranks
        (planned here, or ahead in a background process: ``plan_ahead.py``)."""
        lens = [s.length for s in samples]
        if tuple(plan.seq_lens) != tuple(lens):
            raise PlanError(
                f"step {step}: the planning function returned a plan for lengths {list(plan.seq_lens)[:8]}..., "
                f"asked for {lens[:8]}...; plan_fn must plan exactly the lengths it is given"
            )
        if self.num_ranks is not None and plan.num_ranks != self.num_ranks:
            raise PlanError(f"step {step}: plan has {plan.num_ranks} ranks, the loader serves {self.num_ranks}")
        # without the time the planner spent compiling its kernels (once per environment and machine)
        return StepPlan(step, samples, plan, position, end, plan_s - plan.meta.get("compile_s", 0.0))


def rank_token_ranges(step_plan: StepPlan, rank: int) -> list[tuple[int, int, int]]:
    """The (doc_id, start, stop) reads ``build_micro_batch_data`` will make for ``rank``:
    each planned range plus one label token past its end, inside the sample."""
    reads = []
    for mb in step_plan.plan.micro_batches(rank):
        for piece in mb.pieces:
            sample = step_plan.samples[piece.seq_id]
            for start, end in piece.ranges:
                stop = min(end + 1, piece.seq_len)
                reads.append((sample.doc_id, sample.start + start, sample.start + stop))
    return reads


def deliver(
    step_plan: StepPlan, rank: int, read: DocReader, label_mask: DocReader | None = None
) -> list[MicroBatchData]:
    """This rank's micro-batches, built from only its planned token ranges (``label_mask``: the
    documents' labels in the loss, where not every token's is: ``--sft``)."""
    samples = step_plan.samples

    def in_document(reader: DocReader):
        def read_piece(seq_id: int, start: int, stop: int) -> np.ndarray:
            s = samples[seq_id]
            return reader(s.doc_id, s.start + start, s.start + stop)

        return read_piece

    masks = None if label_mask is None else in_document(label_mask)
    return [build_micro_batch_data(mb, in_document(read), masks) for mb in step_plan.plan.micro_batches(rank)]


class SamplesDigest:
    """Order-independent hash of deliveries: (rank, step, micro-batch, sequence id, document,
    token ranges) plus the delivered token ids. Equal digests = identical training data."""

    def __init__(self):
        self._items: dict[tuple[int, int], str] = {}

    def add(self, batch: StepBatch) -> None:
        h = hashlib.sha256()
        for m, mbd in enumerate(batch.micro_batches):
            for piece in mbd.micro_batch.pieces:
                s = batch.samples[piece.seq_id]
                h.update(repr((batch.rank, batch.step, m, piece.seq_id, s.doc_id, s.start, piece.ranges)).encode())
            h.update(mbd.tokens.numpy().tobytes())
        self._items[(batch.step, batch.rank)] = h.hexdigest()

    def hexdigest(self) -> str:
        h = hashlib.sha256()
        for key in sorted(self._items):
            h.update(f"{key}:{self._items[key]};".encode())
        return h.hexdigest()

    def __len__(self) -> int:
        return len(self._items)
