"""The plan-ahead scheduler's logic, in-process (no Ray): lookahead, exact re-planning of
evicted steps, resets, and errors/timeouts instead of hangs."""

import time

import pytest

from megatron_bytescale.data.planning import StepPlanner
from megatron_bytescale.data.ray_loader import PlanScheduler
from megatron_bytescale.data.sampler import GlobalBatchSampler, Position
from megatron_bytescale.errors import ConfigError, PlanError

from data_support import simple_plan_fn

LENGTHS = [50, 300, 7, 1200, 90, 640, 33, 410, 5, 800] * 3
KW = dict(step_tokens=1600, context_length=800, seed=2, num_ranks=2, timeout_s=10)


def make(plan_fn=None, lookahead=3, retain=2, **kw):
    return PlanScheduler(
        lengths=LENGTHS, plan_fn=plan_fn or simple_plan_fn(2, 400), lookahead=lookahead, retain=retain, **{**KW, **kw}
    )


def wait_for(pred, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.01)
    return False


def key(sp):
    return (sp.step, sp.samples, sp.start, sp.end, sp.plan.to_dict()["ranks"])


def reference(steps):
    planner = StepPlanner(
        GlobalBatchSampler(LENGTHS, step_tokens=1600, context_length=800, seed=2), simple_plan_fn(2, 400)
    )
    out, pos = [], Position()
    for step in range(steps):
        sp = planner.plan(step, pos)
        out.append(key(sp))
        pos = sp.end
    return out


def test_plans_ahead_and_no_further():
    s = make(lookahead=3)
    assert wait_for(lambda: s.stats()["frontier"] == 3)
    time.sleep(0.2)
    assert s.stats()["frontier"] == 3  # waits for ranks to ask before planning more
    s.step_plan(4, 5)
    assert wait_for(lambda: s.stats()["frontier"] == 8)
    s.shutdown()


def test_steps_match_sequential_planning_and_evicted_steps_are_replanned_exactly():
    s = make(lookahead=2, retain=1)
    ref = reference(10)
    assert [key(s.step_plan(t, 5)) for t in range(10)] == ref
    assert 0 not in s.stats()["cached"]
    assert key(s.step_plan(0, 5)) == ref[0] and key(s.step_plan(3, 5)) == ref[3]
    s.shutdown()


def test_reset_continues_from_the_restored_position():
    ref = reference(8)
    s = make()
    sp = s.step_plan(4, 5)
    s.reset(4, sp.start.to_dict())  # same stream: a no-op
    assert key(s.step_plan(5, 5)) == ref[5]
    fresh = make()
    fresh.reset(4, sp.start.to_dict())
    assert [key(fresh.step_plan(t, 5)) for t in range(4, 8)] == ref[4:8]
    with pytest.raises(ConfigError, match="before the loader's restored position"):
        fresh.step_plan(2, 5)
    with pytest.raises(ConfigError, match="outside"):
        fresh.reset(0, {"epoch": 0, "index": 0, "offset": 10**6})
    s.shutdown()
    fresh.shutdown()


def _failing_plan(seq_lens):
    raise PlanError(f"cannot plan {len(seq_lens)} sequences (on purpose)")


def test_a_planning_error_reaches_the_waiting_rank():
    s = make(plan_fn=_failing_plan)
    with pytest.raises(PlanError, match="on purpose"):
        s.step_plan(0, 5)
    s.shutdown()


def _slow_plan(seq_lens):
    time.sleep(5)


def test_a_stuck_planner_is_a_timeout_not_a_hang():
    s = make(plan_fn=_slow_plan)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="did not plan step 0 within 0.3s"):
        s.step_plan(0, 0.3)
    assert time.monotonic() - t0 < 2
    s.shutdown()
