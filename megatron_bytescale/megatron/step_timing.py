"""The planner's predicted step time next to the measured one, every ``--log-interval``.

The plan of every step carries the cost model's estimate (``Plan.meta["est_time_max_s"]``:
the busiest rank's forward+backward, ring waits and pipeline fill included). Training
measures the same span: the HDP forward-backward call of Megatron's train step (micro-batches
plus the gradient reduction at its end). A ratio far from 1 means the cost model does not
describe this hardware: re-run ``bytescale profile`` and pass ``--hdp-profile``.

The same line reports the step's exposed planning: the seconds this rank waited for the
step's plan (near zero when the loader plans ahead in its background process and planning is
shorter than a step), beside the seconds planning took, and the bytes this rank's rings sent
in the step, per ring transport (K/V rings, and multi-latent attention's latent rings).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

FAR = 1.5  # a measured step this many times off the prediction (either way) gets the profiling hint


class _Remember:
    """Iterator wrapper that keeps the last item it handed out (the step's ``StepBatch``)."""

    def __init__(self, source):
        self.source = source
        self.last = None

    def __iter__(self):
        return self

    def __next__(self):
        self.last = next(self.source)
        return self.last


class StepTimer:
    """Times HDP forward-backward calls and logs prediction against measurement."""

    def __init__(self, log: Callable[[str], None] = print):
        self.log = log
        self.steps = 0

    def run(self, forward_backward: Callable[..., Any], kwargs: dict, log_interval: int | None, rank: int) -> Any:
        """``forward_backward(**kwargs)``, timed; every ``log_interval`` training steps rank 0
        logs the plan's estimate next to the measured seconds."""
        if kwargs.get("forward_only") or not log_interval:
            return forward_backward(**kwargs)
        iterator = kwargs.get("data_iterator")
        seen = _Remember(iterator[0] if isinstance(iterator, list) else iterator)
        kwargs = {**kwargs, "data_iterator": [seen] if isinstance(iterator, list) else seen}
        start = time.perf_counter()
        result = forward_backward(**kwargs)
        seconds = time.perf_counter() - start
        self.steps += 1
        if rank == 0 and self.steps % log_interval == 0 and seen.last is not None:
            from ..runtime.step import last_step_stats

            stats = last_step_stats()
            line = self.line(seen.last, seconds, ring_bytes=stats.p2p_bytes_by_transport if stats else None)
            if line:
                self.log(line)
        return result

    @staticmethod
    def line(step_batch, seconds: float, *, ring_bytes: dict[str, int] | None = None) -> str:
        plan = getattr(step_batch, "plan", None)
        meta = getattr(plan, "meta", None) or {}
        predicted = meta.get("est_time_max_s")
        if not predicted:
            return ""
        own = (meta.get("est_rank_time_s") or [None] * (step_batch.rank + 1))[step_batch.rank]
        mine = f", this rank {own:.3f} s" if own is not None else ""
        wait = getattr(step_batch, "plan_wait_s", None)
        planning = (
            f"; planning exposed {wait:.3f} s (planning took {getattr(step_batch, 'plan_s', 0.0):.3f} s)"
            if wait is not None
            else ""
        )
        ratio = seconds / predicted
        hint = (
            "; far from 1: re-run `bytescale profile` on these GPUs and pass --hdp-profile"
            if not 1 / FAR <= ratio <= FAR
            else ""
        )
        rings = (
            "; ring bytes sent here: " + ", ".join(f"{name} {sent:,}" for name, sent in sorted(ring_bytes.items()))
            if ring_bytes
            else ""
        )
        return (
            f"hdp step {getattr(step_batch, 'step', '?')}: planner predicted {predicted:.3f} s (busiest rank{mine}), "
            f"measured {seconds:.3f} s forward-backward here ({ratio:.2f}x the prediction{hint}){planning}{rings}"
        )
