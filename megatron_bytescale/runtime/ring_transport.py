"""What travels round a ring: K and V, or (multi-latent attention) the latent they are made from.

A ring pass (``ring_core``) sends this member's block on, receives its predecessor's and
attends to it; in backward an accumulator of the block's gradients goes round beside it. A
*transport* says what those messages hold and how a member turns one into the K and V it
attends to:

* ``KVTransport`` (``"kv"``, every model): K and V themselves. Of one head dim they travel
  stacked, ``[2, T, hkv, d]``, as they always have; with different head dims (MLA: K of
  ``qk_head_dim + qk_pos_emb_head_dim``, V of ``v_head_dim``) as one message holding the two
  buffers back to back, K's ``T*hkv*dk`` values then V's ``T*hkv*dv``, each read as a
  contiguous ``[T, hkv, d]`` view: V not padded, one message per hop. The dK/dV accumulator has
  the message's layout.
* ``LatentTransport`` (``"latent"``, MLA only): the compressed KV latent (``kv_lora_rank``,
  after its norm) and the shared rotary key (``qk_pos_emb_head_dim``, already rotated at the
  token's true position): ``[T, r + dpe]`` per block, whatever the head count. Each member
  re-expands a received block with the layer's up-projection (K's no-rope part and V, a GEMM
  per ring step) and, in backward, maps the block's dK/dV back through it: the accumulator
  that travels is d(latent, rotary key), ``[T, r + dpe]`` in fp32, and the up-projection's
  weight gradient of every block a member attended to is summed there (returned as that
  weight's gradient, reduced like any other). A member attends to its own block with the K
  and V the model made; only the other blocks are re-expanded.

Both are exact: a re-expanded block is the same product the block's owner computed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import PlanError


class KVTransport:
    name = "kv"

    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        self.heads, self.dk, self.dv = k.shape[1], k.shape[-1], v.shape[-1]
        self.stacked = self.dk == self.dv

    def own(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The message of this member's block."""
        return torch.stack((k, v)) if self.stacked else torch.cat((k.reshape(-1), v.reshape(-1)))

    def shape(self, message: torch.Tensor, tokens: int) -> tuple[int, ...]:
        """The shape of another block's message of ``tokens`` tokens."""
        if self.stacked:
            return (2, tokens, *message.shape[2:])
        return (tokens * self.heads * (self.dk + self.dv),)

    def expand(self, message: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A received message -> the block's (K, V)."""
        if self.stacked:
            return message[0], message[1]
        t = message.numel() // (self.heads * (self.dk + self.dv))
        split = t * self.heads * self.dk
        return message[:split].view(t, self.heads, self.dk), message[split:].view(t, self.heads, self.dv)

    def grad_zeros(self, message: torch.Tensor) -> torch.Tensor:
        return torch.zeros(message.shape, dtype=torch.float32, device=message.device)

    def add(self, acc: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, message: torch.Tensor, own: bool) -> None:
        """Add one member's dK, dV of a block into the block's accumulator."""
        acc_k, acc_v = self.expand(acc)
        acc_k += dk
        acc_v += dv

    def home(self, acc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This member's block's accumulator, back with every member's contribution -> (dK, dV)."""
        return self.expand(acc)


class LatentTransport:
    name = "latent"

    def __init__(self, latent: torch.Tensor, rope_key: torch.Tensor, weight: torch.Tensor, heads: int, v_dim: int):
        """``latent`` [T, r] and ``rope_key`` [T, dpe]: this member's block; ``weight``: the
        up-projection [heads * (dn + dv), r] (this TP rank's heads), K = [latent W_k^T, rope
        key] and V = latent W_v^T per head."""
        if weight.dim() != 2 or weight.shape[1] != latent.shape[-1] or weight.shape[0] % heads:
            raise PlanError(
                f"the latent ring re-expands a {latent.shape[-1]}-wide latent into {heads} heads, but the "
                f"up-projection weight is {tuple(weight.shape)}"
            )
        self.weight, self.heads, self.v_dim = weight, heads, v_dim
        self.rank, self.pe_dim = latent.shape[-1], rope_key.shape[-1]
        self.nope_dim = weight.shape[0] // heads - v_dim
        self.message = torch.cat((latent, rope_key), dim=-1).to(weight.dtype)
        self.own_dk = self.own_dv = None
        self.dweight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)

    def own(self, k, v) -> torch.Tensor:
        return self.message

    def shape(self, message: torch.Tensor, tokens: int) -> tuple[int, ...]:
        return (tokens, message.shape[-1])

    def expand(self, message: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = message.shape[0]
        latent, rope_key = message.split((self.rank, self.pe_dim), dim=-1)
        kv = F.linear(latent, self.weight).view(t, self.heads, self.nope_dim + self.v_dim)
        k_nope, v = kv.split((self.nope_dim, self.v_dim), dim=-1)
        k = torch.cat((k_nope, rope_key.unsqueeze(1).expand(t, self.heads, self.pe_dim)), dim=-1)
        return k, v

    def grad_zeros(self, message: torch.Tensor) -> torch.Tensor:
        return torch.zeros(message.shape, dtype=torch.float32, device=message.device)

    def add(self, acc: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, message: torch.Tensor, own: bool) -> None:
        if own:  # this member's own block: its K and V are the model's, their gradients go back there
            self.own_dk, self.own_dv = dk, dv
            return
        t = message.shape[0]
        # d(latent W^T) per token, heads' (no-rope K, V) side by side as the up-projection lays them out
        g = torch.cat((dk[..., : self.nope_dim], dv), dim=-1).float().reshape(t, -1)
        latent = message[:, : self.rank].float()
        acc[:, : self.rank] += g @ self.weight.float()
        acc[:, self.rank :] += dk[..., self.nope_dim :].float().sum(1)  # the rope key is shared by every head
        self.dweight += g.t() @ latent

    def home(self, acc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(dK, dV) of this member's own block for the model's K and V; the other members'
        contributions, in latent space, are ``dlatent`` (for the latent) and go into the
        rope part of dK (the model's K repeats the one rope key in every head, so its
        gradient is the sum over heads: adding it to head 0 adds it to that sum)."""
        dk, dv = self.own_dk, self.own_dv
        dk[:, 0, self.nope_dim :] += acc[:, self.rank :]
        self.dlatent = acc[:, : self.rank]
        return dk, dv
