"""Two-level attention (head all-to-all in a group, ring across groups) against one fused
attention call per sequence: real P2P over gloo ranks, "nodes" of 2 ranks, GQA 8/4 heads,
lengths divisible by nothing, group sizes that do and do not divide the KV heads; and the
bf16 dK/dV accumulator option measured against fp32. One launch runs every case."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_bytescale.errors import PlanError
from megatron_bytescale.local_world import run_local_world
from megatron_bytescale.planner.contract import MicroBatch, Plan, ring_pieces, whole_piece
from megatron_bytescale.planner.ring_traffic import p2p_bytes_per_rank
from megatron_bytescale.runtime.attention_ops import get_backend
from megatron_bytescale.runtime.group_exchange import LocalGroup, SelfRing
from megatron_bytescale.runtime.layout import MicroBatchLayout
from megatron_bytescale.runtime.ring_attention import ring_attention
from megatron_bytescale.runtime.ring_comm import LocalRing, P2PCounter
from megatron_bytescale.runtime.two_level_attention import head_slices, two_level_with

HQ, HKV, D = 8, 4, 8
ATOL = 1e-5  # as tests/test_ring_attention.py
BF16_DKV_RTOL = 1e-2  # bf16 accumulators in transit: a few 2^-9 roundings of the gradients' size
TIMEOUT_S = 90


def sequences(seq_lens, seed):
    gen = torch.Generator().manual_seed(seed)
    return {
        sid: [torch.randn(s, h, D, generator=gen, dtype=torch.float64) for h in (HQ, HKV, HKV, HQ)]
        for sid, s in enumerate(seq_lens)
    }


def reference(full):
    """One fused causal attention call per sequence (SDPA, float64), and its gradients."""
    result = {}
    for sid, (q, k, v, g) in full.items():
        q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
        rep = HQ // HKV
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            k.repeat_interleave(rep, 1).transpose(0, 1),
            v.repeat_interleave(rep, 1).transpose(0, 1),
            is_causal=True,
        ).transpose(0, 1)
        (out * g).sum().backward()
        result[sid] = [out.detach(), q.grad, k.grad, v.grad]
    return result


def gather(by_seq, layout, i):
    return torch.stack([by_seq[s][i][p] for s, p in zip(layout.seq_ids.tolist(), layout.positions.tolist())])


def make_plan(seq_lens, ranks):
    return Plan(
        num_ranks=len(ranks),
        capacity=64,
        num_layers=1,
        seq_lens=tuple(seq_lens),
        ranks=tuple(tuple(MicroBatch(tuple(p)) for p in mbs) for mbs in ranks),
    ).validate()


def four_rank_plan():
    """Nodes {0,1}, {2,3}. Micro-batch 1: a 37-token sequence two-level over ring (2,3,0,1), u=2,
    beside whole sequences; 2: two sequences sharing ring (0,1,2,3), u=2; 3: a 31-token one
    with u=4 (one group: the all-to-all alone); 4: a 26-token one on ring (1,2,3), u=3 (8 query
    heads in slices 2/3/3, 4 KV heads: u divides neither); 5: a plain ring beside."""
    r1, r2, r4 = (2, 3, 0, 1), (0, 1, 2, 3), (1, 2, 3)
    a = ring_pieces(0, 37, r1, 2)
    b, c = ring_pieces(2, 23, r2, 2), ring_pieces(3, 13, r2, 2)
    d = ring_pieces(4, 31, r2, 4)
    e = ring_pieces(5, 26, r4, 3)
    f = ring_pieces(6, 19, (3, 0))
    lens = [37, 5, 23, 13, 31, 26, 19, 9]
    at = lambda pieces, ring, r: pieces[ring.index(r)]
    return make_plan(
        lens,
        [
            [[at(a, r1, 0), whole_piece(1, 5, 0)], [at(b, r2, 0), at(c, r2, 0)], [at(d, r2, 0)], [at(f, (3, 0), 0)]],
            [[at(a, r1, 1)], [at(c, r2, 1), at(b, r2, 1)], [at(d, r2, 1)], [at(e, r4, 1)]],
            [[at(a, r1, 2)], [at(b, r2, 2), at(c, r2, 2), whole_piece(7, 9, 2)], [at(d, r2, 2)], [at(e, r4, 2)]],
            [[at(a, r1, 3)], [at(b, r2, 3), at(c, r2, 3)], [at(d, r2, 3)], [at(e, r4, 3)], [at(f, (3, 0), 3)]],
        ],
    )


def six_rank_plan():
    """Nodes of 2: a 47-token sequence over all six ranks with u=2 (three groups), and a
    29-token one with u=6 (8 query heads in slices of 1 or 2: u divides no head count)."""
    ring = tuple(range(6))
    a, b = ring_pieces(0, 47, ring, 2), ring_pieces(1, 29, ring, 6)
    return make_plan([47, 29], [[[a[r]], [b[r]]] for r in ring])


def run_plan_on_rank(rank, world_size, plan_json, seed):
    """Every micro-batch, for each backend and dK/dV dtype: max errors against the reference,
    and the bytes sent (fp32 accumulators)."""
    plan = Plan.from_json(plan_json)
    full = sequences(plan.seq_lens, seed)
    ref = reference(full)
    result = {}
    for backend in ("auto", "torch"):
        for grad_dtype in (None, torch.bfloat16):
            counter = P2PCounter()
            errors = []
            for mb in plan.micro_batches(rank):
                layout = MicroBatchLayout.from_micro_batch(mb, rank)
                q, k, v, g = (gather(full, layout, i).float() for i in range(4))
                q, k, v = (x.requires_grad_() for x in (q, k, v))
                out = ring_attention(q, k, v, layout, backend=backend, counter=counter, grad_dtype=grad_dtype)
                (out * g).sum().backward()
                got = [out, q.grad, k.grad, v.grad]
                want = [gather(ref, layout, i) for i in range(4)]
                errors.append(
                    [(x.double() - w).abs().max().item() for x, w in zip(got, want)]
                    + [w.abs().max().item() for w in want[2:]]
                )  # and the size of dK, dV
            result[(backend, grad_dtype is not None)] = (errors, counter.bytes_sent)
    return result


def _check(plan, results, divisible_mbs):
    q_bytes, kv_bytes = HQ * D * 4, 2 * HKV * D * 4
    for rank, res in enumerate(results):
        for backend in ("auto", "torch"):
            errors, _ = res[(backend, False)]
            assert len(errors) == len(plan.micro_batches(rank))
            assert max(max(e[:4]) for e in errors) < ATOL, (rank, backend, errors)
            bf16 = res[(backend, True)][0]
            assert max(max(e[:2]) for e in bf16) < ATOL  # out and dQ never travel as bf16
            assert 0 < bf16_dkv_error([{("auto", True): res[(backend, True)]}]) < BF16_DKV_RTOL, (rank, backend, bf16)
        if divisible_mbs:  # the bytes the plan predicts for the micro-batches whose heads split evenly
            sub = Plan(
                plan.num_ranks,
                plan.capacity,
                1,
                plan.seq_lens,
                tuple(tuple(mbs[m] for m in divisible_mbs if m < len(mbs)) for mbs in plan.ranks),
            )
            expected = p2p_bytes_per_rank(sub, kv_bytes, kv_bytes, 1, q_bytes_per_token=q_bytes)[rank]
            assert expected > 0
            assert res[("auto", False)][1] >= expected  # the others add on top


def bf16_dkv_error(results, relative=True):
    """max |dK/dV with bf16 accumulators - reference| over all ranks and micro-batches,
    relative to the largest |dK| or |dV| of the micro-batch (or absolute)."""
    return max(
        max(max(e[2] / (e[4] if relative else 1), e[3] / (e[5] if relative else 1)) for e in res[("auto", True)][0])
        for res in results
    )


def test_two_level_matches_fused_attention_on_four_ranks():
    plan = four_rank_plan()
    results = run_local_world(run_plan_on_rank, 4, plan.to_json(), 0, timeout_s=TIMEOUT_S)
    _check(plan, results, divisible_mbs=[0, 1, 2])
    report("4 ranks", results)


def report(name, results):
    fp32 = [max(e[:4]) for r in results for e in r[("auto", False)][0]]
    fwd = [e[0] for r in results for e in r[("auto", False)][0]]
    print(
        f"\n{name}: max abs error fwd {max(fwd):.2e}, fwd+bwd {max(fp32):.2e}; bf16 dK/dV: max abs "
        f"{bf16_dkv_error(results, relative=False):.2e}, relative {bf16_dkv_error(results):.2e}"
    )


def test_two_level_matches_fused_attention_on_six_ranks():
    plan = six_rank_plan()
    results = run_local_world(run_plan_on_rank, 6, plan.to_json(), 1, timeout_s=TIMEOUT_S)
    _check(plan, results, divisible_mbs=[0])
    report("6 ranks", results)


def test_bytes_sent_are_what_the_plan_predicts():
    """Only micro-batches whose heads split evenly: the counted bytes equal the formula."""
    ring = (2, 3, 0, 1)
    a = ring_pieces(0, 37, ring, 2)
    plan = make_plan([37, 6], [[[a[ring.index(r)]] + ([whole_piece(1, 6, r)] if r == 1 else [])] for r in range(4)])
    results = run_local_world(run_plan_on_rank, 4, plan.to_json(), 2, timeout_s=TIMEOUT_S)
    expected = p2p_bytes_per_rank(plan, 2 * HKV * D * 4, 2 * HKV * D * 4, 1, q_bytes_per_token=HQ * D * 4)
    for rank, res in enumerate(results):
        assert max(max(e[:4]) for e in res[("auto", False)][0]) < ATOL
        assert res[("auto", False)][1] == expected[rank] > 0
        bf16_expected = p2p_bytes_per_rank(plan, 2 * HKV * D * 4, 2 * HKV * D * 2, 1, q_bytes_per_token=HQ * D * 4)
        assert res[("auto", True)][1] == bf16_expected[rank] < expected[rank]


# ----------------------------------------------------------------- one process, threads
@st.composite
def two_level_micro_batches(draw):
    """One ring micro-batch: N members in groups of u, random lengths, whole sequences beside."""
    u = draw(st.integers(2, 4))
    n = u * draw(st.integers(1, 3))
    ring = tuple(draw(st.permutations(range(n))))
    long = draw(st.lists(st.integers(n, 5 * n + 7), min_size=1, max_size=3))
    short = draw(st.lists(st.integers(1, 6), max_size=3))
    shares = [ring_pieces(sid, s, ring, u) for sid, s in enumerate(long)]
    owners = [draw(st.sampled_from(ring)) for _ in short]
    mbs = {}
    for idx, rank in enumerate(ring):
        pieces = [sh[idx] for sh in shares]
        pieces += [whole_piece(len(long) + i, s, rank) for i, (s, o) in enumerate(zip(short, owners)) if o == rank]
        mbs[rank] = MicroBatch(tuple(draw(st.permutations(pieces))))
    return long + short, ring, u, mbs


@settings(max_examples=12, deadline=None)
@given(two_level_micro_batches(), st.sampled_from(["torch", "auto"]), st.integers(0, 2**16))
def test_threaded_two_level_matches_fused_attention(case, backend, seed):
    """Any length, any u up to 4 (8 query / 4 KV heads: u = 3 divides neither), every member a thread."""
    lens, ring, u, mbs = case
    full = sequences(lens, seed)
    ref = reference(full)
    m = len(ring) // u
    groups, rings = [LocalGroup(u, TIMEOUT_S) for _ in range(m)], [LocalRing(m, TIMEOUT_S) for _ in range(u)]

    def member(rank):
        layout = MicroBatchLayout.from_micro_batch(mbs[rank], rank)
        gl = layout.groups
        q, k, v, g = (gather(full, layout, i).float() for i in range(4))
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        cross = rings[gl.place].member(gl.group_index) if m > 1 else SelfRing()
        out = two_level_with(
            q, k, v, layout, groups[gl.group_index].member(gl.place), cross, D**-0.5, get_backend(backend, q)
        )
        (out * g).sum().backward()
        got = [out, q.grad, k.grad, v.grad]
        return max((x.double() - gather(ref, layout, i)).abs().max().item() for i, x in enumerate(got))

    with ThreadPoolExecutor(len(ring)) as pool:
        assert max(pool.map(member, ring)) < ATOL


def test_head_slices_keep_query_heads_with_their_kv_heads():
    assert head_slices(8, 4, 2) == (((0, 1, 2, 3), (0, 1)), ((4, 5, 6, 7), (2, 3)))
    # u=3 divides neither: slices of whole groups take those KV heads, others one copy per query head
    assert head_slices(8, 4, 3) == (((0, 1), (0,)), ((2, 3, 4), (1, 1, 2)), ((5, 6, 7), (2, 3, 3)))
    for hq, hkv, u in ((8, 4, 3), (8, 4, 6), (4, 2, 4), (8, 1, 5)):
        slices = head_slices(hq, hkv, u)
        assert sorted(h for qs, _ in slices for h in qs) == list(range(hq))
        for qs, kvs in slices:
            group = len(qs) // len(kvs)
            assert [kvs[i // group] for i in range(len(qs))] == [h // (hq // hkv) for h in qs]
    with pytest.raises(PlanError, match="use heads_split <= 8"):
        head_slices(8, 4, 9)


def test_heads_split_must_divide_the_ring():
    pieces = ring_pieces(0, 20, (0, 1, 2), 2)
    with pytest.raises(PlanError, match="heads_split 2 does not divide its ring of 3"):
        make_plan([20], [[[p]] for p in pieces])
