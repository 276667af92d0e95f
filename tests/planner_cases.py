"""Shared fixtures for the planner tests: small cost models whose rings and offloading show
up at a few hundred tokens, so property tests stay fast."""

from hypothesis import strategies as st

from megatron_bytescale.planner.cost_model import CostModel


def small_cost(bw_offload: float = 1e12, num_layers: int = 6, **changes) -> CostModel:
    """Attention dominates from ~100 tokens on; offloading hides unless ``bw_offload`` is tiny."""
    base = dict(
        a1=1e-6,
        b1=1e-4,
        g=1e-4,
        a2=1000.0,
        b2=0.0,
        num_layers=num_layers,
        kv_bytes_per_token=100.0,
        grad_bytes_per_token=200.0,
        bw_d2h=bw_offload,
        bw_h2d=bw_offload,
        bw_intra_node=1e9,
        bw_inter_node=1e8,
        p2p_latency_s=1e-6,
    )
    base.update(changes)
    return CostModel(**base)


def draw_lengths(
    draw, capacity: int, num_ranks: int, max_short: int, max_long: int, min_long: int = 0, shuffle: bool = False
) -> list[int]:
    """A batch for a property test: short sequences (one rank holds each) and, when there is
    more than one rank, long ones that need a ring; ``[capacity]`` if both come out empty."""
    short = draw(st.lists(st.integers(1, capacity), max_size=max_short))
    long = (
        draw(st.lists(st.integers(capacity + 1, capacity * num_ranks), min_size=min_long, max_size=max_long))
        if num_ranks > 1
        else []
    )
    lens = draw(st.permutations(short + long)) if shuffle else short + long
    return lens or [capacity]


@st.composite
def expert_parallel_cases(draw, groups=(1, 4), max_long: int = 4, balances=("none", "dp", "pp")):
    """A batch and a planner config with expert parallelism 2 or 4 over ``groups`` EP groups."""
    from megatron_bytescale.planner.planner import PlannerConfig

    ep = draw(st.sampled_from([2, 4]))
    num_ranks = ep * draw(st.integers(*groups))
    capacity = draw(st.integers(8, 120))
    lens = draw_lengths(draw, capacity, num_ranks, max_short=30, max_long=max_long)
    config = PlannerConfig(
        num_ranks=num_ranks,
        capacity=capacity,
        ranks_per_node=draw(st.sampled_from([1, 2, 4])) if num_ranks % 4 == 0 else 1,
        balance=draw(st.sampled_from(balances)),
        offload=draw(st.booleans()),
        expert_parallel=ep,
    )
    return draw(st.permutations(lens)), config


def check_stage_orders(keys, orders, p: int, chunks: int = 1) -> None:
    """Per-device orders of (direction, micro-batch[, chunk]) run every chunk of every
    micro-batch of their rank once forward and then once backward, the devices of each
    pipeline agree on the order of the messages between them, and nothing deadlocks."""
    from megatron_bytescale.planner.contract import (
        BACKWARD,
        FORWARD,
        as_ops,
        crossing_order_mismatch,
        find_pipeline_deadlock,
    )

    for r, rank in enumerate(orders):
        assert len(rank) == p
        for stage in rank:
            ops = as_ops(stage)
            want = [(d, m, c) for m in range(len(keys[r])) for c in range(chunks) for d in (FORWARD, BACKWARD)]
            assert sorted(ops) == sorted(want)
            seen = set()
            for d, m, c in ops:
                assert d == FORWARD or (m, c) in seen
                seen.add((m, c))
        assert crossing_order_mismatch(rank, chunks) is None
    assert find_pipeline_deadlock(keys, p, orders, chunks) is None


def peak_in_flight(orders) -> int:
    """The most forwards (chunk forwards) any device of any rank holds before their backward."""
    from megatron_bytescale.planner.contract import FORWARD

    peak = 0
    for rank in orders:
        for stage in rank:
            held = 0
            for op in stage:
                held += 1 if op[0] == FORWARD else -1
                peak = max(peak, held)
    return peak


@st.composite
def ring_pipelines(
    draw,
    ranks: tuple[int, int],
    max_rings: int,
    before: int,
    after: int,
    giant: bool = False,
    chunks: list[int] | None = None,
):
    """Pipelines' ring keys and stage times: rings over random member sets in one global
    order (with ``giant``, at times one on every rank first), up to ``before`` local
    micro-batches of random length ahead of each, up to ``after`` at the end (at least one on
    a lone rank). Returns (keys, times, p), or (keys, times, p, V) with ``chunks`` to draw V from."""
    n = draw(st.integers(*ranks))
    p = draw(st.sampled_from([2, 3, 4]))
    v = draw(st.sampled_from(chunks)) if chunks else None
    keys = [[] for _ in range(n)]
    times = [[] for _ in range(n)]
    rings = draw(st.lists(st.sets(st.integers(0, n - 1), min_size=2, max_size=n), max_size=max_rings)) if n > 1 else []
    if giant and draw(st.booleans()):
        rings.insert(0, set(range(n)))
    for k, ring in enumerate(rings):
        t = draw(st.floats(0.5, 10.0))
        for r in sorted(ring):
            for _ in range(draw(st.integers(0, before))):
                keys[r].append(None)
                times[r].append(draw(st.floats(0.05, 2.0)))
            keys[r].append(("ring", k))
            times[r].append(t)
    for r in range(n):
        for _ in range(draw(st.integers(0 if rings else 1, after))):
            keys[r].append(None)
            times[r].append(draw(st.floats(0.05, 2.0)))
    return (keys, times, p) if v is None else (keys, times, p, v)


@st.composite
def ring_keys(draw):
    """Per rank, its micro-batches' keys: rings (shared ints, in one order on every member) or None."""
    n = draw(st.integers(2, 6))
    rings = draw(st.lists(st.lists(st.integers(0, n - 1), min_size=2, max_size=n, unique=True), max_size=5))
    keys = [[] for _ in range(n)]
    for u, members in enumerate(rings):
        for r in members:
            keys[r] += [None] * draw(st.integers(0, 2)) + [u]
    for r in range(n):
        keys[r] += [None] * draw(st.integers(0 if keys[r] else 1, 3))
    return keys
