"""The planner's predicted step time next to the measured one, every ``--log-interval``.

The plan of every step carries the cost model's estimate (``Plan.meta["est_time_max_s"]``:
the busiest rank's forward+backward, ring waits and pipeline fill included). Training
measures the same span: the HDP forward-backward call of Megatron's train step (micro-batches
plus the gradient reduction at its end). The line counts iterations as Megatron's own log does
(from 1). A ratio far from 1 after the warm-up steps, with a cost model that was not measured on
this kind of device (the analytic GPU model, or a profile from other hardware), says to run
``bytescale profile`` here and pass ``--hdp-profile``; a profile measured on this kind of device
gets no such hint (a shared machine's load moves single steps, and re-profiling cannot fix that).

The line also reports the step's tokens and its throughput in tokens per second per GPU
(all GPUs of the run: HDP x TP x PP), over the iteration: from this step's start to the
previous step's start, optimizer step and logging included, so that runs of different
strategies on the same batches (``--mock-data``) compare; over the forward-backward alone where
no earlier step was timed.

The same line reports the step's exposed planning: the seconds this rank waited for the
step's plan (near zero when the loader plans ahead in its background process and planning is
shorter than a step), beside the seconds planning took, and the bytes this rank's rings sent
in the step, per ring transport (K/V rings, and multi-latent attention's latent rings).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any

FAR = 1.5  # a measured step this many times off the prediction (either way) gets the profiling hint
WARM_UP = 2  # timed steps that never get the hint: the first ones start processes and fill caches


def measured_elsewhere(profile: str | None, hardware: str | None, device: str) -> bool:
    """Whether the cost model in use was not measured on ``device`` ("cpu" or "cuda"): the
    analytic model of a GPU spec (never measured), or a profile whose notes name another device
    (or none). ``hardware`` "cpu" is the shipped CPU profile."""
    if profile is None:
        return not (hardware == "cpu" and device == "cpu")
    import yaml

    try:
        with open(profile) as f:
            notes = (yaml.safe_load(f) or {}).get("notes") or {}
    except (OSError, yaml.YAMLError, AttributeError):
        return True
    return str(notes.get("device", "")).split(":")[0] != device


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

    def __init__(self, log: Callable[[str], None] = print, measured_elsewhere: bool = True):
        self.log = log
        self.steps = 0
        self._last_start: float | None = None
        self.measured_elsewhere = measured_elsewhere  # the profiling hint applies at all

    def run(
        self, forward_backward: Callable[..., Any], kwargs: dict, log_interval: int | None, rank: int, gpus: int = 1
    ) -> Any:
        """``forward_backward(**kwargs)``, timed; every ``log_interval`` training steps rank 0
        logs the plan's estimate next to the measured seconds, and the step's tokens per second
        per GPU (``gpus``: every GPU of the run)."""
        if kwargs.get("forward_only") or not log_interval:
            return forward_backward(**kwargs)
        iterator = kwargs.get("data_iterator")
        seen = _Remember(iterator[0] if isinstance(iterator, list) else iterator)
        kwargs = {**kwargs, "data_iterator": [seen] if isinstance(iterator, list) else seen}
        start = time.perf_counter()
        iteration = None if self._last_start is None else start - self._last_start
        self._last_start = start
        result = forward_backward(**kwargs)
        seconds = time.perf_counter() - start
        self.steps += 1
        if rank == 0 and self.steps % log_interval == 0 and seen.last is not None:
            from ..runtime.step import last_step_stats

            stats = last_step_stats()
            hint = self.measured_elsewhere and self.steps > WARM_UP
            ring_bytes = stats.p2p_bytes_by_transport if stats else None
            line = self.line(seen.last, seconds, iteration, gpus, hint, ring_bytes=ring_bytes)
            if line:
                self.log(line)
        return result

    @staticmethod
    def throughput(step_batch, seconds: float, iteration: float | None, gpus: int) -> str:
        """The step's tokens and tokens per second per GPU (over the iteration where known)."""
        lens = getattr(getattr(step_batch, "plan", None), "seq_lens", None)
        if not lens:
            return ""
        tokens = int(sum(lens))
        span, what = (iteration, "iteration") if iteration else (seconds, "forward-backward")
        return (
            f"; {tokens} tokens, {tokens / span / max(1, gpus):.1f} tokens/s per GPU ({what} {span:.3f} s, {gpus} GPUs)"
        )

    @staticmethod
    def line(
        step_batch,
        seconds: float,
        iteration_s: float | None = None,
        gpus: int = 1,
        hint: bool = True,
        *,
        ring_bytes: dict[str, int] | None = None,
    ) -> str:
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
        advice = (
            "; far from 1: run `bytescale profile` on this hardware and pass --hdp-profile"
            if hint and not 1 / FAR <= ratio <= FAR
            else ""
        )
        from ..runtime.step import last_step_stats

        sizes = plan.ring_sizes().values() if hasattr(plan, "ring_sizes") else ()
        rings = " ".join(f"{n}x{size}" for size, n in sorted(Counter(sizes).items()))
        stats = last_step_stats()
        sent = f"; this rank sent {stats.p2p_bytes / 1e6:.1f} MB P2P" if stats is not None else ""
        shape = f"; ranks/seq [{rings}]{sent}" if rings else sent
        by_transport = (
            "; ring bytes sent here: " + ", ".join(f"{name} {sent:,}" for name, sent in sorted(ring_bytes.items()))
            if ring_bytes
            else ""
        )
        step = getattr(step_batch, "step", None)
        iteration = "?" if step is None else step + 1  # Megatron counts iterations from 1
        return (
            f"hdp iteration {iteration}: planner predicted {predicted:.3f} s (busiest rank{mine}), "
            f"measured {seconds:.3f} s forward-backward here ({ratio:.2f}x the prediction{advice})"
            f"{StepTimer.throughput(step_batch, seconds, iteration_s, gpus)}{planning}{shape}{by_transport}"
        )
