"""Ring attention for multi-latent attention (MLA), without Megatron: K and V of different head
dims over plain and two-level rings, the latent ring (the latent and rotary key travel, each
member re-expands them), the bytes each transport sends, the Plan's ring transport, and the
shift along documents across ring members that multi-token prediction rolls with.

One launch of five gloo ranks runs every case against an independent reference: fp64 autograd
of each whole sequence, K and V made from the latent by the up-projection, as MLA makes them."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_bytescale.errors import PlanError
from megatron_bytescale.local_world import run_local_world
from megatron_bytescale.planner.contract import MicroBatch, Plan, ring_pieces, whole_piece
from megatron_bytescale.planner.planner import PlannerConfig, plan_step
from megatron_bytescale.planner.ring_traffic import p2p_bytes_per_rank
from megatron_bytescale.runtime.document_roll import roll_within_documents
from megatron_bytescale.runtime.layout import MicroBatchLayout
from megatron_bytescale.runtime.ring_attention import MLALatent, ring_attention
from megatron_bytescale.runtime.ring_comm import P2PCounter

from planner_cases import draw_lengths, small_cost

# heads, no-rope / rope / value head dims, latent rank: K is 12 wide, V 6 (DeepSeek-V3's 192 and 128)
H, DN, DPE, DV, R = 3, 8, 4, 6, 10
TOL = 1e-5  # relative to the largest reference value: fp32 block math against fp64
TIMEOUT_S = 120


def five_rank_plan(transport: str) -> Plan:
    """Rings of 2, 3, 4 and 5 members with whole sequences beside, and (K and V only) a
    two-level ring of 4 in groups of 2; lengths divisible by nothing in particular."""
    rings = {5: (0, 1, 2, 3, 4), 4: (1, 2, 3, 4), 3: (4, 0, 1), 2: (2, 3)}
    lens = [47, 29, 17, 11, 5, 9, 3, 23]
    five = ring_pieces(0, 47, rings[5], transport=transport)
    four = ring_pieces(1, 29, rings[4], transport=transport)
    three = ring_pieces(2, 17, rings[3], transport=transport)
    two = ring_pieces(3, 11, rings[2], transport=transport)
    split = ring_pieces(7, 23, rings[4], heads_split=2)  # two-level: always K and V
    at = lambda pieces, ring, r: pieces[ring.index(r)]  # noqa: E731
    mbs = [[[at(five, rings[5], r)]] for r in range(5)]
    mbs[0] += [[at(three, rings[3], 0), whole_piece(4, 5, 0)]]
    mbs[1] += [[at(four, rings[4], 1)], [at(three, rings[3], 1)], [at(split, rings[4], 1)]]
    mbs[2] += [[at(four, rings[4], 2)], [at(two, rings[2], 2), whole_piece(5, 9, 2)], [at(split, rings[4], 2)]]
    mbs[3] += [[at(four, rings[4], 3)], [at(two, rings[2], 3)], [at(split, rings[4], 3)]]
    mbs[4] += [[at(four, rings[4], 4)], [at(three, rings[3], 4), whole_piece(6, 3, 4)], [at(split, rings[4], 4)]]
    ranks = tuple(tuple(MicroBatch(tuple(p)) for p in rank) for rank in mbs)
    return Plan(5, 64, 1, tuple(lens), ranks).validate()


def tensors(seq_lens, seed):
    gen = torch.Generator().manual_seed(seed)
    draw = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    per_seq = {sid: (draw(s, R), draw(s, DPE), draw(s, H, DN + DPE), draw(s, H, DV)) for sid, s in enumerate(seq_lens)}
    return per_seq, draw(H * (DN + DV), R) * 0.3


def expand(latent, rope_key, weight):
    """MLA's K and V: the up-projection of the latent per head, the rotary key shared by the heads."""
    kv = (latent @ weight.t()).view(latent.shape[0], H, DN + DV)
    return torch.cat([kv[..., :DN], rope_key[:, None].expand(-1, H, -1)], -1), kv[..., DN:]


def reference(per_seq, weight, scale):
    """Per sequence: out and the gradients of sum(out * g) for q, latent, rotary key; and dW of all."""
    w = weight.clone().requires_grad_()
    result = {}
    for sid, (c, kpe, q, g) in per_seq.items():
        c, kpe, q = (x.clone().requires_grad_() for x in (c, kpe, q))
        k, v = expand(c, kpe, w)
        s = c.shape[0]
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
        out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
        (out * g).sum().backward()
        result[sid] = (out.detach(), q.grad, c.grad, kpe.grad)
    return result, w.grad


def _rows(per_seq, layout, i):
    return torch.stack([per_seq[s][i][p] for s, p in zip(layout.seq_ids.tolist(), layout.positions.tolist())])


def run_rank(rank, world_size, plans, seed):
    """Every micro-batch of each plan: errors against the reference, bytes per transport, dW."""
    scale = (DN + DPE) ** -0.5
    out = {}
    for name, plan_json in plans.items():
        plan = Plan.from_json(plan_json)
        per_seq, weight = tensors(plan.seq_lens, seed)
        ref, ref_dw = reference(per_seq, weight, scale)
        counters = {"plain": P2PCounter(), "two-level": P2PCounter()}
        errors, dweight = [], torch.zeros_like(weight)
        for backend in ("torch", "flash"):
            for mb in plan.micro_batches(rank):
                layout = MicroBatchLayout.from_micro_batch(mb, rank)
                c, kpe, q, g = (_rows(per_seq, layout, i).float() for i in range(4))
                c, kpe, q = (x.requires_grad_() for x in (c, kpe, q))
                w = weight.float().requires_grad_()
                k, v = expand(c, kpe, w)
                counter = counters["two-level" if layout.heads_split > 1 else "plain"]
                o = ring_attention(
                    q, k, v, layout, softmax_scale=scale, backend=backend, counter=counter, latent=MLALatent(c, w, DPE)
                )
                (o * g).sum().backward()
                for got, i in ((o, 0), (q.grad, 1), (c.grad, 2), (kpe.grad, 3)):
                    want = _rows(ref, layout, i)
                    errors.append(float((got.double() - want).abs().max() / want.abs().max()))
                if backend == "torch":
                    dweight += w.grad.double()
        out[name] = {
            "errors": errors,
            "bytes": {kind: dict(c.by_transport) for kind, c in counters.items()},
            "dweight": dweight,
            "ref_dweight": ref_dw,
        }
    out["roll"] = roll_errors(rank, Plan.from_json(plans["kv"]))
    return out


def roll_errors(rank, plan):
    """Three shifts along documents (multi-token prediction's depths) of int, float and bool
    tensors against shifting each whole document; the largest difference."""
    worst = 0.0
    for mb in plan.micro_batches(rank):
        layout = MicroBatchLayout.from_micro_batch(mb, rank)
        whole = {s: torch.arange(1, n + 1, dtype=torch.float64) * (s + 1) for s, n in enumerate(plan.seq_lens)}
        x = torch.stack([whole[s][p] for s, p in zip(layout.seq_ids.tolist(), layout.positions.tolist())])[None]
        for dtype in (torch.int64, torch.float32, torch.bool):
            rolled, want = x.to(dtype), {s: t for s, t in whole.items()}
            for _ in range(3):
                rolled = roll_within_documents(rolled, layout)
                want = {s: torch.cat([t[1:], t.new_zeros(1)]) for s, t in want.items()}
                expected = torch.stack([want[s][p] for s, p in zip(layout.seq_ids.tolist(), layout.positions.tolist())])
                worst = max(worst, float((rolled[0].double() - expected.to(dtype).double()).abs().max()))
    return worst


@pytest.fixture(scope="module")
def results():
    plans = {t: five_rank_plan(t).to_json() for t in ("kv", "latent")}
    return plans, run_local_world(run_rank, 5, plans, 3, timeout_s=TIMEOUT_S)


@pytest.mark.parametrize("transport", ["kv", "latent"])
def test_both_transports_match_one_attention_per_sequence(results, transport):
    """out, dQ, d(latent), d(rotary key) of every token and the up-projection's gradient summed
    over ranks (as the gradient reduction sums it), both backends (the flash one pads V)."""
    _, per_rank = results
    worst = max(max(r[transport]["errors"]) for r in per_rank)
    dweight = sum(r[transport]["dweight"] for r in per_rank)
    ref = per_rank[0][transport]["ref_dweight"]
    dw_err = float((dweight - ref).abs().max() / ref.abs().max())
    print(f"\n{transport} ring: max relative error {worst:.2e}, up-projection gradient {dw_err:.2e}")
    assert worst < TOL and dw_err < TOL


def test_each_transport_sends_what_the_plan_predicts(results):
    """Per member, on its plain rings: the bytes of its K/V (or latent) blocks forward and
    backward and of the accumulators; the latent ring sends (r + dpe) / (H * (dk + dv)) of the
    K/V ring's bytes (the same blocks and hops, narrower tokens). Two-level rings carry K and V
    under either plan."""
    plans, per_rank = results
    widths = {"kv": H * (DN + DPE + DV), "latent": R + DPE}
    totals = {}
    for transport, width in widths.items():
        plain = _plain_rings(Plan.from_json(plans[transport]))
        latent = widths["latent"] * 4  # what a latent ring's blocks and accumulators weigh per token (fp32)
        predicted = p2p_bytes_per_rank(
            plain, width * 4, width * 4, 1, latent_bytes_per_token=latent, latent_grad_bytes_per_token=latent
        )
        for rank, res in enumerate(per_rank):
            sent = res[transport]["bytes"]
            assert sent["plain"] == {transport: 2 * predicted[rank]}  # both backends ran every micro-batch
            assert set(sent["two-level"]) == ({"kv"} if rank else set())
        totals[transport] = sum(r[transport]["bytes"]["plain"][transport] for r in per_rank)
    assert totals["latent"] * widths["kv"] == totals["kv"] * widths["latent"] > 0


def _plain_rings(plan: Plan) -> Plan:
    ranks = tuple(tuple(mb for mb in mbs if mb.heads_split == 1) for mbs in plan.ranks)
    return Plan(plan.num_ranks, plan.capacity, 1, plan.seq_lens, ranks)


def test_the_shift_along_documents_crosses_members_and_chunks(results):
    _, per_rank = results
    assert max(r["roll"] for r in per_rank) == 0.0


def test_the_plan_carries_each_rings_transport():
    plan = five_rank_plan("kv")
    latent = plan.with_ring_transport("latent")
    for mbs in latent.ranks:
        for mb in mbs:
            expected = "latent" if mb.ring is not None and mb.heads_split == 1 else "kv"
            assert mb.transport == expected and all(p.transport == expected for p in mb.pieces if p.is_distributed)
    assert Plan.from_json(latent.to_json()).to_dict() == latent.validate().to_dict()
    assert '"transport":"latent"' in latent.to_json() and '"transport"' not in plan.to_json()  # default omitted
    assert latent.with_ring_transport("latent") is latent and plan.with_ring_transport("kv") is plan
    with pytest.raises(PlanError, match="unknown ring transport"):
        plan.with_ring_transport("values")


@st.composite
def planned_batches(draw):
    rpn = draw(st.sampled_from([1, 2, 4]))
    ranks = rpn * draw(st.integers(1, 4))  # whole nodes
    capacity = draw(st.sampled_from([64, 100, 256]))
    lens = draw_lengths(draw, capacity, ranks, max_short=20, max_long=6)
    return lens, dict(num_ranks=ranks, capacity=capacity, ranks_per_node=rpn, offload=False)


@settings(max_examples=60, deadline=None)
@given(planned_batches())
def test_the_planner_sets_the_configured_transport_on_every_plain_ring(case):
    """The same placement whatever the ring transport; with "latent" every plain ring's pieces
    carry it, two-level rings and whole sequences K and V; the plan stays valid."""
    lens, config = case
    cost = small_cost(q_heads=8, kv_heads=8)
    kv = plan_step(lens, PlannerConfig(**config), cost)
    latent = plan_step(lens, PlannerConfig(**config, ring_transport="latent"), cost).validate()
    strip = lambda plan: {k: v for k, v in plan.to_dict().items() if k != "meta"}  # noqa: E731
    assert strip(latent.with_ring_transport("kv")) == strip(kv)
    for mbs in latent.ranks:
        for mb in mbs:
            for p in mb.pieces:
                assert p.transport == ("latent" if p.is_distributed and p.heads_split == 1 else "kv")


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda p: p.__dict__.update(transport="latent") if not p.is_distributed else None, "needs a plain ring"),
        (lambda p: p.__dict__.update(transport="latent") if p.heads_split > 1 else None, "needs a plain ring"),
        (lambda p: p.__dict__.update(transport="packed") if p.ring_size == 5 else None, "is not one of"),
        (
            lambda p: p.__dict__.update(transport="latent") if p.ranges[0][0] == 0 and p.ring_size == 3 else None,
            "disagree",
        ),
    ],
    ids=["whole sequence", "two-level ring", "unknown", "members disagree"],
)
def test_invalid_transports_are_refused(edit, message):
    plan = five_rank_plan("kv")
    for mbs in plan.ranks:
        for mb in mbs:
            for p in mb.pieces:
                edit(p)
    with pytest.raises(PlanError, match=message):
        plan.validate()


def test_a_latent_ring_without_a_latent_is_a_plan_error():
    plan = five_rank_plan("latent")
    layout = MicroBatchLayout.from_micro_batch(plan.micro_batches(0)[0], 0)
    q = k = torch.zeros(layout.num_tokens, H, DN + DPE)
    with pytest.raises(PlanError, match="only multi-latent attention"):
        ring_attention(q, k, torch.zeros(layout.num_tokens, H, DV), layout)
