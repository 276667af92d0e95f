import pytest

from megatron_bytescale.errors import PlanError
from megatron_bytescale.planner.contract import MicroBatch, Plan, resident_fraction, ring_pieces, whole_piece
from megatron_bytescale.planner.ring_traffic import p2p_bytes_per_rank


def make_plan(seq_lens, ranks, capacity=8, layers=4, num_ranks=None):
    return Plan(
        num_ranks=num_ranks or len(ranks),
        capacity=capacity,
        num_layers=layers,
        seq_lens=tuple(seq_lens),
        ranks=tuple(tuple(mbs) for mbs in ranks),
    )


def mixed_plan():  # capacity 10: rank 1 holds 6 + 3 tokens
    # seq 0 (20 tokens) over ring (2, 0, 1); seqs 1, 2 short; rank 3 runs two short micro-batches
    long = ring_pieces(0, 20, (2, 0, 1))
    by_rank = {2: long[0], 0: long[1], 1: long[2]}
    return make_plan(
        [20, 3, 5, 8],
        [
            [MicroBatch((by_rank[0],))],
            [MicroBatch((by_rank[1], whole_piece(1, 3, 1)))],
            [MicroBatch((by_rank[2],))],
            [MicroBatch((whole_piece(2, 5, 3),)), MicroBatch((whole_piece(3, 8, 3),))],
        ],
        capacity=10,
    )


def test_valid_plan_passes_and_round_trips():
    plan = mixed_plan().validate()
    again = Plan.from_json(plan.to_json())
    assert again == plan
    assert plan.ring_sizes() == {0: 3, 1: 1, 2: 1, 3: 1}
    assert sum(plan.tokens_per_rank()) == sum(plan.seq_lens)


def test_missing_and_duplicated_tokens_are_reported():
    plan = mixed_plan()
    ranks = list(plan.ranks)
    ranks[3] = ranks[3][:1]  # drop sequence 3
    with pytest.raises(PlanError, match=r"sequence 3: tokens \[0, 8\) are not in the plan"):
        make_plan(plan.seq_lens, ranks).validate()
    ranks = list(plan.ranks)
    ranks[2] = ranks[2] + (MicroBatch((whole_piece(2, 5, 2),)),)
    with pytest.raises(PlanError, match="more than once"):
        make_plan(plan.seq_lens, ranks).validate()


def test_capacity_and_offload():
    big = make_plan([12], [[MicroBatch((whole_piece(0, 12, 0),))]], capacity=8, layers=4)
    with pytest.raises(PlanError, match="over capacity 8"):
        big.validate()
    # offloading r=1 of 4 layers keeps 2/4 of activations: 12 tokens -> 6 token-equivalents
    assert resident_fraction(1.0, 4) == 0.5
    make_plan([12], [[MicroBatch((whole_piece(0, 12, 0),), offload_ratio=1.0)]], capacity=8, layers=4).validate()
    with pytest.raises(PlanError, match="outside"):
        make_plan([4], [[MicroBatch((whole_piece(0, 4, 0),), offload_ratio=1.5)]]).validate()


def test_ring_must_hold_zigzag_shares_on_its_members():
    long = ring_pieces(0, 20, (0, 1))
    swapped = make_plan([20], [[MicroBatch((long[1],))], [MicroBatch((long[0],))]], capacity=16)
    with pytest.raises(PlanError, match="zigzag share"):
        swapped.validate()
    missing_member = make_plan([20], [[MicroBatch((long[0],))], []], capacity=16)
    with pytest.raises(PlanError):
        missing_member.validate()


def test_inconsistent_ring_order_is_a_deadlock():
    a = ring_pieces(0, 8, (0, 1))
    b = ring_pieces(1, 8, (0, 1))
    plan = make_plan([8, 8], [[MicroBatch((a[0],)), MicroBatch((b[0],))], [MicroBatch((b[1],)), MicroBatch((a[1],))]])
    with pytest.raises(PlanError, match="deadlock"):
        plan.validate()
    ok = make_plan([8, 8], [[MicroBatch((a[0],)), MicroBatch((b[0],))], [MicroBatch((a[1],)), MicroBatch((b[1],))]])
    ok.validate()


def test_static_style_micro_batch_shares_one_ring():
    a = ring_pieces(0, 6, (0, 1))
    b = ring_pieces(1, 5, (0, 1))
    plan = make_plan([6, 5], [[MicroBatch((a[0], b[0]))], [MicroBatch((a[1], b[1]))]])
    plan.validate()
    # member 0 sends its own block and receives the successor's: (T0 + T1 - T1) tokens of KV
    kv, grad = 10.0, 100.0
    sent = p2p_bytes_per_rank(plan, kv, grad, num_layers=2)
    t0 = 3 + 3  # rank_tokens(6,2,0) + rank_tokens(5,2,0)
    t1 = 3 + 2
    assert sent[0] == 2 * (2 * t0 * kv + (t0 + t1) * grad)
    assert sent[1] == 2 * (2 * t1 * kv + (t0 + t1) * grad)


def test_malformed_json_is_a_clear_error():
    with pytest.raises(PlanError, match="not valid JSON"):
        Plan.from_json("{not json")
    with pytest.raises(PlanError, match="malformed plan"):
        Plan.from_json('{"version": 1, "num_ranks": 1}')
