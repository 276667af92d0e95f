from hypothesis import given
from hypothesis import strategies as st

from megatron_bytescale.planner.contract.zigzag import causal_work, rank_tokens, zigzag_ranges


@given(st.integers(1, 5000), st.integers(1, 64))
def test_zigzag_covers_every_token_once_and_balances(seq_len, ring_size):
    if ring_size > seq_len:
        return
    shares = zigzag_ranges(seq_len, ring_size)
    assert len(shares) == ring_size
    tokens = sorted(t for ranges in shares for a, b in ranges for t in range(a, b))
    assert tokens == list(range(seq_len))
    counts = [sum(b - a for a, b in ranges) for ranges in shares]
    assert max(counts) - min(counts) <= 1
    assert counts == [rank_tokens(seq_len, ring_size, i) for i in range(ring_size)]
    # causal work is balanced: the zigzag pairing equalises it to within one chunk's rows
    work = [causal_work(r) for r in shares]
    chunk = -(-seq_len // (2 * ring_size))
    assert max(work) - min(work) <= 2 * chunk * (chunk + 1) + seq_len


def test_zigzag_examples():
    assert zigzag_ranges(10, 1) == (((0, 10),),)
    assert zigzag_ranges(8, 2) == (((0, 2), (6, 8)), ((2, 6),))
    # 7 tokens over 2 ranks: 4 + 3, chunks 2,2 | 1,2 -> no padding
    assert zigzag_ranges(7, 2) == (((0, 2), (5, 7)), ((2, 5),))
    # as many ranks as tokens: one token each
    assert [sum(b - a for a, b in r) for r in zigzag_ranges(3, 3)] == [1, 1, 1]
