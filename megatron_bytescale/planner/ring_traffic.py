"""Bytes each rank sends in ring attention: the runtime's ring passes, counted."""

from __future__ import annotations

from ..errors import PlanError
from .contract import Plan, rank_tokens


def p2p_bytes_per_rank(
    plan: Plan,
    kv_bytes_per_token: float,
    grad_bytes_per_token: float,
    num_layers: int,
    backward: bool = True,
    recomputed_layers: int = 0,
    q_bytes_per_token: float = 0.0,
    latent_bytes_per_token: float | None = None,
    latent_grad_bytes_per_token: float | None = None,
    o_bytes_per_token: float | None = None,
) -> list[float]:
    """Bytes each rank sends in ring attention, as the runtime's ring passes do.

    Per layer and ring micro-batch of N members whose KV blocks hold T_0..T_{N-1} tokens,
    member i sends in forward every block but its successor's (N-1 hops:
    ``(sum T - T_{i+1}) * kv``); backward re-sends the same KV and passes the dKV
    accumulator of every block once (N hops: ``sum T * grad``). Each of the
    ``recomputed_layers`` (activation recompute of attention) runs its forward, and so
    its forward hops, once more during backward.

    What a token of a block weighs follows the ring's transport (``MicroBatch.transport``):
    ``kv_bytes_per_token`` / ``grad_bytes_per_token`` for K and V, ``latent_bytes_per_token``
    / ``latent_grad_bytes_per_token`` for a multi-latent attention ring carrying the latent
    and rotary key (the same hops, a narrower block; PlanError if a plan has latent rings and
    these are not given).

    Two-level (``heads_split`` u > 1, heads split evenly: u divides the query and KV
    heads): member i = g*u + a of group g first sends its block's other head slices to
    its group (``T_i * (q + kv) * (u-1)/u``; ``q_bytes_per_token`` is the query heads'
    size), the ring then runs over the M = N/u groups' blocks S_g with 1/u of the heads
    (``(sum S - S_{g+1}) * kv/u``, and ``sum S * grad/u`` when M > 1), and the output
    goes back (``(S_g - T_i) * o/u``). Backward: ``dout`` as the queries
    (``T_i * o * (u-1)/u``), the ring again, and dQ, dK, dV back in the inputs' dtype
    (``(S_g - T_i) * (q + kv)/u``). ``o_bytes_per_token`` (the attention output's heads)
    defaults to the queries' size: different only where values have another head dim than
    queries (multi-latent attention).
    """
    if not 0 <= recomputed_layers <= num_layers:
        raise PlanError(f"recomputed_layers={recomputed_layers} must be between 0 and num_layers={num_layers}")
    widths = {"kv": (kv_bytes_per_token, grad_bytes_per_token)}
    if latent_bytes_per_token is not None:
        widths["latent"] = (latent_bytes_per_token, latent_grad_bytes_per_token or 0.0)
    sent = [0.0] * plan.num_ranks
    blocks: dict[tuple, tuple] = {}  # every member of a ring micro-batch sees the same blocks
    for rank, mbs in enumerate(plan.ranks):
        for mb in mbs:
            key = mb.ring_key
            if key is None:
                continue
            ring = key[0]
            n = len(ring)
            known = blocks.get(key)
            if known is None:
                block = [0] * n
                for p in mb.pieces:
                    if p.is_distributed:
                        for j in range(n):
                            block[j] += rank_tokens(p.seq_len, n, j)
                if mb.transport not in widths:
                    raise PlanError(f"a ring carries {mb.transport!r}: give its bytes per token to count its traffic")
                known = blocks[key] = (block, *widths[mb.transport])
            block, width, grad = known
            i = ring.index(rank)
            u = mb.heads_split
            if u == 1:
                kv = (sum(block) - block[(i + 1) % n]) * width
                per_layer = kv + (kv + sum(block) * grad if backward else 0.0)
                recomputed = kv
            else:
                m, g = n // u, i // u
                sup = [sum(block[h * u : (h + 1) * u]) for h in range(m)]
                own, q, kv_, gr = block[i], q_bytes_per_token / u, kv_bytes_per_token / u, grad_bytes_per_token / u
                o = (q_bytes_per_token if o_bytes_per_token is None else o_bytes_per_token) / u
                ring_kv = (sum(sup) - sup[(g + 1) % m]) * kv_
                fwd = own * (u - 1) * (q + kv_) + ring_kv + (sup[g] - own) * o
                bwd = own * (u - 1) * o + ring_kv + (sum(sup) * gr if m > 1 else 0.0) + (sup[g] - own) * (q + kv_)
                per_layer = fwd + (bwd if backward else 0.0)
                recomputed = fwd
            sent[rank] += per_layer * num_layers + (recomputed * recomputed_layers if backward else 0.0)
    return sent
