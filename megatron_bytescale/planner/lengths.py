"""A batch's sequence lengths, as the planner passes them around: a tuple (what Python loops
index fast, and what a plan keeps) that also holds them as one int64 array, made once when the
batch is checked (``planner.check_lengths``) instead of by each numpy reader (~5 ms a
512M-token batch's conversion, a dozen of them in a pipelined plan)."""

from __future__ import annotations

import numpy as np


class Lengths(tuple):
    """The lengths as a tuple, and as an int64 array (``array``)."""

    array: np.ndarray

    @classmethod
    def of(cls, array: np.ndarray) -> Lengths:
        lens = cls(array.tolist())
        lens.array = array.astype(np.int64)
        return lens


def lengths_array(lens) -> np.ndarray:
    """``lens`` as an int64 array: the one ``Lengths`` holds, else a new one."""
    return lens.array if isinstance(lens, Lengths) else np.asarray(lens, dtype=np.int64)
