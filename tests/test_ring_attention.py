"""Ring attention against one-process full attention, computed here with plain torch over each
whole sequence; real P2P over gloo ranks, plus an in-process (threads) ring for random plans."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_bytescale.errors import ConfigError, PlanError
from megatron_bytescale.local_world import run_local_world
from megatron_bytescale.planner.contract import MicroBatch, Plan, ring_pieces, whole_piece
from megatron_bytescale.planner.ring_traffic import p2p_bytes_per_rank
from megatron_bytescale.runtime.attention_ops import TORCH_BACKEND
from megatron_bytescale.runtime.layout import MicroBatchLayout
from megatron_bytescale.runtime.ring_attention import attention_backward, attention_forward, ring_attention
from megatron_bytescale.runtime.ring_comm import LocalRing, P2PCounter

HQ, HKV, D = 4, 2, 8  # GQA: two query heads per KV head
ATOL = 1e-5
TIMEOUT_S = 60


# ------------------------------------------------------------------- the reference
def sequences(seq_lens, seed):
    """Per sequence: q, k, v and the loss weights g (float64), the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    return {
        sid: [torch.randn(s, h, D, generator=gen, dtype=torch.float64) for h in (HQ, HKV, HKV, HQ)]
        for sid, s in enumerate(seq_lens)
    }


def reference(full):
    """Per sequence: causal attention output and d(sum(out * g))/d(q, k, v), by autograd."""
    result = {}
    for sid, (q, k, v, g) in full.items():
        q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
        kk, vv = k.repeat_interleave(HQ // HKV, 1), v.repeat_interleave(HQ // HKV, 1)
        s = torch.einsum("qhd,khd->hqk", q, kk) * D**-0.5
        causal = torch.ones(len(q), len(q), dtype=torch.bool).tril()
        out = torch.einsum("hqk,khd->qhd", s.masked_fill(~causal, float("-inf")).softmax(-1), vv)
        (out * g).sum().backward()
        result[sid] = [out.detach(), q.grad, k.grad, v.grad]
    return result


def gather(by_seq, layout, i):
    """Tensor ``i`` of every sequence, at this layout's tokens (sequence id, true position)."""
    return torch.stack([by_seq[s][i][p] for s, p in zip(layout.seq_ids.tolist(), layout.positions.tolist())])


def max_errors(layout, out, grads, ref):
    return [(got.double() - gather(ref, layout, i)).abs().max().item() for i, got in enumerate([out, *grads])]


def predicted_bytes(plan):
    return p2p_bytes_per_rank(plan, 2 * HKV * D * 4, 2 * HKV * D * 4, num_layers=1)


def make_plan(seq_lens, ranks):
    return Plan(
        num_ranks=len(ranks),
        capacity=64,
        num_layers=1,
        seq_lens=tuple(seq_lens),
        ranks=tuple(tuple(MicroBatch(tuple(p)) for p in mbs) for mbs in ranks),
    ).validate()


# --------------------------------------------------------------- gloo rank function
def run_plan_on_rank(rank, world_size, plan_json, seed, group_ranks=None, backend="auto"):
    """Every micro-batch of this rank, in plan order: forward, backward, errors against the reference."""
    plan = Plan.from_json(plan_json)
    group = dist.new_group(group_ranks) if group_ranks else None  # the tests' stand-in for an HDP group
    hdp_rank = dist.get_rank(group) if group is not None else rank
    if hdp_rank < 0:
        return None
    full = sequences(plan.seq_lens, seed)
    ref = reference(full)
    counter = P2PCounter()
    errors = []
    for mb in plan.micro_batches(hdp_rank):
        layout = MicroBatchLayout.from_micro_batch(mb, hdp_rank)
        q, k, v, g = (gather(full, layout, i).float() for i in range(4))
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        out = ring_attention(q, k, v, layout, group=group, backend=backend, counter=counter)
        (out * g).sum().backward()
        errors.append(max_errors(layout, out, (q.grad, k.grad, v.grad), ref))
    return hdp_rank, errors, counter.bytes_sent


def mixed_plan():
    """4 ranks; rings of 2, 3 and 4 on overlapping ranks, lengths not divisible by 2N, whole short
    sequences beside chunk pairs, a static-style micro-batch of three sequences sharing one ring,
    and a micro-batch with no ring at all."""
    a, b = (0, 1, 2), (3, 1)
    c = (2, 0, 3, 1)
    s0, s3 = ring_pieces(0, 29, a), ring_pieces(3, 22, b)
    s4, s6, s7 = ring_pieces(4, 41, c), ring_pieces(6, 19, c), ring_pieces(7, 9, c)
    cshare = lambda r: [s4[c.index(r)], s6[c.index(r)], s7[c.index(r)]]  # noqa: E731
    lens = [29, 7, 3, 22, 41, 5, 19, 9, 11]
    return make_plan(
        lens,
        [
            [[s0[0], whole_piece(1, 7, 0)], cshare(0)],
            [[whole_piece(2, 3, 1), s0[1]], [s3[1]], cshare(1)[::-1]],
            [[s0[2]], cshare(2)],
            [[s3[0], whole_piece(5, 5, 3)], cshare(3), [whole_piece(8, 11, 3)]],
        ],
    )


@pytest.mark.parametrize("backend", ["auto", "torch"])  # CPU flash kernels, and the dense math
def test_ring_attention_matches_full_attention_over_gloo(backend):
    plan = mixed_plan()
    results = run_local_world(run_plan_on_rank, 4, plan.to_json(), 0, None, backend, timeout_s=TIMEOUT_S)
    expected = predicted_bytes(plan)
    for hdp_rank, errors, sent in results:
        assert len(errors) == len(plan.micro_batches(hdp_rank))
        assert max(max(e) for e in errors) < ATOL, (hdp_rank, errors)
        assert sent == expected[hdp_rank] > 0


def test_rings_over_a_subgroup_use_global_ranks():
    """HDP ranks 0, 1 are global ranks 1, 2: peers must be translated, or rank 0 talks to itself."""
    ring = (1, 0)
    s0 = ring_pieces(0, 13, ring)
    plan = make_plan([13, 4, 6], [[[s0[1], whole_piece(1, 4, 0)]], [[s0[0]], [whole_piece(2, 6, 1)]]])
    results = run_local_world(run_plan_on_rank, 3, plan.to_json(), 1, [1, 2], timeout_s=TIMEOUT_S)
    assert results[0] is None
    expected = predicted_bytes(plan)
    for hdp_rank, errors, sent in results[1:]:
        assert max(max(e) for e in errors) < ATOL, (hdp_rank, errors)
        assert sent == expected[hdp_rank] > 0


# ----------------------------------------------------------------- one process, threads
@st.composite
def ring_micro_batches(draw):
    """One ring micro-batch of random sequences (with random whole ones beside) on every member."""
    n = draw(st.integers(1, 4))
    ring = tuple(draw(st.permutations(range(n))))
    long = draw(st.lists(st.integers(n, 4 * n + 7), min_size=1 if n > 1 else 0, max_size=3))
    short = draw(st.lists(st.integers(1, 6), min_size=0 if long else 1, max_size=3))
    lens = long + short
    shares = [ring_pieces(sid, s, ring) for sid, s in enumerate(long)] if n > 1 else []
    owners = [draw(st.sampled_from(ring)) for _ in short]
    mbs = {}
    for idx, rank in enumerate(ring):
        pieces = [sh[idx] for sh in shares]
        pieces += [whole_piece(len(long) + i, s, rank) for i, (s, o) in enumerate(zip(short, owners)) if o == rank]
        mbs[rank] = MicroBatch(tuple(draw(st.permutations(pieces))))
    if n == 1:  # ring of one: whole sequences only
        mbs = {ring[0]: MicroBatch(tuple(whole_piece(i, s, ring[0]) for i, s in enumerate(lens)))}
    return lens, ring, mbs


@settings(max_examples=15, deadline=None)
@given(ring_micro_batches(), st.integers(0, 2**16))
def test_threaded_ring_matches_full_attention(case, seed):
    lens, ring, mbs = case
    full = sequences(lens, seed)
    ref = reference(full)
    hub = LocalRing(len(ring), timeout_s=TIMEOUT_S)

    def member(rank):
        layout = MicroBatchLayout.from_micro_batch(mbs[rank], rank)
        q, k, v, g = (gather(full, layout, i).float() for i in range(4))
        comm = hub.member(layout.ring_index)
        out, lse = attention_forward(q, k, v, layout, comm, D**-0.5, TORCH_BACKEND)
        grads = attention_backward(g, q, k, v, out, lse, layout, comm, D**-0.5, TORCH_BACKEND)
        return max_errors(layout, out, grads, ref)

    with ThreadPoolExecutor(len(ring)) as pool:
        errors = list(pool.map(member, [r for r in ring if mbs[r].pieces]))
    assert max(max(e) for e in errors) < ATOL


def test_ring_of_one_needs_no_distributed_and_sends_nothing():
    assert not dist.is_initialized()
    lens = [6, 1, 4]
    full = sequences(lens, 3)
    layout = MicroBatchLayout.from_micro_batch(MicroBatch(tuple(whole_piece(i, s, 5) for i, s in enumerate(lens))), 5)
    q, k, v, g = (gather(full, layout, i).float().requires_grad_() for i in range(4))
    counter = P2PCounter()
    out = ring_attention(q, k, v, layout, counter=counter)
    (out * g).sum().backward()
    assert max(max_errors(layout, out, (q.grad, k.grad, v.grad), reference(full))) < ATOL
    assert counter.bytes_sent == 0 and counter.messages == 0


# ---------------------------------------------------------------------- bad input
def local_layout(tokens=5, rank=0):
    return MicroBatchLayout.from_micro_batch(MicroBatch((whole_piece(0, tokens, rank),)), rank)


@pytest.mark.parametrize(
    "shapes, message",
    [
        (((6, 4, 8), (6, 2, 8), (6, 2, 8)), "holds 5; pass exactly"),
        (((5, 3, 8), (5, 2, 8), (5, 2, 8)), "not a multiple of 2 key/value heads"),
        (((5, 4, 8), (5, 2, 8), (5, 1, 8)), "got q"),
        (((5, 4, 8), (5, 2, 4), (5, 2, 4)), "head dim"),
        (((5, 4), (5, 2, 8), (5, 2, 8)), "got q"),
    ],
)
def test_shape_mismatches_are_plan_errors(shapes, message):
    q, k, v = (torch.zeros(s) for s in shapes)
    with pytest.raises(PlanError, match=message):
        ring_attention(q, k, v, local_layout())


def test_ring_without_torch_distributed_is_a_config_error():
    layout = MicroBatchLayout.from_micro_batch(MicroBatch((ring_pieces(0, 8, (0, 1))[0],)), 0)
    q, k = torch.zeros(4, 2, 8), torch.zeros(4, 1, 8)
    with pytest.raises(ConfigError, match="needs torch.distributed initialised"):
        ring_attention(q, k, k, layout)


def _bad_rings(rank, world_size):
    """Errors raised before any communication, so nothing hangs (returned, not raised)."""
    messages = []
    for ring, as_rank in (((0, 1, 2), rank), ((0, 1), 1 - rank)):
        piece = ring_pieces(0, 12, ring)[ring.index(as_rank)]
        layout = MicroBatchLayout.from_micro_batch(MicroBatch((piece,)), as_rank)
        q = torch.zeros(layout.num_tokens, 2, 8)
        try:
            ring_attention(q, q, q, layout)
            messages.append(None)
        except PlanError as exc:
            messages.append(str(exc))
    return messages


def test_ring_ranks_outside_the_group_or_a_foreign_layout_are_plan_errors():
    for outside, foreign in run_local_world(_bad_rings, 2, timeout_s=TIMEOUT_S):
        assert "names ranks [2] outside the HDP group of 2 ranks" in outside
        assert "but this process is HDP rank" in foreign
