"""Throughput over a run of batches, as a training run measures it.

A speedup is the baseline's total time over ours on the same batches, and "x lower bound"
is our total time over the sum of the batches' bounds: ratios of totals, not medians of
per-batch ratios. Batches differ (one may hold a 2M-token sequence, the next none), and a
median of ratios weights a 5 s batch like a 30 s one, which no training run does.
"""

from __future__ import annotations

import statistics

# metrics of one batch that hold a peak (a budget), not a time: summarised by their maximum
PEAKS = ("host_bytes_max_gpu", "chunks_in_flight_max", "microbatches_max", "p2p_bytes_max_gpu")


def bound_s(row: dict) -> float:
    """No plan beats max(all FLOPs spread over all GPUs, the longest sequence alone)."""
    return max(row["lower_bound_s"], row["critical_path_s"])


def totals(rows: list[dict], baseline: list[dict] | None = None) -> dict:
    """Totals and ratios of totals over ``rows`` (one metrics dict per batch, ``step_time_s``,
    ``lower_bound_s`` and ``critical_path_s`` at least); with ``baseline`` (the same batches
    under another strategy) the speedup, its total over ours, and beside it the median of the
    per-batch ratios (labelled as such wherever shown)."""
    if not rows:
        raise ValueError("totals of no batches")
    steps = sum(r["step_time_s"] for r in rows)
    lb = sum(r["lower_bound_s"] for r in rows)
    bound = sum(bound_s(r) for r in rows)
    out = {
        "batches": len(rows),
        "total_step_time_s": steps,
        "total_lower_bound_s": lb,
        "total_bound_s": bound,
        "mean_step_time_s": steps / len(rows),
        "x_lower_bound": steps / lb,
        "x_bound": steps / bound,
        # the x lower bound no plan can get under on these batches (in this cost model): where it
        # exceeds a goal stated in x LB, the goal is out of reach and this is the arithmetic
        "bound_x_lower_bound": bound / lb,
        "x_lower_bound_per_batch_median": statistics.median(r["step_time_s"] / r["lower_bound_s"] for r in rows),
    }
    if baseline is not None:
        if len(baseline) != len(rows):
            raise ValueError(f"baseline has {len(baseline)} batches, ours {len(rows)}: compare the same batches")
        base = sum(r["step_time_s"] for r in baseline)
        out["total_baseline_step_time_s"] = base
        out["speedup"] = base / steps
        out["speedup_per_batch_median"] = statistics.median(
            b["step_time_s"] / r["step_time_s"] for b, r in zip(baseline, rows)
        )
    return out


def means(rows: list[dict]) -> dict:
    """Every numeric metric the batches share, averaged (a peak: its maximum)."""
    keys = [k for k in rows[0] if all(k in r for r in rows) and isinstance(rows[0][k], (int, float))]
    return {
        k: float(max(r[k] for r in rows)) if k in PEAKS else float(sum(r[k] for r in rows) / len(rows)) for k in keys
    }
