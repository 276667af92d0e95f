"""The planner's predicted step time logged beside the measured one every --log-interval."""

import json
import time
from types import SimpleNamespace

from megatron_bytescale.megatron.step_timing import StepTimer, measured_elsewhere


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


def test_logs_prediction_and_measurement_every_log_interval(monkeypatch):
    from megatron_bytescale.runtime import step

    monkeypatch.setattr(step, "_last_stats", None)  # no HDP step ran here: no P2P count on the line
    lines = []
    timer = StepTimer(log=lines.append)
    it = _steps(6)
    out = [timer.run(_forward_backward, {"data_iterator": it}, log_interval=3, rank=0) for _ in range(6)]
    assert out == [[0], [1], [2], [3], [4], [5]]  # the step batches pass through untouched
    assert len(lines) == 2 and lines[0].startswith(  # loader step 2 is Megatron's iteration 3
        "hdp iteration 3: planner predicted 0.020 s (busiest rank, this rank 0.010 s)"
    )
    measured = float(lines[0].split("measured ")[1].split(" s")[0])
    ratio = float(lines[0].split("(")[2].split("x the prediction")[0])
    assert 0.04 <= measured < 1.0 and abs(ratio - measured / 0.02) < 0.05  # both printed rounded
    assert "bytescale profile" in lines[0]  # the third timed step: past the warm-up
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
    assert "(1.60x the prediction; far from 1: run `bytescale profile`" in line(0.2, 0.32)
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
    assert len(lines) == 1 and lines[0].startswith("hdp iteration 4:")


def test_no_profiling_hint_in_warm_up_or_with_a_profile_of_this_hardware():
    def lines_of(timer):
        out = []
        timer.log = out.append
        it = _steps(4)
        for _ in range(4):
            timer.run(_forward_backward, {"data_iterator": it}, log_interval=1, rank=0)
        return ["bytescale profile" in line for line in out]

    assert lines_of(StepTimer()) == [False, False, True, True]  # 2x off: hinted after the warm-up steps
    assert lines_of(StepTimer(measured_elsewhere=False)) == [False] * 4


def test_the_cost_model_is_measured_elsewhere_unless_its_profile_names_this_device(tmp_path):
    assert not measured_elsewhere(None, "cpu", "cpu")  # the shipped CPU profile on a CPU run
    assert measured_elsewhere(None, "cpu", "cuda")
    assert measured_elsewhere(None, "h100", "cuda")  # the analytic model: measured nowhere
    assert measured_elsewhere(None, "h100", "cpu")
    for device, here, elsewhere in (("cpu", "cpu", False), ("cuda", "cpu", True), ("cuda", "cuda", False)):
        path = tmp_path / f"{device}.json"
        path.write_text(json.dumps({"a1": 1.0, "notes": {"device": device}}))
        assert measured_elsewhere(str(path), None, here) is elsewhere
    (tmp_path / "bare.json").write_text("{}")
    assert measured_elsewhere(str(tmp_path / "bare.json"), None, "cpu")  # no notes: not known to be here


def test_the_step_line_names_the_rings_and_this_ranks_p2p_bytes(monkeypatch):
    from megatron_bytescale.runtime import step

    monkeypatch.setattr(step, "_last_stats", step.StepStats(p2p_bytes=15_200_000))
    plan = SimpleNamespace(meta={"est_time_max_s": 0.2}, ring_sizes=lambda: {0: 2, 1: 2, 2: 1, 3: 4})
    line = StepTimer.line(SimpleNamespace(plan=plan, rank=0, step=0), 0.21)
    assert line.startswith("hdp iteration 1: ") and line.endswith(
        "; ranks/seq [1x1 2x2 1x4]; this rank sent 15.2 MB P2P"
    )


def test_the_megatron_demo_summary_reads_the_iteration_and_step_lines(tmp_path):
    from megatron_bytescale.megatron.cpu_pretrain import summary

    lines = [
        "------------------------ arguments ------------------------\n",
        " [2026-01-01 00:00:00] iteration        1/       3 | consumed samples: 4 | elapsed time per iteration "
        "(ms): 9000.0 | learning rate: 3.0E-03 | lm loss: 6.267500E+00 | loss scale: 1.0 |\n",
        "hdp iteration 1: planner predicted 1.000 s ...; ranks/seq [2x4]; this rank sent 15.2 MB P2P\n",
        " [2026-01-01 00:00:02] iteration        2/       3 | consumed samples: 8 | elapsed time per iteration "
        "(ms): 2000.0 | learning rate: 3.0E-03 | lm loss: 5.100000E+00 | loss scale: 1.0 |\n",
        "hdp iteration 2: planner predicted 1.000 s ...; ranks/seq [2x4]; this rank sent 15.4 MB P2P\n",
        " [2026-01-01 00:00:04] iteration        3/       3 | consumed samples: 12 | elapsed time per iteration "
        "(ms): 3000.0 | learning rate: 3.0E-03 | lm loss: 4.000000E+00 | loss scale: 1.0 |\n",
        "hdp iteration 3: planner predicted 1.000 s ...; ranks/seq [1x2 2x4]; this rank sent 16.0 MB P2P\n",
    ]
    text = summary(lines, tmp_path / "megatron_lm.log")
    assert "6.2675 (iteration 1) -> 4.0000 (iteration 3)" in text
    assert "2.50 s mean (iterations 2-3)" in text  # the first iteration is warm-up
    assert "[2x4] in 2 of 3 logged iterations" in text and "15.4 MB per iteration (median)" in text
    assert str(tmp_path / "megatron_lm.log") in text
