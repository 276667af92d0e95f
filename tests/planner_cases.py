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


def draw_lengths(draw, capacity: int, num_ranks: int, max_short: int, max_long: int, min_long: int = 0,
                 shuffle: bool = False) -> list[int]:
    """A batch for a property test: short sequences (one rank holds each) and, when there is
    more than one rank, long ones that need a ring; ``[capacity]`` if both come out empty."""
    short = draw(st.lists(st.integers(1, capacity), max_size=max_short))
    long = (draw(st.lists(st.integers(capacity + 1, capacity * num_ranks), min_size=min_long, max_size=max_long))
            if num_ranks > 1 else [])
    lens = draw(st.permutations(short + long)) if shuffle else short + long
    return lens or [capacity]
