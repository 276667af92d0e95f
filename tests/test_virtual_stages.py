"""Virtual pipeline stages (model chunks per device) in plans: the interleaved order runs any
micro-batch count without deadlock and with the devices agreeing on message order, plans carry
chunk orders through JSON, and ``validate`` refuses chunk orders that cannot run."""

import pytest

from megatron_bytescale.errors import PlanError
from megatron_bytescale.planner.contract import (
    BACKWARD,
    FORWARD,
    MicroBatch,
    Plan,
    decode_order,
    encode_stage_orders,
    find_pipeline_deadlock,
    interleaved_order,
    one_f_one_b,
    ring_pieces,
    whole_piece,
)

from planner_cases import check_stage_orders


@pytest.mark.parametrize("chunks", [1, 2, 3])
@pytest.mark.parametrize("stages", [1, 2, 3, 4, 5])
def test_interleaved_order_runs_every_count(stages, chunks):
    for count in range(14):
        orders = [interleaved_order(count, stages, d, chunks) for d in range(stages)]
        check_stage_orders([[None] * count], [orders], stages, chunks)
        if chunks == 1:
            assert orders[0] == one_f_one_b(count, stages, 0)


def test_fixed_warmup_interleaving_deadlocks_where_ours_does_not():
    """Megatron's fixed warm-up counts (2 (p - 1 - d) + (v - 1) p forwards, then one forward
    one backward) deadlock when the count is not a multiple of p: the check must see it."""
    count, p, v = 5, 4, 3
    forwards = [(m, c) for g in range(0, count, p) for c in range(v) for m in range(g, min(g + p, count))]
    backwards = [(m, c) for g in range(0, count, p) for c in reversed(range(v)) for m in range(g, min(g + p, count))]
    orders = []
    for d in range(p):
        w = min(len(forwards), 2 * (p - 1 - d) + (v - 1) * p)
        order = [(FORWARD, *f) for f in forwards[:w]]
        for i in range(len(forwards) - w):
            order += [(FORWARD, *forwards[w + i]), (BACKWARD, *backwards[i])]
        orders.append(order + [(BACKWARD, *b) for b in backwards[len(forwards) - w :]])
    assert "wait in a cycle" in find_pipeline_deadlock([[None] * count], p, [orders], v)
    ours = [interleaved_order(count, p, d, v) for d in range(p)]
    assert find_pipeline_deadlock([[None] * count], p, [ours], v) is None


def ring_plan(orders, chunks: int) -> Plan:
    """Two pipelines sharing one ring micro-batch (sequence 0), each with a local one."""
    r = ring_pieces(0, 10, (0, 1))
    ranks = (
        (MicroBatch((r[0],)), MicroBatch((whole_piece(1, 3, 0),))),
        (MicroBatch((whole_piece(2, 4, 1),)), MicroBatch((r[1],))),
    )
    codes = None if orders is None else encode_stage_orders(orders, chunks)
    return Plan(
        num_ranks=2,
        capacity=20,
        num_layers=4,
        seq_lens=(10, 3, 4),
        ranks=ranks,
        stage_orders=codes,
        virtual_stages=chunks,
    )


def test_chunk_orders_round_trip_and_validate():
    p, v = 2, 2
    orders = [[interleaved_order(2, p, d, v) for d in range(p)] for _ in range(2)]
    plan = ring_plan(orders, v)
    # rank 0 runs the ring first, rank 1 second: with the interleaved order on both, the
    # ring's chunk-0 forward waits on rank 1 behind its local micro-batch, never in a cycle
    plan.validate()
    again = Plan.from_json(plan.to_json())
    assert again.virtual_stages == v and again.stage_orders == plan.stage_orders
    assert again.stage_order(0, 1) == orders[0][1]
    assert again.chunk_order(1, 0, p) == orders[1][0]
    assert decode_order(plan.stage_orders[0][0], v) == orders[0][0]
    assert ring_plan(None, v).chunk_order(0, 1, p) == interleaved_order(2, p, 1, v)


def test_validate_refuses_chunk_orders_that_cannot_run():
    p, v = 2, 2
    good = [[interleaved_order(2, p, d, v) for d in range(p)] for _ in range(2)]
    missing = [[o[:-1] for o in rank] for rank in good]
    with pytest.raises(PlanError, match=r"each of its 2 chunks\) once forward and once backward"):
        ring_plan(missing, v).validate()
    early = [list(rank) for rank in good]
    first_backward = early[0][1].index(next(op for op in early[0][1] if op[0] == BACKWARD))
    early[0][1] = [early[0][1][first_backward]] + early[0][1][:first_backward] + early[0][1][first_backward + 1 :]
    with pytest.raises(PlanError, match="chunk .* comes before its forward"):
        ring_plan(early, v).validate()
    # device 1 runs its chunk-0 forwards in the other order than device 0 sends them
    crossed = [list(rank) for rank in good]
    d1 = list(crossed[1][1])
    i, j = d1.index((FORWARD, 0, 0)), d1.index((FORWARD, 1, 0))
    d1[i], d1[j] = d1[j], d1[i]
    crossed[1][1] = d1
    with pytest.raises(PlanError, match="device 0 sends the forward of micro-batch 0 at virtual stage 1"):
        ring_plan(crossed, v).validate()
    with pytest.raises(PlanError, match="virtual_stages=0 must be at least 1"):
        ring_plan(None, 0).validate()
