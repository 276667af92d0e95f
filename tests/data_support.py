"""Shared helpers for the data tests: small real corpora and a stand-in plan function.

The loaders' default planner is the HDP planner (``planner.planner.plan_step``), which most
tests use. ``simple_plan`` (long sequences on zigzag rings of ceil(s/C) least-loaded ranks,
short ones packed whole) shows that any planning function can be plugged in.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

from megatron_bytescale.data.corpus import site_packages_documents
from megatron_bytescale.data.indexed import write_indexed_dataset
from megatron_bytescale.planner.contract import MicroBatch, Plan, ring_pieces, whole_piece

# Small real distributions installed with the test dependencies (pytest pulls these in).
# installed wherever the tests run: matplotlib needs cycler, pytest iniconfig, pluggy and packaging,
# torch typing_extensions
SMALL_PACKAGES = ["cycler", "iniconfig", "pluggy", "typing_extensions", "packaging"]


def build_corpus(tmp_path: Path, packages=SMALL_PACKAGES, name: str = "corpus") -> str:
    prefix = str(tmp_path / name)
    write_indexed_dataset(prefix, site_packages_documents(packages=packages), source="site-packages")
    return prefix


def simple_plan(seq_lens, num_ranks: int, capacity: int, num_layers: int = 4) -> Plan:
    ranks: list[list[MicroBatch]] = [[] for _ in range(num_ranks)]
    load = [0] * num_ranks
    open_mb: list[list] = [[] for _ in range(num_ranks)]  # whole pieces not yet closed
    open_tokens = [0] * num_ranks

    def close(r):
        if open_mb[r]:
            ranks[r].append(MicroBatch(tuple(open_mb[r])))
            open_mb[r], open_tokens[r] = [], 0

    order = sorted(range(len(seq_lens)), key=lambda i: (-seq_lens[i], i))
    for sid in order:
        s = seq_lens[sid]
        n = math.ceil(s / capacity)
        if n > num_ranks:
            raise ValueError(f"sequence of {s} tokens needs {n} ranks, have {num_ranks}")
        if n > 1:
            ring = tuple(sorted(sorted(range(num_ranks), key=lambda r: (load[r], r))[:n]))
            for r, piece in zip(ring, ring_pieces(sid, s, ring)):
                close(r)
                ranks[r].append(MicroBatch((piece,)))
                load[r] += piece.tokens
        else:
            r = min(range(num_ranks), key=lambda r: (load[r], r))
            if open_tokens[r] + s > capacity:
                close(r)
            open_mb[r].append(whole_piece(sid, s, r))
            open_tokens[r] += s
            load[r] += s
    for r in range(num_ranks):
        close(r)
    return Plan(
        num_ranks, capacity, num_layers, tuple(seq_lens), tuple(tuple(m) for m in ranks), {"strategy": "simple"}
    )


def simple_plan_fn(num_ranks: int, capacity: int):
    return functools.partial(simple_plan, num_ranks=num_ranks, capacity=capacity)


class SlowOnCall:
    """A planning function that sleeps ``seconds`` on its ``call``-th call (0-based) and is
    otherwise ``plan_fn``: a step whose plan outlasts the previous step's training.
    Picklable, so it also runs in the plan-ahead process (which counts its own calls)."""

    def __init__(self, plan_fn, call: int, seconds: float):
        self.plan_fn, self.call, self.seconds, self.calls = plan_fn, call, seconds, 0

    def __call__(self, seq_lens):
        import time

        if self.calls == self.call:
            time.sleep(self.seconds)
        self.calls += 1
        return self.plan_fn(seq_lens)
