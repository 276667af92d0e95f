"""Block attention for ring attention, and the online-softmax merge every block shares.

A block computation is one query block against one key/value block (``layout.TokenBlock``s:
which sequence and true position each row holds). Visibility is document-causal: a query
sees the keys of its own sequence at positions up to its own. Forward returns the block's
output and log-sum-exp (lse) in fp32, and ``merge`` folds blocks together exactly. Backward of
a block takes the *final* (merged) out and lse: with D = rowsum(dout * out) and
P = exp(S - lse), dV = P^T dout and dS = P * (dP - D), so per-block gradients simply add up.

Two backends share one interface, ``forward(q, k, v, qblock, kblock, scale) -> (out, lse)`` and
``backward(dout, q, k, v, out, lse, qblock, kblock, scale) -> (dq, dk, dv)``, each returning
None when nothing in the pair is visible. Shapes: q [Tq, hq, dk], k [Tk, hkv, dk], v [Tk, hkv, dv]
(GQA: hq % hkv == 0; dv may differ from dk, as in multi-latent attention), out [Tq, hq, dv],
lse [Tq, hq]; results fp32.

* ``TorchBackend``: dense math under the boolean visibility mask; any device and dtype.
* ``VarlenBackend``: flash-attention kernels through varlen calls — flash-attn or torch's
  built-in kernels on CUDA (fp16/bf16), torch's CPU flash kernels on the CPU. Zigzag makes
  every (query run, key run) pair of one sequence fully visible, causal, or invisible, so a
  block pair is at most two varlen calls (``varlen_calls``). These kernels take one head dim
  for q, k and v: a V narrower than K (multi-latent attention) is padded with zeros for the
  call, and only there (the output's extra columns are zero and dropped; the scores do not
  change); a wider V pads q and k instead.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import lru_cache

import torch

from ..errors import ConfigError, PlanError
from .layout import TokenBlock

NEG_INF = float("-inf")


# ----------------------------------------------------------------------- shared math
def merge(out: torch.Tensor | None, lse: torch.Tensor | None, block_out: torch.Tensor, block_lse: torch.Tensor):
    """Fold one block's (out, lse) into the running (out, lse); fp32, ``out`` updated in place.

    ``out=None`` starts the fold. Rows that no block has seen keep out 0 and lse -inf.
    """
    if out is None:
        return block_out.clone(), block_lse.clone()
    new_lse = torch.logaddexp(lse, block_lse)
    ref = _finite(new_lse)
    out.mul_(torch.exp(lse - ref).unsqueeze(-1)).add_(block_out * torch.exp(block_lse - ref).unsqueeze(-1))
    return out, new_lse


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """lse with -inf (rows that see nothing) replaced by 0, so exp(s - lse) is 0, not NaN."""
    return lse.masked_fill(lse == NEG_INF, 0.0)


def _grouped(x: torch.Tensor, hkv: int) -> torch.Tensor:
    """[T, hq, d] -> [T, hkv, group, d] fp32: GQA without repeating K/V."""
    t, hq, d = x.shape
    return x.float().reshape(t, hkv, hq // hkv, d)


def _scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Masked scores [hkv, group, Tq, Tk] in fp32."""
    s = torch.einsum("qhgd,khd->hgqk", _grouped(q, k.shape[1]), k.float()) * scale
    return s.masked_fill(~mask, NEG_INF)


def block_forward(q, k, v, mask: torch.Tensor, scale: float):
    """Attention of q over k/v where ``mask`` [Tq, Tk] is True -> fp32 (out, lse).

    Rows with no visible key get out 0 and lse -inf.
    """
    s = _scores(q, k, mask, scale)
    lse = torch.logsumexp(s, dim=-1)  # [hkv, g, Tq]
    p = torch.exp(s - _finite(lse).unsqueeze(-1))
    out = torch.einsum("hgqk,khd->qhgd", p, v.float())
    return out.reshape(*q.shape[:2], v.shape[-1]), lse.permute(2, 0, 1).reshape(q.shape[0], q.shape[1])


def block_backward(dout, q, k, v, out, lse, mask: torch.Tensor, scale: float):
    """Gradients of one block from the final ``out`` and ``lse`` -> fp32 (dq, dk, dv)."""
    tq, hq, _ = q.shape
    hkv = k.shape[1]
    to_hgq = lambda x: x.reshape(tq, hkv, hq // hkv).permute(1, 2, 0)  # noqa: E731  [Tq, hq] -> [hkv, g, Tq]
    p = torch.exp(_scores(q, k, mask, scale) - to_hgq(_finite(lse.float())).unsqueeze(-1))
    do = _grouped(dout, hkv)
    delta = to_hgq((dout.float() * out.float()).sum(-1))
    dv = torch.einsum("hgqk,qhgd->khd", p, do)
    ds = p * (torch.einsum("qhgd,khd->hgqk", do, v.float()) - delta.unsqueeze(-1))
    dq = torch.einsum("hgqk,khd->qhgd", ds, k.float()).reshape(q.shape) * scale
    dk = torch.einsum("hgqk,qhgd->khd", ds, _grouped(q, hkv)) * scale
    return dq, dk, dv


def visibility(qblock: TokenBlock, kblock: TokenBlock, device=None) -> torch.Tensor:
    """Document-causal mask [Tq, Tk]: same sequence and key position <= query position."""
    sq, pq = qblock.seq_ids.to(device), qblock.positions.to(device)
    sk, pk = kblock.seq_ids.to(device), kblock.positions.to(device)
    return (sq[:, None] == sk[None, :]) & (pk[None, :] <= pq[:, None])


class TorchBackend:
    name = "torch"

    def forward(self, q, k, v, qblock, kblock, scale):
        mask = visibility(qblock, kblock, q.device)
        return block_forward(q, k, v, mask, scale) if bool(mask.any()) else None

    def backward(self, dout, q, k, v, out, lse, qblock, kblock, scale):
        mask = visibility(qblock, kblock, q.device)
        return block_backward(dout, q, k, v, out, lse, mask, scale) if bool(mask.any()) else None


# ------------------------------------------------------------------- varlen structure
@dataclass(frozen=True)
class VarlenCall:
    """One varlen kernel call: per sequence a contiguous span of query rows and key rows."""

    causal: bool
    q_spans: tuple[tuple[int, int], ...]
    k_spans: tuple[tuple[int, int], ...]


@lru_cache(maxsize=256)
def call_tensors(call: VarlenCall, tq: int, tk: int, device: torch.device):
    """Device tensors of one call, made once per layout (no host-to-device copy per layer):
    query rows, key rows (None when a side is all rows in order), cu_seqlens_q/k, max lengths."""

    def rows(spans, total):
        if spans[0][0] == 0 and spans[-1][1] == total and all(a[1] == b[0] for a, b in zip(spans, spans[1:])):
            return None
        return torch.cat([torch.arange(a, b) for a, b in spans]).to(device)

    def cu(spans):
        return torch.tensor([0] + [b - a for a, b in spans], dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)

    return (
        rows(call.q_spans, tq),
        rows(call.k_spans, tk),
        cu(call.q_spans),
        cu(call.k_spans),
        max(b - a for a, b in call.q_spans),
        max(b - a for a, b in call.k_spans),
    )


@lru_cache(maxsize=4096)
def varlen_calls(qblock: TokenBlock, kblock: TokenBlock) -> tuple[VarlenCall, ...]:
    """Split a block pair into at most one causal and one non-causal varlen call.

    Per sequence: identical runs on both sides -> causal over the whole span (rows ascend in
    position, so row order is position order); otherwise every (query run, key run) pair
    must be fully visible or invisible, and the visible ones must form one rectangle of
    contiguous query rows x contiguous key rows. Zigzag shares always satisfy this.
    """
    kruns: dict[int, list] = {}
    for run in kblock.row_runs:
        kruns.setdefault(run[0], []).append(run)
    qruns: dict[int, list] = {}
    for run in qblock.row_runs:
        qruns.setdefault(run[0], []).append(run)
    entries = {True: ([], []), False: ([], [])}
    for sid, qs in qruns.items():
        ks = kruns.get(sid)
        if not ks:
            continue
        if [r[1:3] for r in qs] == [r[1:3] for r in ks]:
            entries[True][0].append(_span(qs))
            entries[True][1].append(_span(ks))
            continue
        qsel, ksel = [], []
        for qr in qs:
            for kr in ks:
                if kr[2] <= qr[1]:  # every key before every query: fully visible
                    qsel += [qr] if qr not in qsel else []
                    ksel += [kr] if kr not in ksel else []
                elif kr[1] < qr[2]:  # overlapping but not identical: not a zigzag pair
                    raise PlanError(
                        f"sequence {sid}: query positions {qr[1:3]} and key positions {kr[1:3]} overlap partially"
                    )
        if not qsel:
            continue
        if any(kr[2] > qr[1] for qr in qsel for kr in ksel):
            raise PlanError(f"sequence {sid}: visible runs {qsel} x {ksel} are not one fully visible rectangle")
        entries[False][0].append(_span(sorted(qsel, key=lambda r: r[3])))
        entries[False][1].append(_span(sorted(ksel, key=lambda r: r[3])))
    return tuple(VarlenCall(c, tuple(qsp), tuple(ksp)) for c, (qsp, ksp) in entries.items() if qsp)


def _span(runs) -> tuple[int, int]:
    """Rows covered by runs that must sit back to back."""
    for a, b in zip(runs, runs[1:]):
        if a[3] + a[2] - a[1] != b[3]:
            raise PlanError(
                f"sequence {a[0]}: runs {a[1:3]} and {b[1:3]} are not adjacent rows; cannot form one varlen span"
            )
    return runs[0][3], runs[-1][3] + runs[-1][2] - runs[-1][1]


class VarlenBackend:
    """Block attention through a varlen flash kernel (the contract is under "flash kernels" below)."""

    name = "flash"

    def __init__(self, kernel):
        self.kernel = kernel

    def forward(self, q, k, v, qblock, kblock, scale):
        calls = varlen_calls(qblock, kblock)
        if not calls:
            return None
        dv, width = v.shape[-1], max(q.shape[-1], v.shape[-1])
        q, k, v = (_pad_head_dim(x, width) for x in (q, k, v))
        out = torch.zeros(*q.shape[:2], dv, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:2], NEG_INF, dtype=torch.float32, device=q.device)
        for call in calls:
            qrows, krows, *meta = call_tensors(call, q.shape[0], k.shape[0], q.device)
            o, l = self.kernel.forward(_take(q, qrows), _take(k, krows), _take(v, krows), *meta, scale, call.causal)
            o = o[..., :dv]
            if qrows is None:
                out, lse = o.float(), l.t().float()
            else:
                out.index_copy_(0, qrows, o.float())
                lse.index_copy_(0, qrows, l.t().float())
        return out, lse

    def backward(self, dout, q, k, v, out, lse, qblock, kblock, scale):
        calls = varlen_calls(qblock, kblock)
        if not calls:
            return None
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
        dk_dim, dv_dim = k.shape[-1], v.shape[-1]
        width = max(dk_dim, dv_dim)
        q, k, v, dout, out = (_pad_head_dim(x, width) for x in (q, k, v, dout, out))
        for call in calls:
            qrows, krows, *meta = call_tensors(call, q.shape[0], k.shape[0], q.device)
            dqc, dkc, dvc = self.kernel.backward(
                _take(dout, qrows),
                _take(q, qrows),
                _take(k, krows),
                _take(v, krows),
                _take(out, qrows),
                _take(lse, qrows).t().contiguous(),
                *meta,
                scale,
                call.causal,
            )
            _add_rows(dq, qrows, dqc[..., :dk_dim])
            _add_rows(dk, krows, dkc[..., :dk_dim])
            _add_rows(dv, krows, dvc[..., :dv_dim])
        return dq, dk, dv


def _pad_head_dim(x: torch.Tensor, width: int) -> torch.Tensor:
    """``x`` [T, h, d] with zero columns up to ``width`` (the flash kernels take one head dim for
    q, k and v: zero V columns give zero output columns, zero q/k columns add nothing to the
    scores, zero dout columns change no gradient)."""
    return x if x.shape[-1] >= width else torch.nn.functional.pad(x, (0, width - x.shape[-1]))


def _take(x, rows):
    return x if rows is None else x.index_select(0, rows)


def _add_rows(dst, rows, src):
    if rows is None:
        dst.add_(src.float())
    else:
        dst.index_add_(0, rows, src.float())


# ----------------------------------------------------------------------- flash kernels
# A FlashKernel has
#   forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal) -> (out [Tq, hq, d] in q's dtype, lse [hq, Tq] fp32)
#   backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal) -> (dq, dk, dv)
# with q [Tq, hq, d], k/v [Tk, hkv, d] packed by cu_q / cu_k (int32) and backward taking the
# final out and lse. Two providers: the flash-attn package, and the FlashAttention-2 kernels
# built into CUDA torch (what SDPA uses), which needs no extra package.


class FlashAttnPackageKernel:
    """flash-attn 2.x (``flash_attn.flash_attn_interface``), arguments matched by name across versions."""

    def __init__(self):
        from flash_attn import flash_attn_interface as fa  # noqa: PLC0415 - optional GPU dependency

        self._fwd, self._bwd = fa._flash_attn_varlen_forward, fa._flash_attn_varlen_backward
        # 2.7+ wraps them as torch custom ops; their Python signature is on ``_init_fn``
        self._fwd_params = set(inspect.signature(getattr(self._fwd, "_init_fn", self._fwd)).parameters)
        self._bwd_params = set(inspect.signature(getattr(self._bwd, "_init_fn", self._bwd)).parameters)

    def _kwargs(self, names, **given):
        common = dict(
            dropout_p=0.0,
            window_size=(-1, -1),
            window_size_left=-1,
            window_size_right=-1,
            softcap=0.0,
            alibi_slopes=None,
            deterministic=False,
            return_softmax=False,
            block_table=None,
            rng_state=None,
        )
        return {n: v for n, v in {**common, **given}.items() if n in names}

    def forward(self, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal):
        res = self._fwd(
            **self._kwargs(
                self._fwd_params,
                q=q.contiguous(),
                k=k.contiguous(),
                v=v.contiguous(),
                cu_seqlens_q=cu_q,
                cu_seqlens_k=cu_k,
                max_seqlen_q=max_q,
                max_seqlen_k=max_k,
                softmax_scale=scale,
                causal=causal,
            )
        )
        # 2.7+: (out, lse, S_dmask, rng_state); 2.6: (out, q, k, v, out_padded, lse, S_dmask, rng_state)
        return res[0], (res[1] if len(res) == 4 else res[5])

    def backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal):
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        self._bwd(
            **self._kwargs(
                self._bwd_params,
                dout=dout.contiguous(),
                q=q.contiguous(),
                k=k.contiguous(),
                v=v.contiguous(),
                out=out.contiguous(),
                softmax_lse=lse,
                dq=dq,
                dk=dk,
                dv=dv,
                cu_seqlens_q=cu_q,
                cu_seqlens_k=cu_k,
                max_seqlen_q=max_q,
                max_seqlen_k=max_k,
                softmax_scale=scale,
                causal=causal,
            )
        )
        return dq, dk, dv


class TorchFlashKernel:
    """The FlashAttention-2 varlen kernels inside CUDA builds of torch (``aten::_flash_attention_*``)."""

    def forward(self, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal):
        out, lse, *_ = torch.ops.aten._flash_attention_forward(
            q.contiguous(), k.contiguous(), v.contiguous(), cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale
        )
        return out, lse

    def backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal):
        unused = torch.empty(0, dtype=torch.uint64, device=q.device)  # dropout RNG state: read only when dropout > 0
        return torch.ops.aten._flash_attention_backward(
            dout.contiguous(),
            q.contiguous(),
            k.contiguous(),
            v.contiguous(),
            out.contiguous(),
            lse,
            cu_q,
            cu_k,
            max_q,
            max_k,
            0.0,
            causal,
            unused,
            unused,
            scale=scale,
        )


class CpuFlashKernel:
    """torch's CPU flash-attention kernels (what SDPA runs on the CPU), which also return the
    log-sum-exp: one call per sequence span, K/V heads repeated for GQA (and their gradients
    summed back). Exact in fp32 and far faster than the dense masked math."""

    _fwd = staticmethod(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu)
    _bwd = staticmethod(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward)

    @staticmethod
    def _spans(cu_q, cu_k):
        return zip(zip(cu_q.tolist(), cu_q.tolist()[1:]), zip(cu_k.tolist(), cu_k.tolist()[1:]))

    @staticmethod
    def _heads_first(x: torch.Tensor, repeat: int = 1) -> torch.Tensor:
        """[T, h, d] -> [1, h * repeat, T, d] (each head repeated ``repeat`` times in place)."""
        if repeat > 1:
            x = x.repeat_interleave(repeat, dim=1)
        return x.transpose(0, 1).unsqueeze(0)

    def forward(self, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal):
        group = q.shape[1] // k.shape[1]
        outs, lses = [], []
        for (qa, qe), (ka, ke) in self._spans(cu_q, cu_k):
            o, lse = self._fwd(
                self._heads_first(q[qa:qe]),
                self._heads_first(k[ka:ke], group),
                self._heads_first(v[ka:ke], group),
                0.0,
                causal,
                scale=scale,
            )
            outs.append(o[0].transpose(0, 1))
            lses.append(lse[0])
        return torch.cat(outs), torch.cat(lses, dim=1)

    def backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal):
        hkv, group = k.shape[1], q.shape[1] // k.shape[1]
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        for (qa, qe), (ka, ke) in self._spans(cu_q, cu_k):
            gq, gk, gv = self._bwd(
                self._heads_first(dout[qa:qe]),
                self._heads_first(q[qa:qe]),
                self._heads_first(k[ka:ke], group),
                self._heads_first(v[ka:ke], group),
                self._heads_first(out[qa:qe]),
                lse[:, qa:qe].unsqueeze(0).contiguous(),
                0.0,
                causal,
                scale=scale,
            )
            dq[qa:qe] = gq[0].transpose(0, 1)
            dk[ka:ke] = gk[0].transpose(0, 1).reshape(ke - ka, hkv, group, -1).sum(2)
            dv[ka:ke] = gv[0].transpose(0, 1).reshape(ke - ka, hkv, group, -1).sum(2)
        return dq, dk, dv


CPU_FLASH_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def flash_kernel(q: torch.Tensor):
    """A varlen flash kernel usable for ``q``, or None (unsupported dtype, head dim or GPU)."""
    if q.device.type == "cpu":
        return CpuFlashKernel() if q.dtype in CPU_FLASH_DTYPES else None
    if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
        return None
    if q.shape[-1] % 8 or q.shape[-1] > 256 or torch.cuda.get_device_capability(q.device)[0] < 8:
        return None
    return _flash_provider()


@lru_cache(maxsize=1)
def _flash_provider():
    try:
        return FlashAttnPackageKernel()
    except ImportError:
        pass
    return TorchFlashKernel() if torch.backends.cuda.is_flash_attention_available() else None


TORCH_BACKEND = TorchBackend()


def get_backend(name: str, q: torch.Tensor):
    """``"torch"``, ``"flash"`` (error if unusable for q), or ``"auto"`` (flash when usable)."""
    if name == "torch":
        return TORCH_BACKEND
    if name not in ("auto", "flash"):
        raise ConfigError(f"unknown attention backend {name!r}; choose 'auto', 'flash' or 'torch'")
    kernel = flash_kernel(q)
    if kernel is not None:
        return VarlenBackend(kernel)
    if name == "flash":
        raise ConfigError(
            f"attention backend 'flash' needs CPU tensors or CUDA fp16/bf16 tensors with head dim a multiple of 8 "
            f"up to 256 on an sm80+ GPU (got {q.dtype} on {q.device}, head dim {q.shape[-1]}); use backend='torch' or "
            "'auto'"
        )
    return TORCH_BACKEND
