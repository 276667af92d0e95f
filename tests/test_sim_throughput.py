"""Speedups as throughput: ratios of totals over the batches, not medians of per-batch ratios."""

import pytest

from megatron_bytescale.sim.throughput import means, totals


def _row(step, lb, cp=0.0, **more):
    return {"step_time_s": step, "lower_bound_s": lb, "critical_path_s": cp, **more}


def test_speedup_is_total_over_total_not_a_median_of_ratios():
    # a short batch where we win 4x and two long ones where we win 1.5x: the median of the
    # ratios says 1.5x, a training run over the three takes 10 + 60 + 60 = 130 s against
    # 2.5 + 40 + 40 = 82.5 s, 1.576x
    base = [_row(10, 1), _row(60, 30), _row(60, 30)]
    ours = [_row(2.5, 1), _row(40, 30, cp=35), _row(40, 30)]
    t = totals(ours, base)
    assert t["speedup"] == pytest.approx(130 / 82.5)
    assert t["speedup_per_batch_median"] == pytest.approx(1.5)
    assert t["x_lower_bound"] == pytest.approx(82.5 / 61)
    assert t["x_bound"] == pytest.approx(82.5 / (1 + 35 + 30))
    assert t["bound_x_lower_bound"] == pytest.approx((1 + 35 + 30) / 61)  # the floor no plan beats, in x LB
    assert t["mean_step_time_s"] == pytest.approx(27.5) and t["batches"] == 3


def test_totals_refuse_different_batches_and_none():
    with pytest.raises(ValueError, match="compare the same batches"):
        totals([_row(1, 1)], [_row(1, 1), _row(2, 1)])
    with pytest.raises(ValueError, match="no batches"):
        totals([])


def test_means_keep_peaks_as_maxima():
    m = means([_row(1, 1, host_bytes_max_gpu=5.0, busy_max_s=1.0), _row(3, 1, host_bytes_max_gpu=2.0, busy_max_s=3.0)])
    assert m["step_time_s"] == 2 and m["busy_max_s"] == 2 and m["host_bytes_max_gpu"] == 5.0
