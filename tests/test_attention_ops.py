"""Single-process kernel tests: block forward/backward + merge against plain masked attention,
and the varlen call split against the dense mask (through a CPU stand-in for the flash kernel)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_bytescale.errors import ConfigError, PlanError
from megatron_bytescale.planner.contract import MicroBatch, ring_pieces, whole_piece
from megatron_bytescale.runtime.attention_ops import (
    TORCH_BACKEND,
    CpuFlashKernel,
    TorchBackend,
    VarlenBackend,
    block_backward,
    block_forward,
    get_backend,
    merge,
    varlen_calls,
)
from megatron_bytescale.runtime.layout import MicroBatchLayout, TokenBlock

ATOL = 1e-5


def reference(q, k, v, mask, scale):
    """Plain masked softmax attention (float64, GQA by repeating K/V); empty rows give 0 and lse -inf."""
    g = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = torch.einsum("qhd,khd->hqk", q, kk) * scale
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, -1).t()
    seen = mask.any(-1)[None, :, None]
    p = torch.where(seen, torch.where(seen, s, 0.0).softmax(-1), 0.0)
    return torch.einsum("hqk,khd->qhd", p, vv), lse


def tensors(seed, tq, tk, hq, hkv, d):
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    return rnd(tq, hq, d), rnd(tk, hkv, d), rnd(tk, hkv, d), rnd(tq, hq, d)


@st.composite
def masked_problem(draw):
    tq, tk = draw(st.integers(1, 6)), draw(st.integers(1, 9))
    hkv, group, d = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 5))
    mask = torch.tensor(draw(st.lists(st.booleans(), min_size=tq * tk, max_size=tq * tk))).reshape(tq, tk)
    if draw(st.booleans()):
        mask[draw(st.integers(0, tq - 1))] = False  # a row that sees nothing
    cuts = sorted(draw(st.sets(st.integers(1, tk - 1), max_size=3))) if tk > 1 else []
    order = draw(st.permutations(range(len(cuts) + 1)))
    return tensors(draw(st.integers(0, 2**16)), tq, tk, hkv * group, hkv, d), mask, [0, *cuts, tk], order


@settings(max_examples=60, deadline=None)
@given(masked_problem())
def test_blocks_merged_in_any_order_equal_full_attention(problem):
    (q, k, v, dout), mask, bounds, order = problem
    scale = q.shape[-1] ** -0.5
    out = lse = None
    for b in order:
        a, e = bounds[b], bounds[b + 1]
        out, lse = merge(out, lse, *block_forward(q, k[a:e], v[a:e], mask[:, a:e], scale))
    ref_out, ref_lse = reference(q, k, v, mask, scale)
    assert not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(out.double(), ref_out, atol=ATOL, rtol=0)
    assert torch.equal(lse == float("-inf"), ref_lse == float("-inf"))
    finite = ref_lse.isfinite()
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], atol=ATOL, rtol=0)


@settings(max_examples=60, deadline=None)
@given(masked_problem())
def test_block_gradients_from_the_final_lse_add_up_to_full_gradients(problem):
    (q, k, v, dout), mask, bounds, _ = problem
    scale = q.shape[-1] ** -0.5
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    ref_out, ref_lse = reference(q, k, v, mask, scale)
    (ref_out * dout).sum().backward()
    dq = torch.zeros(q.shape)
    dk, dv = [], []
    for a, e in zip(bounds, bounds[1:]):
        gq, gk, gv = block_backward(
            dout, q.detach(), k.detach()[a:e], v.detach()[a:e], ref_out.detach(), ref_lse, mask[:, a:e], scale
        )
        dq += gq
        dk.append(gk)
        dv.append(gv)
    for got, want in ((dq, q.grad), (torch.cat(dk), k.grad), (torch.cat(dv), v.grad)):
        assert not got.isnan().any()
        torch.testing.assert_close(got.double(), want, atol=ATOL, rtol=0)


def test_merge_of_two_empty_rows_stays_empty():
    out = torch.zeros(1, 1, 2)
    lse = torch.full((1, 1), float("-inf"))
    out, lse = merge(out, lse, torch.zeros(1, 1, 2), torch.full((1, 1), float("-inf")))
    assert lse.item() == float("-inf") and out.abs().sum() == 0


# ------------------------------------------------------------- varlen call structure
class CpuVarlenKernel:
    """A dense CPU stand-in for a flash varlen kernel (same contract, flash's bottom-right causal)."""

    @staticmethod
    def _mask(cu_q, cu_k, causal):
        tq, tk = int(cu_q[-1]), int(cu_k[-1])
        mask = torch.zeros(tq, tk, dtype=torch.bool)
        for b in range(len(cu_q) - 1):
            qa, qe, ka, ke = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
            sub = torch.ones(qe - qa, ke - ka, dtype=torch.bool)
            if causal:
                sub = sub.tril(ke - ka - (qe - qa))
            mask[qa:qe, ka:ke] = sub
        return mask

    def forward(self, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal):
        assert max_q == int((cu_q[1:] - cu_q[:-1]).max()) and max_k == int((cu_k[1:] - cu_k[:-1]).max())
        out, lse = block_forward(q, k, v, self._mask(cu_q, cu_k, causal), scale)
        return out.to(q.dtype), lse.t().contiguous()

    def backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal):
        return block_backward(dout, q, k, v, out, lse.t(), self._mask(cu_q, cu_k, causal), scale)


@st.composite
def ring_layouts(draw):
    """Layouts of every member of a random ring micro-batch (plus local sequences on member 0)."""
    n = draw(st.integers(1, 4))
    lens = draw(st.lists(st.integers(n, 3 * n + 5), min_size=1, max_size=3))
    ring = tuple(draw(st.permutations(range(n))))
    shares = [ring_pieces(sid, s, ring) for sid, s in enumerate(lens)] if n > 1 else []
    local = [whole_piece(10 + i, s, ring[0]) for i, s in enumerate(draw(st.lists(st.integers(1, 6), max_size=2)))]
    if n == 1 and not local:
        local = [whole_piece(0, lens[0], ring[0])]
    layouts = []
    for idx, rank in enumerate(ring):
        pieces = [sh[idx] for sh in shares] + (local if idx == 0 else [])
        layouts.append(MicroBatchLayout.from_micro_batch(MicroBatch(tuple(draw(st.permutations(pieces)))), rank))
    return layouts


@settings(max_examples=25, deadline=None)
@given(ring_layouts(), st.integers(0, 2**16), st.sampled_from(["stand-in", "cpu-flash"]))
def test_varlen_calls_compute_what_the_dense_mask_computes(layouts, seed, kernel):
    varlen = VarlenBackend(CpuVarlenKernel() if kernel == "stand-in" else CpuFlashKernel())
    lay = layouts[0]
    pairs = [(lay.local_block, lay.local_block)] if lay.local_block.runs else []
    pairs += [(qb, kb) for qb in lay.blocks for kb in lay.blocks]
    for i, (qb, kb) in enumerate(pairs):
        q, k, v, dout = (x.float() for x in tensors(seed + i, qb.num_tokens, kb.num_tokens, 4, 2, 3))
        dense = TorchBackend().forward(q, k, v, qb, kb, 0.5)
        got = varlen.forward(q, k, v, qb, kb, 0.5)
        assert (dense is None) == (got is None)
        if dense is None:
            continue
        torch.testing.assert_close(got[0], dense[0], atol=ATOL, rtol=0)
        assert torch.equal(got[1] == float("-inf"), dense[1] == float("-inf"))
        torch.testing.assert_close(got[1].clamp_min(-1e4), dense[1].clamp_min(-1e4), atol=ATOL, rtol=0)
        out, lse = dense
        for g, want in zip(
            varlen.backward(dout, q, k, v, out, lse, qb, kb, 0.5),
            TORCH_BACKEND.backward(dout, q, k, v, out, lse, qb, kb, 0.5),
        ):
            torch.testing.assert_close(g, want, atol=ATOL, rtol=0)


def test_zigzag_block_pairs_are_one_call_causal_only_on_the_diagonal():
    ring = (0, 1, 2, 3)
    blocks = MicroBatchLayout.from_micro_batch(
        MicroBatch((ring_pieces(0, 29, ring)[0], ring_pieces(1, 11, ring)[0])), 0
    ).blocks
    for i, qb in enumerate(blocks):
        for j, kb in enumerate(blocks):
            calls = varlen_calls(qb, kb)
            assert [c.causal for c in calls] == [i == j]
            assert len(calls[0].q_spans) == 2  # one span per sequence


def test_non_zigzag_runs_are_refused():
    with pytest.raises(PlanError, match="overlap partially"):
        varlen_calls(TokenBlock(((0, 0, 4),)), TokenBlock(((0, 2, 6),)))
    with pytest.raises(PlanError, match="rectangle"):
        varlen_calls(TokenBlock(((0, 2, 4), (0, 6, 8))), TokenBlock(((0, 0, 1), (0, 4, 6))))


def test_backend_choice():
    q = torch.zeros(2, 2, 8)
    for name in ("auto", "flash"):  # CPU: torch's CPU flash kernels through varlen calls
        backend = get_backend(name, q)
        assert isinstance(backend, VarlenBackend) and isinstance(backend.kernel, CpuFlashKernel)
    assert get_backend("torch", q) is TORCH_BACKEND
    assert get_backend("auto", q.to(torch.int32)) is TORCH_BACKEND  # no flash kernel for this dtype
    with pytest.raises(ConfigError, match="needs CPU tensors or CUDA"):
        get_backend("flash", q.to(torch.int32))
    with pytest.raises(ConfigError, match="unknown attention backend"):
        get_backend("triton", q)
