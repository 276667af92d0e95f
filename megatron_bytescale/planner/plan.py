"""The Plan: the contract between the planner and everything that executes or costs it.

For one global batch (sequence lengths indexed by ``seq_id``) and ``num_ranks`` HDP ranks, a
plan gives each rank an ordered list of micro-batches. A micro-batch holds pieces: a whole
sequence (ring of one rank) or this rank's zigzag share of a sequence spread over a ring of
ranks. All distributed pieces of one micro-batch share one ring (their KV travels together);
short whole sequences may sit next to them. Each micro-batch has an offload ratio ``r``.

With pipeline parallelism each rank is a pipeline; a plan may also fix the order in which
each stage runs its micro-batches' forwards and backwards (``stage_orders``; None: 1F1B).

``validate()`` checks every invariant the runtime relies on; see its docstring.
"""

from __future__ import annotations

import json
from collections import defaultdict
from graphlib import CycleError, TopologicalSorter
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import PlanError
from .zigzag import Ranges, rank_tokens, zigzag_ranges

PLAN_FORMAT_VERSION = 1


def resident_fraction(offload_ratio: float, num_layers: int) -> float:
    """Share of a micro-batch's activations that stays on the device (design 2.4).

    The last two layers always stay; of the other ``l - 2`` layers a fraction ``r`` moves
    to host memory. A rank may then hold ``C / resident_fraction`` tokens.
    """
    if num_layers <= 2:
        return 1.0
    return (2 + (1.0 - offload_ratio) * (num_layers - 2)) / num_layers


@dataclass(frozen=True)
class Piece:
    """The tokens of one sequence that one rank processes in one micro-batch."""

    seq_id: int
    seq_len: int
    ranges: Ranges  # [start, end) token ranges of the sequence, ascending
    ring: tuple[int, ...]  # ordered HDP ranks that share the sequence; (rank,) if whole
    # two-level attention (design 2.3, "two-level"): the ring's consecutive members in groups of
    # ``heads_split`` (one node each) swap heads by all-to-all, so the ring proper runs across
    # the groups with blocks ``heads_split`` times larger; 1 is the plain ring
    heads_split: int = 1

    @property
    def tokens(self) -> int:
        return sum(end - start for start, end in self.ranges)

    @property
    def ring_size(self) -> int:
        return len(self.ring)

    @property
    def is_distributed(self) -> bool:
        return len(self.ring) > 1

    def ring_index(self, rank: int) -> int:
        return self.ring.index(rank)

    def positions(self) -> list[int]:
        """True position of each token inside its own sequence (for RoPE and masking)."""
        return [p for start, end in self.ranges for p in range(start, end)]


@dataclass(frozen=True)
class MicroBatch:
    pieces: tuple[Piece, ...]
    offload_ratio: float = 0.0

    @property
    def tokens(self) -> int:
        return sum(p.tokens for p in self.pieces)

    @property
    def ring(self) -> tuple[int, ...] | None:
        """The ring shared by this micro-batch's distributed pieces, or None if all are local."""
        rings = {p.ring for p in self.pieces if p.is_distributed}
        return next(iter(rings)) if len(rings) == 1 else None

    @property
    def distributed_seq_ids(self) -> tuple[int, ...]:
        return tuple(sorted(p.seq_id for p in self.pieces if p.is_distributed))

    @property
    def heads_split(self) -> int:
        """The two-level group size of this micro-batch's ring (1: a plain ring or no ring)."""
        return max((p.heads_split for p in self.pieces if p.is_distributed), default=1)


@dataclass
class Plan:
    num_ranks: int
    capacity: int  # tokens per micro-batch per rank that fit in device memory without offload
    num_layers: int  # layers per pipeline stage: what the offload ratio applies to
    seq_lens: tuple[int, ...]
    ranks: tuple[tuple[MicroBatch, ...], ...]
    meta: dict = field(default_factory=dict)  # provenance: strategy, planner time, ...
    # token-equivalents of a micro-batch that may sit in pinned host memory (offloaded
    # activations; see offload_policy.host_capacity); None: no host budget to check
    host_capacity: int | None = None
    # layers recomputed whole (--recompute-granularity full): they keep no activations, so
    # capacity and offloading concern the other num_layers - recomputed_layers
    recomputed_layers: int = 0
    # per rank, per pipeline stage (device): its operations in run order, ``m * V + c`` for the
    # forward of chunk ``c`` of micro-batch ``m`` and ``-1 - (m * V + c)`` for its backward, V =
    # ``virtual_stages`` (V = 1: ``m`` and ``-1 - m``; ``pipeline_order.encode_stage_orders``);
    # None: every stage runs 1F1B (``pipeline_order.one_f_one_b``), or with V > 1 the
    # interleaved order (``pipeline_order.interleaved_order``)
    stage_orders: tuple[tuple[tuple[int, ...], ...], ...] | None = None

    @property
    def stage_count(self) -> int | None:
        """Pipeline stages the plan's ``stage_orders`` are for (None: no orders, 1F1B)."""
        if self.stage_orders is None:
            return None
        return len(self.stage_orders[0]) if self.stage_orders else 0

    def decoded_stage_orders(self) -> list[list[list[tuple[int, ...]]]] | None:
        """``stage_orders`` per rank and stage as (direction, micro-batch), or (direction,
        micro-batch, chunk) with virtual stages; None without orders."""
        if self.stage_orders is None:
            return None
        return [[self._decode(codes) for codes in rank] for rank in self.stage_orders]

    def stage_order(self, rank: int, stage: int) -> list[tuple[int, ...]] | None:
        """(direction, micro-batch), or with virtual stages (direction, micro-batch, chunk), in
        run order on one stage of one rank's pipeline; None: 1F1B."""
        if self.stage_orders is None:
            return None
        return self._decode(self.stage_orders[rank][stage])

    def chunk_order(self, rank: int, stage: int, stages: int) -> list[tuple[int, int, int]]:
        """(direction, micro-batch, chunk) in run order on ``stage`` of ``stages``: the plan's
        order, else 1F1B (chunk 0) or, with virtual stages, the interleaved order."""
        from .pipeline_order import chunk_ops, interleaved_order

        order = self.stage_order(rank, stage)
        if order is None:
            return interleaved_order(len(self.ranks[rank]), stages, stage, self.virtual_stages)
        return chunk_ops(order)

    def _decode(self, codes):
        from .pipeline_order import decode_chunk_order, decode_stage_order

        return decode_stage_order(codes) if self.virtual_stages == 1 else decode_chunk_order(codes, self.virtual_stages)
    # expert-parallel size (MoE all-to-alls, planner/expert_slots.py): > 1 makes the rank lists
    # slot lists, equal in length within each EP group, where an empty micro-batch is a slot
    # whose rank only joins the all-to-alls
    expert_parallel: int = 1
    # model chunks per pipeline device (virtual pipeline stages, Megatron's interleaved layout:
    # chunk c of device d holds layer block c * PP + d); ``num_layers`` stays the layers of a
    # device, all its chunks together
    virtual_stages: int = 1

    @property
    def activation_layers(self) -> int:
        """Layers per stage that keep their activations for backward (what offloading applies to)."""
        return self.num_layers - self.recomputed_layers

    # ------------------------------------------------------------------ queries
    def micro_batches(self, rank: int) -> tuple[MicroBatch, ...]:
        if not 0 <= rank < self.num_ranks:
            raise PlanError(f"rank {rank} is outside this plan's {self.num_ranks} ranks")
        return self.ranks[rank]

    def ring_sizes(self) -> dict[int, int]:
        """Ranks per sequence (1 for sequences packed whole)."""
        sizes: dict[int, int] = {}
        for mbs in self.ranks:
            for mb in mbs:
                for p in mb.pieces:
                    sizes[p.seq_id] = p.ring_size
        return sizes

    def tokens_per_rank(self) -> list[int]:
        return [sum(mb.tokens for mb in mbs) for mbs in self.ranks]

    def p2p_bytes_per_rank(
        self, kv_bytes_per_token: float, grad_bytes_per_token: float, num_layers: int, backward: bool = True,
        recomputed_layers: int = 0,
        q_bytes_per_token: float = 0.0,
    ) -> list[float]:
        """Bytes each rank sends in ring attention, as the runtime's ring passes do.

        Per layer and ring micro-batch of N members whose KV blocks hold T_0..T_{N-1} tokens,
        member i sends in forward every block but its successor's (N-1 hops:
        ``(sum T - T_{i+1}) * kv``); backward re-sends the same KV and passes the dKV
        accumulator of every block once (N hops: ``sum T * grad``). Each of the
        ``recomputed_layers`` (activation recompute of attention) runs its forward, and so
        its forward hops, once more during backward.

        Two-level (``heads_split`` u > 1, heads split evenly: u divides the query and KV
        heads): member i = g*u + a of group g first sends its block's other head slices to
        its group (``T_i * (q + kv) * (u-1)/u``; ``q_bytes_per_token`` is the query heads'
        size), the ring then runs over the M = N/u groups' blocks S_g with 1/u of the heads
        (``(sum S - S_{g+1}) * kv/u``, and ``sum S * grad/u`` when M > 1), and the output
        goes back (``(S_g - T_i) * q/u``). Backward: ``dout`` as the queries, the ring again,
        and dQ, dK, dV back in the inputs' dtype (``(S_g - T_i) * (q + kv)/u``).
        """
        if not 0 <= recomputed_layers <= num_layers:
            raise PlanError(f"recomputed_layers={recomputed_layers} must be between 0 and num_layers={num_layers}")
        sent = [0.0] * self.num_ranks
        blocks: dict[tuple, list[int]] = {}  # every member of a ring micro-batch sees the same blocks
        for rank, mbs in enumerate(self.ranks):
            for mb in mbs:
                ring = mb.ring
                if ring is None:
                    continue
                n = len(ring)
                key = (ring, mb.distributed_seq_ids)
                block = blocks.get(key)
                if block is None:
                    block = [0] * n
                    for p in mb.pieces:
                        if p.is_distributed:
                            for j in range(n):
                                block[j] += rank_tokens(p.seq_len, n, j)
                    blocks[key] = block
                i = ring.index(rank)
                u = mb.heads_split
                if u == 1:
                    kv = (sum(block) - block[(i + 1) % n]) * kv_bytes_per_token
                    per_layer = kv + (kv + sum(block) * grad_bytes_per_token if backward else 0.0)
                    recomputed = kv
                else:
                    m, g = n // u, i // u
                    sup = [sum(block[h * u:(h + 1) * u]) for h in range(m)]
                    own, q, kv_, gr = block[i], q_bytes_per_token / u, kv_bytes_per_token / u, grad_bytes_per_token / u
                    ring_kv = (sum(sup) - sup[(g + 1) % m]) * kv_
                    fwd = own * (u - 1) * (q + kv_) + ring_kv + (sup[g] - own) * q
                    bwd = own * (u - 1) * q + ring_kv + (sum(sup) * gr if m > 1 else 0.0) + (sup[g] - own) * (q + kv_)
                    per_layer = fwd + (bwd if backward else 0.0)
                    recomputed = fwd
                sent[rank] += per_layer * num_layers + (recomputed * recomputed_layers if backward else 0.0)
        return sent

    # --------------------------------------------------------------- invariants
    def validate(self) -> Plan:
        """Check every invariant; raise PlanError listing all violations, else return self.

        1. one micro-batch list per rank; sequence lengths positive;
        2. every token of every sequence appears exactly once across the plan;
        3. a whole sequence is one piece ``[0, s)`` on its ring's only rank; a distributed
           sequence's ring has distinct ranks and each member holds exactly its zigzag share
           (so chunks are balanced within one token);
        4. all distributed pieces of a micro-batch share one ring, and every member of that
           ring has a micro-batch with the same ring and the same distributed sequences;
        5. ring micro-batches are ordered consistently across ranks (no P2P deadlock);
        6. no micro-batch exceeds the capacity once its offload ratio is applied; ratios in [0, 1];
        7. no micro-batch parks more than ``host_capacity`` token-equivalents in host memory
           (``tokens * (1 - resident_fraction)``), when the plan has a host budget;
        8. ``stage_orders``, when given: the same number of stages for every rank, each stage
           running every micro-batch (every chunk of it, with ``virtual_stages`` > 1) of its
           rank once forward and then once backward, devices passing micro-batches on in the
           order the receiver runs them (``crossing_order_mismatch``), and the pipelines free
           of deadlock in those orders (``find_pipeline_deadlock``).
        9. with ``expert_parallel`` > 1: the members of each EP group hold the same number of
           slots, and rings and EP groups order them without deadlock (``expert_slots``); only
           then may a micro-batch be empty.
        """
        errors: list[str] = []
        if len(self.ranks) != self.num_ranks:
            errors.append(f"plan has {len(self.ranks)} rank lists for {self.num_ranks} ranks")
        if self.capacity <= 0:
            errors.append(f"capacity must be positive, got {self.capacity}")
        if self.virtual_stages < 1:
            errors.append(f"virtual_stages={self.virtual_stages} must be at least 1 (model chunks per pipeline device)")
        if self.expert_parallel < 1 or self.num_ranks % self.expert_parallel:
            errors.append(f"expert_parallel={self.expert_parallel} must divide the {self.num_ranks} ranks into EP groups")
        if not 0 <= self.recomputed_layers <= self.num_layers:
            errors.append(f"recomputed_layers={self.recomputed_layers} outside [0, num_layers={self.num_layers}]")
        for sid, s in enumerate(self.seq_lens):
            if s <= 0:
                errors.append(f"sequence {sid} has length {s}; lengths must be positive")
        if errors:
            raise PlanError("invalid plan:\n  " + "\n  ".join(errors))

        covered: dict[int, list[tuple[int, int]]] = defaultdict(list)
        holders: dict[int, list[tuple[int, int, Piece]]] = defaultdict(list)  # seq -> (rank, mb idx, piece)
        ring_keys: dict[int, list[tuple]] = {}  # rank -> ordered ring-step keys
        limit = self.capacity * (1 + 1e-9)
        host_limit = None if self.host_capacity is None else self.host_capacity * (1 + 1e-9)

        for rank, mbs in enumerate(self.ranks):
            keys = []
            for m, mb in enumerate(mbs):
                where = f"rank {rank} micro-batch {m}"
                if not 0.0 <= mb.offload_ratio <= 1.0:
                    errors.append(f"{where}: offload ratio {mb.offload_ratio} outside [0, 1]")
                if not mb.pieces and self.expert_parallel == 1:
                    errors.append(f"{where}: empty micro-batch")
                resident = mb.tokens * resident_fraction(mb.offload_ratio, self.activation_layers)
                if resident > limit:
                    errors.append(
                        f"{where}: {mb.tokens} tokens at offload ratio {mb.offload_ratio:.3f} keep "
                        f"{resident:.0f} token-equivalents on the device, over capacity {self.capacity}"
                    )
                if host_limit is not None and mb.offload_ratio > 0:
                    parked = mb.tokens * (1.0 - resident_fraction(mb.offload_ratio, self.activation_layers))
                    if parked > host_limit:
                        errors.append(
                            f"{where}: {mb.tokens} tokens at offload ratio {mb.offload_ratio:.3f} park "
                            f"{parked:.0f} token-equivalents in host memory, over the host budget {self.host_capacity}"
                        )
                seen_here = set()
                for p in mb.pieces:
                    if not 0 <= p.seq_id < len(self.seq_lens):
                        errors.append(f"{where}: unknown sequence id {p.seq_id}")
                        continue
                    if p.seq_id in seen_here:
                        errors.append(f"{where}: sequence {p.seq_id} appears twice")
                    seen_here.add(p.seq_id)
                    if p.seq_len != self.seq_lens[p.seq_id]:
                        errors.append(
                            f"{where}: piece of sequence {p.seq_id} says length {p.seq_len}, batch says {self.seq_lens[p.seq_id]}"
                        )
                    if rank not in p.ring:
                        errors.append(f"{where}: sequence {p.seq_id}'s ring {p.ring} does not contain this rank")
                    covered[p.seq_id].extend(p.ranges)
                    holders[p.seq_id].append((rank, m, p))
                rings = {p.ring for p in mb.pieces if p.is_distributed}
                if len(rings) > 1:
                    errors.append(f"{where}: distributed pieces use {len(rings)} different rings; one allowed")
                splits = {p.heads_split for p in mb.pieces if p.is_distributed}
                if len(splits) > 1:
                    errors.append(f"{where}: pieces use heads_split {sorted(splits)}; one micro-batch has one")
                if mb.ring is not None:
                    keys.append((mb.ring, mb.distributed_seq_ids))
            ring_keys[rank] = keys

        for sid, s in enumerate(self.seq_lens):
            spans = sorted(covered.get(sid, []))
            pos = 0
            for start, end in spans:
                if start < pos:
                    errors.append(f"sequence {sid}: tokens [{start}, {min(pos, end)}) appear more than once")
                elif start > pos:
                    errors.append(f"sequence {sid}: tokens [{pos}, {start}) are not in the plan")
                if end <= start:
                    errors.append(f"sequence {sid}: empty or reversed range [{start}, {end})")
                pos = max(pos, end)
            if pos < s:
                errors.append(f"sequence {sid}: tokens [{pos}, {s}) are not in the plan")
            if pos > s:
                errors.append(f"sequence {sid}: ranges reach {pos}, past its length {s}")
            errors.extend(self._check_ring(sid, s, holders.get(sid, [])))

        errors.extend(self._check_ring_steps(ring_keys))
        if not errors:
            errors.extend(self._check_stage_orders())
        if self.expert_parallel != 1 and not errors:
            from .expert_slots import slot_errors  # expert_slots builds plans: imported late

            errors.extend(slot_errors(self))
        if errors:
            shown = errors[:20] + ([f"... and {len(errors) - 20} more"] if len(errors) > 20 else [])
            raise PlanError("invalid plan:\n  " + "\n  ".join(shown))
        return self

    def _check_ring(self, sid: int, s: int, held: list[tuple[int, int, Piece]]) -> list[str]:
        if not held:
            return []
        ring = held[0][2].ring
        errors = []
        if any(p.ring != ring for _, _, p in held):
            return [f"sequence {sid}: pieces disagree about the ring: {sorted({p.ring for _, _, p in held})}"]
        if len(set(ring)) != len(ring) or not all(0 <= r < self.num_ranks for r in ring):
            return [f"sequence {sid}: ring {ring} repeats a rank or names a rank outside 0..{self.num_ranks - 1}"]
        u = held[0][2].heads_split
        if any(p.heads_split != u for _, _, p in held):
            return [f"sequence {sid}: pieces disagree about heads_split: {sorted({p.heads_split for _, _, p in held})}"]
        if u < 1 or len(ring) % u or (u > 1 and len(ring) == 1):
            return [f"sequence {sid}: heads_split {u} does not divide its ring of {len(ring)} ranks into groups"]
        ranks_holding = sorted(r for r, _, _ in held)
        if ranks_holding != sorted(ring):
            return [f"sequence {sid}: held by ranks {ranks_holding}, ring is {ring}; each member holds one piece"]
        if len(ring) > s:
            return [f"sequence {sid}: ring of {len(ring)} ranks for {s} tokens"]
        shares = zigzag_ranges(s, len(ring))
        for rank, m, p in held:
            i = ring.index(rank)
            if p.ranges != shares[i]:
                errors.append(
                    f"sequence {sid}: rank {rank} (ring index {i}) holds {p.ranges}, zigzag share is {shares[i]}"
                )
        return errors

    def _check_ring_steps(self, ring_keys: dict[int, list[tuple]]) -> list[str]:
        """Members of a ring must meet in the same ring micro-batch, in a consistent order."""
        errors = []
        members_of: dict[tuple, set[int]] = defaultdict(set)
        for rank, keys in ring_keys.items():
            if len(set(keys)) != len(keys):
                errors.append(f"rank {rank}: the same ring micro-batch appears twice")
            for key in keys:
                members_of[key].add(rank)
        for key, members in members_of.items():
            ring, seqs = key
            if members != set(ring):
                errors.append(
                    f"ring micro-batch of sequences {list(seqs)} on ring {ring} is scheduled only on ranks {sorted(members)}"
                )
        # Deadlock freedom: the "runs before" relation between ring micro-batches on each rank
        # must be acyclic (then the lowest unfinished one can always make progress).
        before: dict[tuple, set[tuple]] = {k: set() for k in members_of}
        for keys in ring_keys.values():
            for a, b in zip(keys, keys[1:]):
                before[b].add(a)
        try:
            tuple(TopologicalSorter(before).static_order())
        except CycleError:
            errors.append("ring micro-batches are ordered inconsistently across ranks: P2P would deadlock")
        return errors

    def _check_stage_orders(self) -> list[str]:
        if self.stage_orders is None:
            return []
        if len(self.stage_orders) != self.num_ranks:
            return [f"stage_orders has {len(self.stage_orders)} rank lists for {self.num_ranks} ranks"]
        errors = []
        stages = self.stage_count
        if stages < 1:
            return ["stage_orders must give at least one stage per rank"]
        for rank, per_stage in enumerate(self.stage_orders):
            if len(per_stage) != stages:
                errors.append(f"rank {rank}: stage_orders gives {len(per_stage)} stages, rank 0 gives {stages}")
                continue
            count, v = len(self.ranks[rank]), self.virtual_stages
            want = sorted(list(range(count * v)) + [-1 - x for x in range(count * v)])
            for stage, codes in enumerate(per_stage):
                where = f"rank {rank} stage {stage}"
                if sorted(codes) != want:
                    chunks = f" (each of its {v} chunks)" if v > 1 else ""
                    errors.append(f"{where}: the order must run each of the {count} micro-batches{chunks} once forward and once backward")
                    continue
                seen = set()
                for c in codes:
                    if c < 0 and -1 - c not in seen:
                        m, chunk = divmod(-1 - c, v)
                        errors.append(f"{where}: the backward of micro-batch {m}{f' chunk {chunk}' if v > 1 else ''} comes before its forward")
                        break
                    seen.add(c)
        if not errors:
            from .pipeline_order import crossing_order_mismatch, plan_pipeline_deadlock

            for rank, orders in enumerate(self.decoded_stage_orders()):
                mismatch = crossing_order_mismatch(orders, self.virtual_stages)
                if mismatch:
                    errors.append(f"rank {rank}: {mismatch}")
        if not errors:
            stuck = plan_pipeline_deadlock(self, stages)
            if stuck:
                errors.append(f"stage_orders deadlock: {stuck}")
        return errors

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict:
        extra = {"recomputed_layers": self.recomputed_layers} if self.recomputed_layers else {}
        if self.stage_orders is not None:
            extra["stage_orders"] = [[list(codes) for codes in rank] for rank in self.stage_orders]
        if self.expert_parallel != 1:
            extra["expert_parallel"] = self.expert_parallel
        if self.virtual_stages != 1:
            extra["virtual_stages"] = self.virtual_stages
        return {
            **extra,
            "version": PLAN_FORMAT_VERSION,
            "num_ranks": self.num_ranks,
            "capacity": self.capacity,
            "num_layers": self.num_layers,
            "seq_lens": list(self.seq_lens),
            "host_capacity": self.host_capacity,
            "meta": self.meta,
            "ranks": [
                [
                    {
                        "offload_ratio": mb.offload_ratio,
                        "pieces": [
                            {"seq": p.seq_id, "ranges": [list(r) for r in p.ranges], "ring": list(p.ring),
                             **({"heads_split": p.heads_split} if p.heads_split != 1 else {})}
                            for p in mb.pieces
                        ],
                    }
                    for mb in mbs
                ]
                for mbs in self.ranks
            ],
        }

    @classmethod
    def from_dict(cls, data: dict) -> Plan:
        try:
            if data.get("version") != PLAN_FORMAT_VERSION:
                raise PlanError(f"plan format version {data.get('version')!r}; this tool reads version {PLAN_FORMAT_VERSION}")
            seq_lens = tuple(int(s) for s in data["seq_lens"])
            ranks = tuple(
                tuple(
                    MicroBatch(
                        pieces=tuple(
                            Piece(
                                seq_id=int(p["seq"]),
                                seq_len=seq_lens[int(p["seq"])],
                                ranges=tuple((int(a), int(b)) for a, b in p["ranges"]),
                                ring=tuple(int(r) for r in p["ring"]),
                                heads_split=int(p.get("heads_split", 1)),
                            )
                            for p in mb["pieces"]
                        ),
                        offload_ratio=float(mb.get("offload_ratio", 0.0)),
                    )
                    for mb in mbs
                )
                for mbs in data["ranks"]
            )
            return cls(
                num_ranks=int(data["num_ranks"]),
                capacity=int(data["capacity"]),
                num_layers=int(data["num_layers"]),
                seq_lens=seq_lens,
                ranks=ranks,
                meta=dict(data.get("meta", {})),
                host_capacity=None if data.get("host_capacity") is None else int(data["host_capacity"]),
                recomputed_layers=int(data.get("recomputed_layers", 0)),
                stage_orders=None
                if data.get("stage_orders") is None
                else tuple(tuple(tuple(int(c) for c in codes) for codes in rank) for rank in data["stage_orders"]),
                expert_parallel=int(data.get("expert_parallel", 1)),
                virtual_stages=int(data.get("virtual_stages", 1)),
            )
        except PlanError:
            raise
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise PlanError(f"malformed plan: {type(exc).__name__}: {exc}") from None

    def to_json(self, path: str | Path | None = None) -> str:
        text = json.dumps(self.to_dict(), separators=(",", ":"))
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> Plan:
        text = str(text_or_path)
        if not text.lstrip().startswith("{"):
            text = Path(text_or_path).read_text()
        try:
            return cls.from_dict(json.loads(text))
        except json.JSONDecodeError as exc:
            raise PlanError(f"plan is not valid JSON: {exc}") from None


def _piece(seq_id: int, seq_len: int, ranges: Ranges, ring: tuple[int, ...], heads_split: int = 1) -> Piece:
    """``Piece(...)`` without the frozen dataclass's per-field ``object.__setattr__``: a
    plan for 16K ranks builds ~10^5 pieces, and this is three times faster (same object)."""
    p = _new_object(Piece)
    d = p.__dict__
    d["seq_id"] = seq_id
    d["seq_len"] = seq_len
    d["ranges"] = ranges
    d["ring"] = ring
    d["heads_split"] = heads_split
    return p


_new_object = object.__new__


def micro_batch(pieces: tuple[Piece, ...], offload_ratio: float = 0.0) -> MicroBatch:
    """``MicroBatch(pieces, offload_ratio)``, built the fast way ``_piece`` is."""
    mb = _new_object(MicroBatch)
    d = mb.__dict__
    d["pieces"] = pieces
    d["offload_ratio"] = offload_ratio
    return mb


def whole_piece(seq_id: int, seq_len: int, rank: int) -> Piece:
    return _piece(seq_id, seq_len, ((0, seq_len),), (rank,))


def whole_pieces(seq_ids, seq_lens, ring: tuple[int], ranges_of: dict[int, Ranges]) -> tuple[Piece, ...]:
    """Whole-sequence pieces of ``seq_ids`` on the one rank of ``ring``. They share their
    immutable parts: ``ring`` and ``((0, s),)`` per length (kept in ``ranges_of``), so a
    16K-rank plan builds, and the garbage collector later walks, far fewer objects."""
    out = []
    new, cls, known = _new_object, Piece, ranges_of.get
    for i in seq_ids:  # ``_piece`` inlined: the plan's most common object
        s = seq_lens[i]
        ranges = known(s)
        if ranges is None:
            ranges = ranges_of[s] = ((0, s),)
        p = new(cls)
        d = p.__dict__
        d["seq_id"] = i
        d["seq_len"] = s
        d["ranges"] = ranges
        d["ring"] = ring
        d["heads_split"] = 1
        out.append(p)
    return tuple(out)


def ring_pieces(seq_id: int, seq_len: int, ring: tuple[int, ...], heads_split: int = 1) -> list[Piece]:
    """The zigzag pieces of one sequence over ``ring``, in ring order (``heads_split``: two-level)."""
    shares = zigzag_ranges(seq_len, len(ring))
    ring = tuple(ring)
    return [_piece(seq_id, seq_len, share, ring, heads_split) for share in shares]
