"""The planner's predicted step time logged beside the measured one every --log-interval."""

import time
from types import SimpleNamespace

from megatron_bytescale.megatron.step_timing import StepTimer


def _steps(n, predicted=0.02):
    for k in range(n):
        plan = SimpleNamespace(
            meta={"est_time_max_s": predicted, "est_rank_time_s": [predicted / 2, predicted]}, seq_lens=[3000, 1000]
        )
        yield SimpleNamespace(plan=plan, rank=0, step=k, micro_batches=[], plan_wait_s=0.001 * k, plan_s=0.5)


def _forward_backward(*, data_iterator, forward_only=False, **_):
    batch = next(data_iterator[0] if isinstance(data_iterator, list) else data_iterator)
    time.sleep(0.04)  # "measured": twice the plan's 20 ms
    return [batch.step]


def test_logs_prediction_and_measurement_every_log_interval():
    lines = []
    timer = StepTimer(log=lines.append)
    it = _steps(6)
    out = [timer.run(_forward_backward, {"data_iterator": it}, log_interval=3, rank=0) for _ in range(6)]
    assert out == [[0], [1], [2], [3], [4], [5]]  # the step batches pass through untouched
    assert len(lines) == 2 and lines[0].startswith(
        "hdp step 2: planner predicted 0.020 s (busiest rank, this rank 0.010 s)"
    )
    measured = float(lines[0].split("measured ")[1].split(" s")[0])
    ratio = float(lines[0].split("(")[2].split("x the prediction")[0])
    assert 0.04 <= measured < 1.0 and abs(ratio - measured / 0.02) < 0.05  # both printed rounded
    assert "bytescale profile" in lines[0]
    # exposed planning: what the rank waited for this step's plan, beside what planning took
    assert lines[0].endswith("; planning exposed 0.002 s (planning took 0.500 s)")
    # throughput: the step's 4000 tokens over the iteration (start to start: one 40 ms step), 2 GPUs
    timer = StepTimer(log=lines.append)
    it = _steps(2)
    for _ in range(2):
        timer.run(_forward_backward, {"data_iterator": it}, log_interval=1, rank=0, gpus=2)
    assert "4000 tokens" in lines[-2] and "(forward-backward 0.0" in lines[-2]
    tps = float(lines[-1].split("4000 tokens, ")[1].split(" tokens/s per GPU")[0])
    iteration = float(lines[-1].split("(iteration ")[1].split(" s, 2 GPUs)")[0])
    assert iteration >= 0.04 and abs(tps - 4000 / iteration / 2) <= 0.06 * tps


def test_the_profiling_hint_only_where_the_prediction_is_far_off():
    def line(predicted, seconds):
        plan = SimpleNamespace(meta={"est_time_max_s": predicted})
        return StepTimer.line(SimpleNamespace(plan=plan, rank=0, step=1), seconds)

    assert "bytescale profile" not in line(0.2, 0.25)  # 1.25x: the cost model describes this machine
    assert "bytescale profile" not in line(0.2, 0.15)
    assert "(1.60x the prediction; far from 1: re-run `bytescale profile`" in line(0.2, 0.32)
    assert "(0.50x the prediction; far from 1" in line(0.2, 0.1)


def test_only_rank_zero_logs_and_evaluation_is_not_timed():
    lines = []
    timer = StepTimer(log=lines.append)
    it = _steps(4)
    for _ in range(2):
        timer.run(_forward_backward, {"data_iterator": [it]}, log_interval=1, rank=1)
    timer.run(_forward_backward, {"data_iterator": it, "forward_only": True}, log_interval=1, rank=0)
    assert lines == [] and timer.steps == 2
    timer.run(_forward_backward, {"data_iterator": [it]}, log_interval=1, rank=0)
    assert len(lines) == 1 and lines[0].startswith("hdp step 3:")
