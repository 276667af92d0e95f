"""Local data loading (the default, no Ray): every rank plans, each rank reads its own tokens.

Each training rank opens the indexed dataset, reads all document lengths from the index
(no token reads), and computes the step's plan itself - deterministic from (seed, stream
position), so all ranks agree without communicating. It then reads only the token ranges
its own micro-batches hold (plus one label token per range).

Usage on one rank::

    loader = LocalDataLoader("data/corpus", PlannerConfig(num_ranks=4, capacity=4096),
                             step_tokens=32768, context_length=16384, seed=1, rank=rank)
    for batch in loader:            # StepBatch: .plan, .micro_batches (list[MicroBatchData])
        ...
    ckpt["data"] = loader.state_dict()   # later: loader.load_state_dict(ckpt["data"])

For several ranks in one process (benchmarks, tests): ``loader.batch(rank)`` for each rank,
then ``loader.advance()``.

With ``plan_ahead=N`` (> 0) a background process plans the next N steps while training runs
(``plan_ahead.py``): the step's ``plan_wait_s`` is then only what planning was not hidden.
"""

from __future__ import annotations

import time
from pathlib import Path

from ..errors import ConfigError
from .documents import StreamDocuments
from .indexed import DocumentDataset
from .loader import StepLoader
from .plan_ahead import PlanAhead
from .planning import PlanFn, StepBatch, StepPlan, StepPlanner, default_plan_fn, deliver
from .sampler import GlobalBatchSampler, loader_state, restore_state


class LocalDataLoader(StepLoader):
    def __init__(
        self,
        data_path: str | Path,
        planner_config=None,
        *,
        step_tokens: int,
        context_length: int,
        seed: int = 0,
        rank: int | None = None,
        plan_fn: PlanFn | None = None,
        cost=None,
        vocab_size: int | None = None,
        plan_ahead: int = 0,
    ):
        if plan_fn is None and planner_config is None:
            raise ConfigError("give the loader a PlannerConfig (or a plan_fn) so it can plan steps")
        if isinstance(data_path, StreamDocuments):  # a split of blended, mock or SFT documents (documents.py)
            self.dataset = data_path
            self.sampler = data_path.sampler(step_tokens=step_tokens, context_length=context_length, seed=seed)
        else:
            self.dataset = DocumentDataset(data_path, vocab_size=vocab_size)
            self.sampler = GlobalBatchSampler(
                self.dataset.lengths, step_tokens=step_tokens, context_length=context_length, seed=seed
            )
        self._label_mask = self.dataset.label_mask if getattr(self.dataset, "has_label_mask", False) else None
        num_ranks = planner_config.num_ranks if planner_config is not None else None
        self.planner = StepPlanner(self.sampler, plan_fn or default_plan_fn(planner_config, cost), num_ranks)
        self.rank = rank
        self.step = 0
        self.position = self.sampler.start()
        self._current: StepPlan | None = None
        if plan_ahead < 0:
            raise ConfigError(f"plan_ahead must be >= 0 steps, got {plan_ahead}")
        self.plan_ahead = plan_ahead
        self._ahead: PlanAhead | None = None  # started at the first step, restarted where the position jumps
        self._wait_s = 0.0

    # ------------------------------------------------------------------ steps
    def step_plan(self) -> StepPlan:
        """The current step's plan (computed once, then cached until ``advance``)."""
        if self._current is None:
            t0 = time.perf_counter()
            if self.plan_ahead:
                if self._ahead is None:
                    say = (lambda line: print(line, flush=True)) if self.rank in (None, 0) else None
                    self._ahead = PlanAhead(
                        self.sampler, self.planner.plan_fn, self.step, self.position, self.plan_ahead, say=say
                    )
                samples, plan, end, plan_s = self._ahead.get(self.step, self.position)
                self._current = self.planner.checked(self.step, samples, plan, self.position, end, plan_s)
            else:
                self._current = self.planner.plan(self.step, self.position)
            self._wait_s = time.perf_counter() - t0
        return self._current

    def batch(self, rank: int | None = None) -> StepBatch:
        """``rank``'s micro-batches for the current step; does not advance."""
        rank = self._rank(rank)
        t0 = time.perf_counter()
        fresh = self._current is None
        sp = self.step_plan()
        before = self.dataset.bytes_read
        mbs = deliver(sp, rank, self.dataset.read, self._label_mask)
        return StepBatch(
            step=sp.step,
            rank=rank,
            plan=sp.plan,
            samples=sp.samples,
            micro_batches=mbs,
            bytes_read=self.dataset.bytes_read - before,
            plan_s=sp.plan_s if fresh else 0.0,
            plan_wait_s=self._wait_s if fresh else 0.0,
            delivery_s=time.perf_counter() - t0,
            next_position=sp.end,
        )

    def advance(self) -> None:
        sp = self.step_plan()
        self.step, self.position, self._current = sp.step + 1, sp.end, None

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """Position of the next step to deliver: save it with the checkpoint."""
        return loader_state(self.step, self.position, self.sampler.fingerprint())

    def load_state_dict(self, state: dict) -> None:
        step, position = restore_state(state, self.sampler.fingerprint(), self.sampler.position_type)
        self.sampler.check_position(position)
        self.step, self.position = step, position
        self._current = None
        self._stop_planning()  # its steps follow the old position

    def _stop_planning(self) -> None:
        if self._ahead is not None:
            self._ahead.close()
            self._ahead = None

    def close(self) -> None:
        self._stop_planning()
