"""Global batches: token budget, context cuts, epochs, determinism, exact resume positions."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_bytescale.data.sampler import GlobalBatchSampler, Position, loader_state, restore_state
from megatron_bytescale.errors import ConfigError


def run(sampler, steps, pos=Position()):
    out = []
    for _ in range(steps):
        samples, pos = sampler.batch(pos)
        out.append(samples)
    return out, pos


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 2000), min_size=1, max_size=20),
    context=st.integers(1, 1500),
    extra=st.integers(0, 3000),
    seed=st.integers(0, 2**31),
)
def test_an_epoch_covers_every_token_once_within_budget_and_context(lengths, context, extra, seed):
    budget = context + extra
    s = GlobalBatchSampler(lengths, step_tokens=budget, context_length=context, seed=seed)
    stream, pos = [], Position()
    while pos.epoch == 0:
        samples, nxt = s.batch(pos)
        assert samples and sum(x.length for x in samples) <= budget
        assert all(0 < x.length <= context for x in samples)
        following, _ = s.batch(nxt)  # the step ended because the next sample would not fit
        assert sum(x.length for x in samples) + following[0].length > budget
        stream.extend(samples)
        pos = nxt
    # the first sum(lengths) tokens of the stream are epoch 0: each token exactly once
    covered = {i: np.zeros(n, dtype=int) for i, n in enumerate(lengths)}
    total = 0
    for x in stream:
        if total == sum(lengths):
            break
        covered[x.doc_id][x.start : x.end] += 1
        total += x.length
    assert total == sum(lengths)
    assert all((c == 1).all() for c in covered.values())


def test_long_documents_are_cut_into_consecutive_windows():
    s = GlobalBatchSampler([10, 25], step_tokens=35, context_length=8, seed=0)
    (samples,), _ = run(s, 1)
    by_doc = {d: [(x.start, x.end) for x in samples if x.doc_id == d] for d in (0, 1)}
    assert by_doc[1] == [(0, 8), (8, 16), (16, 24), (24, 25)]
    assert by_doc[0] == [(0, 8), (8, 10)]


def test_order_is_deterministic_from_seed_and_epoch():
    lengths = list(range(1, 200))
    a, _ = run(GlobalBatchSampler(lengths, step_tokens=500, context_length=100, seed=7), 30)
    b, _ = run(GlobalBatchSampler(lengths, step_tokens=500, context_length=100, seed=7), 30)
    c, _ = run(GlobalBatchSampler(lengths, step_tokens=500, context_length=100, seed=8), 30)
    assert a == b and a != c
    s = GlobalBatchSampler(lengths, step_tokens=500, context_length=100, seed=7)
    assert not np.array_equal(s.order(0), s.order(1))  # reshuffled each epoch


def test_steps_run_across_epoch_boundaries():
    s = GlobalBatchSampler([3, 4, 5], step_tokens=10, context_length=5, seed=1)
    steps, pos = run(s, 4)
    stream = [x for st_ in steps for x in st_]
    docs_in_order = [x.doc_id for x in stream]
    expected = [int(d) for e in range(3) for d in s.order(e)][: len(docs_in_order)]
    assert docs_in_order == expected  # one document after another, epoch after epoch
    cumulative = np.cumsum([sum(x.length for x in st_) for st_ in steps])
    before = np.concatenate([[0], cumulative[:-1]])
    assert np.any((before < 12) & (cumulative > 12))  # a step holds the end of epoch 0 and the start of 1
    assert pos.epoch == (int(cumulative[-1]) // 12)


def test_resuming_from_a_position_continues_identically():
    s = GlobalBatchSampler(list(range(5, 300, 7)), step_tokens=400, context_length=128, seed=3)
    full, _ = run(s, 40)
    first, pos = run(s, 17)
    state = loader_state(17, pos, s.fingerprint())
    fresh = GlobalBatchSampler(list(range(5, 300, 7)), step_tokens=400, context_length=128, seed=3)
    step, pos2 = restore_state(state, fresh.fingerprint())
    rest, _ = run(fresh, 23, pos2)
    assert step == 17 and first + rest == full


def test_state_from_another_configuration_is_refused():
    s = GlobalBatchSampler([10, 20], step_tokens=40, context_length=10, seed=3)
    state = loader_state(2, Position(0, 1, 0), s.fingerprint())
    other = GlobalBatchSampler([10, 20], step_tokens=40, context_length=10, seed=4)
    with pytest.raises(ConfigError, match="seed: saved 3, now 4.*same --data, seed"):
        restore_state(state, other.fingerprint())
    with pytest.raises(ConfigError, match="malformed data loader state"):
        restore_state({"version": 1, "step": 1}, s.fingerprint())
    with pytest.raises(ConfigError, match="outside document"):
        s.check_position(Position(0, 0, 99))


def test_budget_below_context_is_an_error():
    with pytest.raises(ConfigError, match="smaller than the context length"):
        GlobalBatchSampler([10], step_tokens=5, context_length=8)
    with pytest.raises(ConfigError, match="document 1 is empty"):
        GlobalBatchSampler([10, 0], step_tokens=50, context_length=8)
