"""The local loader planning ahead in a background process: the same plans as planning in
the training process, in order, a late plan waited for (never skipped or planned twice),
exposed planning near zero when training outlasts planning, and no orphan process."""

import functools
import time

import pytest

from megatron_bytescale.data.local_loader import LocalDataLoader
from megatron_bytescale.data.planning import SamplesDigest, default_plan_fn
from megatron_bytescale.errors import PlanError
from megatron_bytescale.planner.planner import PlannerConfig
from megatron_bytescale.runtime.step import plan_digest

from data_support import SlowOnCall, build_corpus

RANKS, CAPACITY = 4, 2048
SETTINGS = dict(step_tokens=3 * RANKS * CAPACITY, context_length=RANKS * CAPACITY, seed=11)
CONFIG = PlannerConfig(num_ranks=RANKS, capacity=CAPACITY)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return build_corpus(tmp_path_factory.mktemp("corpus"))


def _steps(loader, n, rank, train_s=0.0):
    out = []
    try:
        for _ in range(n):
            batch = loader.next_step(rank)
            out.append(batch)
            time.sleep(train_s)  # the training step the next plans hide behind
    finally:
        loader.close()
    return out


def _digest(batches):
    d = SamplesDigest()
    for b in batches:
        d.add(b)
    return d.hexdigest()


def test_plans_ahead_are_the_plans_in_process_on_every_rank(corpus):
    steps = 3
    inline = [_steps(LocalDataLoader(corpus, CONFIG, rank=r, **SETTINGS), steps, r) for r in (0, 3)]
    ahead = [
        _steps(LocalDataLoader(corpus, CONFIG, rank=r, plan_ahead=2, **SETTINGS), steps, r, train_s=0.05)
        for r in (0, 3)
    ]
    for a, b in zip(inline, ahead):
        assert [x.step for x in b] == list(range(steps))
        assert [plan_digest(x.plan) for x in a] == [plan_digest(x.plan) for x in b]
        assert _digest(a) == _digest(b)  # the same samples, ranges and tokens delivered
    # every rank plans the same plan for each step
    assert [plan_digest(x.plan) for x in ahead[0]] == [plan_digest(x.plan) for x in ahead[1]]


def test_a_plan_slower_than_the_previous_training_step_is_waited_for(corpus):
    # step 2's plan takes 2 s, the training steps 0.3 s: the loader waits at step 2 (about
    # 1.4 s: its planning began when step 0 was taken) and delivers steps 0..4 once each, in
    # order, with the plans planning in the training process gives
    slow = SlowOnCall(default_plan_fn(CONFIG), call=2, seconds=2.0)
    batches = _steps(LocalDataLoader(corpus, CONFIG, rank=1, plan_ahead=2, plan_fn=slow, **SETTINGS), 5, 1, train_s=0.3)
    assert [b.step for b in batches] == list(range(5))
    waits = [b.plan_wait_s for b in batches]
    assert waits[2] > 1.0, waits  # waited for the slow plan, not skipped past it
    assert max(waits[3:]) < 0.5 and waits[1] < 0.5, waits  # planned while the steps before trained
    inline = _steps(LocalDataLoader(corpus, CONFIG, rank=1, **SETTINGS), 5, 1)
    assert [plan_digest(b.plan) for b in batches] == [plan_digest(b.plan) for b in inline]
    assert batches[2].plan_s > 1.9  # the planning time itself, measured in the planning process


def test_resume_restarts_planning_at_the_new_position(corpus):
    loader = LocalDataLoader(corpus, CONFIG, rank=0, plan_ahead=2, **SETTINGS)
    first = _steps(loader, 2, 0)
    state = LocalDataLoader(corpus, CONFIG, rank=0, **SETTINGS)
    state.next_step()
    resumed = LocalDataLoader(corpus, CONFIG, rank=0, plan_ahead=3, **SETTINGS)
    resumed.load_state_dict(state.state_dict())
    again = _steps(resumed, 1, 0)
    assert again[0].step == 1 and plan_digest(again[0].plan) == plan_digest(first[1].plan)


def test_close_ends_the_planning_process_and_errors_surface_at_their_step(corpus):
    loader = LocalDataLoader(corpus, CONFIG, rank=0, plan_ahead=2, **SETTINGS)
    loader.next_step()
    proc = loader._ahead._proc
    loader.close()
    assert proc.poll() is not None  # no orphan
    with pytest.raises(PlanError, match="picklable planning function"):
        LocalDataLoader(corpus, CONFIG, rank=0, plan_ahead=1, plan_fn=lambda lens: None, **SETTINGS).next_step()
    bad = LocalDataLoader(corpus, CONFIG, rank=0, plan_ahead=1, plan_fn=functools.partial(_wrong_plan), **SETTINGS)
    with pytest.raises(PlanError, match="plan_fn must plan exactly the lengths"):
        bad.next_step()
    bad.close()


def _wrong_plan(seq_lens):
    return default_plan_fn(CONFIG)(list(seq_lens)[:-1] or [1])


@pytest.mark.parametrize("sig", ["SIGSTOP", "SIGKILL"])
def test_a_stopped_or_dead_planning_process_is_named_within_seconds(corpus, monkeypatch, sig):
    import os
    import signal

    from megatron_bytescale.data import plan_ahead

    monkeypatch.setattr(plan_ahead, "HEARTBEAT_TIMEOUT_S", 2.0)
    loader = LocalDataLoader(corpus, CONFIG, rank=0, plan_ahead=1, **SETTINGS)
    try:
        loader.next_step()
        child = loader._ahead._proc.pid
        os.kill(child, getattr(signal, sig))
        t0 = time.monotonic()
        with pytest.raises(PlanError) as error:
            for _ in range(3):  # step 1 may have been planned before the signal
                loader.next_step()
        waited = time.monotonic() - t0
    finally:
        loader.close()
    said = str(error.value)
    print(f"{sig}: {waited:.1f} s: {said}")
    assert said.startswith(f"the planning process (pid {child}, data/plan_ahead.py) ")
    if sig == "SIGSTOP":
        assert "has been silent for" in said and "stopped (SIGSTOP" in said
        assert waited < 2.0 + 10, waited  # the deadline, plus a loaded machine's slack
    else:
        assert "was killed by SIGKILL before step" in said
        assert waited < 10, waited
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)  # close() ended (and reaped) even the stopped one


def test_a_killed_training_process_leaves_no_planning_process(corpus, tmp_path):
    # the kernel kills a child when the training process dies (PR_SET_PDEATHSIG), also a stopped
    # child, which no thread of its own could end; a running one also reads end of stream
    import os
    import signal
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(  # PlanAhead as the loader drives it, without importing torch (a quick start)
        "import functools, time\n"
        "from megatron_bytescale.data.indexed import DocumentDataset\n"
        "from megatron_bytescale.data.plan_ahead import PlanAhead\n"
        "from megatron_bytescale.data.sampler import GlobalBatchSampler, Position\n"
        "from megatron_bytescale.planner.cost_model import CostModel\n"
        "from megatron_bytescale.planner.planner import PlannerConfig, plan_step\n"
        "from megatron_bytescale.planner.specs import HardwareSpec, ModelSpec\n"
        f"sampler = GlobalBatchSampler(DocumentDataset({corpus!r}).lengths, step_tokens={SETTINGS['step_tokens']}, "
        f"context_length={SETTINGS['context_length']}, seed=11)\n"
        "cost = CostModel.analytic(ModelSpec.load('tiny'), HardwareSpec.load('h200'))\n"
        f"plan_fn = functools.partial(plan_step, config=PlannerConfig(num_ranks={RANKS}, capacity={CAPACITY}), "
        "cost=cost)\n"
        "running, stopped = (PlanAhead(sampler, plan_fn, 0, Position(), 2) for _ in range(2))\n"
        "for ahead in (running, stopped):\n"
        "    ahead.get(0, Position())\n"
        "print(running._proc.pid, stopped._proc.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        children = [int(pid) for pid in proc.stdout.readline().split()]
        os.kill(children[1], signal.SIGSTOP)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.time() + 20
        left = children
        while left and time.time() < deadline:
            left = [c for c in left if _running(c)]
            time.sleep(0.1)
        assert not left, f"planning processes {left} (running, stopped) outlived the killed training process"
    finally:
        if proc.poll() is None:
            proc.kill()


def _running(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return open(f"/proc/{pid}/stat").read().split()[2] != "Z"  # a zombie has exited, not yet reaped by init
