"""The Plan: the contract between the planner and everything that executes or costs it.

For one global batch (sequence lengths indexed by ``seq_id``) and ``num_ranks`` HDP ranks, a
plan gives each rank an ordered list of micro-batches. A micro-batch holds pieces: a whole
sequence (ring of one rank) or this rank's zigzag share of a sequence spread over a ring of
ranks. All distributed pieces of one micro-batch share one ring (their KV travels together);
short whole sequences may sit next to them. Each micro-batch has an offload ratio ``r``.

With pipeline parallelism each rank is a pipeline; a plan may also fix the order in which
each stage runs its micro-batches' forwards and backwards (``stage_orders``; None: 1F1B).

Each ring also says what travels round it (``Piece.transport``, one of ``RING_TRANSPORTS``):
``"kv"``, the attention's K and V (every model), or ``"latent"``, for multi-latent attention
models, the compressed KV latent and the rotary key that every member re-expands into K and V.

``validate()`` checks every invariant the runtime relies on (``rules``, one function each).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from ...errors import PlanError
from . import rules
from .ops import Op, decode_order, interleaved_order
from .transports import RING_TRANSPORTS
from .zigzag import Ranges, zigzag_ranges

PLAN_FORMAT_VERSION = 1


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
    # what travels round the ring (``RING_TRANSPORTS``): "kv", K and V; "latent" (multi-latent
    # attention models, plain rings only), the KV latent and rotary key, re-expanded by each member
    transport: str = "kv"

    @property
    def tokens(self) -> int:
        n = 0
        for start, end in self.ranges:  # a loop: no generator or comprehension to set up per call
            n += end - start
        return n

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
        n = 0
        for p in self.pieces:  # Piece.tokens, inlined
            for start, end in p.ranges:
                n += end - start
        return n

    @property
    def ring(self) -> tuple[int, ...] | None:
        """The ring shared by this micro-batch's distributed pieces, or None if all are local
        (or they sit on several rings)."""
        # a loop rather than a set of the rings: a set hashes every ring (all its ranks) on every
        # call, and a plan's estimates and slot alignment ask each micro-batch several times
        ring = None
        for p in self.pieces:
            r = p.ring
            if len(r) > 1 and r is not ring:
                if ring is None:
                    ring = r
                elif r != ring:
                    return None
        return ring

    @property
    def distributed_seq_ids(self) -> tuple[int, ...]:
        return tuple(sorted([p.seq_id for p in self.pieces if len(p.ring) > 1]))

    @cached_property
    def ring_key(self) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """What names this ring micro-batch the same on every member of its ring: (ring,
        distributed sequence ids); None for local work (or pieces on several rings, which
        ``Plan.validate`` rejects). Kept once asked (the micro-batch is immutable; a plan's
        alignment and estimates ask each one several times), outside the dataclass' fields."""
        pieces = self.pieces
        if len(pieces) == 1:  # most micro-batches: one ring member's share, or one sequence
            p = pieces[0]
            return (p.ring, (p.seq_id,)) if len(p.ring) > 1 else None
        ring = self.ring
        return None if ring is None else (ring, self.distributed_seq_ids)

    @property
    def heads_split(self) -> int:
        """The two-level group size of this micro-batch's ring (1: a plain ring or no ring)."""
        return max((p.heads_split for p in self.pieces if p.is_distributed), default=1)

    @property
    def transport(self) -> str:
        """What this micro-batch's ring carries ("kv" without a ring)."""
        for p in self.pieces:
            if len(p.ring) > 1:
                return p.transport
        return "kv"


@dataclass
class Plan:
    num_ranks: int
    capacity: int  # tokens per micro-batch per rank that fit in device memory without offload
    num_layers: int  # layers per pipeline stage: what the offload ratio applies to
    seq_lens: tuple[int, ...]
    ranks: tuple[tuple[MicroBatch, ...], ...]
    # provenance only (strategy, planner time, estimates, ...): never affects execution or costing
    meta: dict = field(default_factory=dict)
    # token-equivalents of a micro-batch that may sit in pinned host memory (offloaded
    # activations; see sizing/offload.py: host_capacity); None: no host budget to check
    host_capacity: int | None = None
    # layers recomputed whole (--recompute-granularity full): they keep no activations, so
    # capacity and offloading concern the other num_layers - recomputed_layers
    recomputed_layers: int = 0
    # per rank, per pipeline stage (device): its ops in run order, each as ``Op.code``
    # (``ops.encode_stage_orders``); None: every device runs the default order
    # (``ops.interleaved_order``: 1F1B, or Megatron's interleaved 1F1B with chunks)
    stage_orders: tuple[tuple[tuple[int, ...], ...], ...] | None = None
    # expert-parallel size (MoE all-to-alls, contract/slots.py): > 1 makes the rank lists
    # slot lists, equal in length within each EP group, where an empty micro-batch is a slot
    # whose rank only joins the all-to-alls
    expert_parallel: int = 1
    # model chunks per pipeline device (virtual pipeline stages, Megatron's interleaved layout:
    # chunk c of device d holds layer block c * PP + d); ``num_layers`` stays the layers of a
    # device, all its chunks together
    virtual_stages: int = 1
    # synchronisation points (Megatron's hybrid CP): per barrier, how many micro-batches each
    # rank has finished when it enters; nobody continues until all arrive, pipelines flushed
    barriers: tuple[tuple[int, ...], ...] = ()

    @property
    def stage_count(self) -> int | None:
        """Pipeline stages the plan's ``stage_orders`` are for (None: no orders, default)."""
        if self.stage_orders is None:
            return None
        return len(self.stage_orders[0]) if self.stage_orders else 0

    def decoded_stage_orders(self) -> list[list[list[Op]]] | None:
        """``stage_orders`` per rank and stage as ops; None without orders."""
        if self.stage_orders is None:
            return None
        return [[decode_order(codes, self.virtual_stages) for codes in rank] for rank in self.stage_orders]

    def stage_order(self, rank: int, stage: int) -> list[Op] | None:
        """The ops of one stage of one rank's pipeline in run order; None: the default order."""
        if self.stage_orders is None:
            return None
        return decode_order(self.stage_orders[rank][stage], self.virtual_stages)

    def chunk_order(self, rank: int, stage: int, stages: int) -> list[Op]:
        """The ops ``stage`` of ``stages`` runs: the plan's order, else the default one."""
        order = self.stage_order(rank, stage)
        if order is None:
            return interleaved_order(len(self.ranks[rank]), stages, stage, self.virtual_stages)
        return order

    def ring_keys(self) -> list[list[tuple | None]]:
        """Per rank and micro-batch: its ``MicroBatch.ring_key`` (None: local work)."""
        return [[mb.ring_key for mb in mbs] for mbs in self.ranks]

    @property
    def activation_layers(self) -> int:
        """Layers per stage that keep their activations for backward (what offloading applies to)."""
        return self.num_layers - self.recomputed_layers

    def with_ring_transport(self, transport: str) -> Plan:
        """This plan with every plain ring (``heads_split`` 1) carrying ``transport``; two-level
        rings keep K and V (their members hold a slice of the heads, the latent is every head's).
        The same plan when nothing changes."""
        if transport not in RING_TRANSPORTS:
            raise PlanError(f"unknown ring transport {transport!r}; choose one of {', '.join(RING_TRANSPORTS)}")
        if not any(
            p.transport != transport and len(p.ring) > 1 and p.heads_split == 1
            for mbs in self.ranks
            for mb in mbs
            for p in mb.pieces
        ):
            return self

        def carried(mb: MicroBatch) -> MicroBatch:
            pieces = tuple(
                _piece(p.seq_id, p.seq_len, p.ranges, p.ring, p.heads_split, transport)
                if len(p.ring) > 1 and p.heads_split == 1
                else p
                for p in mb.pieces
            )
            return micro_batch(pieces, mb.offload_ratio)

        ranks = tuple(tuple(carried(mb) for mb in mbs) for mbs in self.ranks)
        return Plan(
            num_ranks=self.num_ranks,
            capacity=self.capacity,
            num_layers=self.num_layers,
            seq_lens=self.seq_lens,
            ranks=ranks,
            meta=dict(self.meta),
            host_capacity=self.host_capacity,
            recomputed_layers=self.recomputed_layers,
            stage_orders=self.stage_orders,
            expert_parallel=self.expert_parallel,
            virtual_stages=self.virtual_stages,
            barriers=self.barriers,
        )

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

    # --------------------------------------------------------------- invariants
    def validate(self) -> Plan:
        """Check every invariant; raise PlanError listing all violations, else return self.

        1. one micro-batch list per rank; sequence lengths positive (``rules.shape_errors``);
        2. every token of every sequence appears exactly once across the plan; a whole
           sequence is one piece ``[0, s)`` on its ring's only rank; a distributed sequence's
           ring has distinct ranks and each member holds exactly its zigzag share, all its
           pieces carrying one transport ("latent" on plain rings only)
           (``rules.sequence_errors``);
        3. no micro-batch exceeds the capacity once its offload ratio is applied, nor parks
           more than ``host_capacity`` token-equivalents in host memory; ratios in [0, 1];
           all distributed pieces of a micro-batch share one ring (``rules.micro_batch_errors``);
        4. every member of a ring has a micro-batch with the same ``ring_key``, and ring
           micro-batches are ordered consistently across ranks (``rules.ring_order_errors``);
        5. ``barriers`` count micro-batches each rank has finished (``rules.barrier_errors``);
        6. ``stage_orders``, when given: every chunk of every micro-batch once forward, then
           once backward, devices agreeing on the order of their messages, no deadlock
           (``rules.stage_order_errors``, on the graph of ``graph.PipelineGraph``);
        7. with ``expert_parallel`` > 1: EP groups hold equal slot counts and rings and EP
           groups order them without deadlock (``slots.slot_errors``); only then may a
           micro-batch be empty.
        """
        errors = rules.shape_errors(self)
        if errors:
            raise PlanError("invalid plan:\n  " + "\n  ".join(errors))
        errors = rules.micro_batch_errors(self) + rules.sequence_errors(self) + rules.ring_order_errors(self)
        errors += rules.barrier_errors(self)
        if not errors:
            errors.extend(rules.stage_order_errors(self))
        if self.expert_parallel != 1 and not errors:
            errors.extend(rules.slot_errors(self))
        if errors:
            shown = errors[:20] + ([f"... and {len(errors) - 20} more"] if len(errors) > 20 else [])
            raise PlanError("invalid plan:\n  " + "\n  ".join(shown))
        return self

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict:
        extra = {"recomputed_layers": self.recomputed_layers} if self.recomputed_layers else {}
        if self.stage_orders is not None:
            extra["stage_orders"] = [[list(codes) for codes in rank] for rank in self.stage_orders]
        if self.expert_parallel != 1:
            extra["expert_parallel"] = self.expert_parallel
        if self.virtual_stages != 1:
            extra["virtual_stages"] = self.virtual_stages
        if self.barriers:
            extra["barriers"] = [list(b) for b in self.barriers]
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
                            {
                                "seq": p.seq_id,
                                "ranges": [list(r) for r in p.ranges],
                                "ring": list(p.ring),
                                **({"heads_split": p.heads_split} if p.heads_split != 1 else {}),
                                **({"transport": p.transport} if p.transport != "kv" else {}),
                            }
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
                raise PlanError(
                    f"plan format version {data.get('version')!r}; this tool reads version {PLAN_FORMAT_VERSION}"
                )
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
                                transport=str(p.get("transport", "kv")),
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
                barriers=tuple(tuple(int(c) for c in b) for b in data.get("barriers", ())),
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


def _piece(
    seq_id: int, seq_len: int, ranges: Ranges, ring: tuple[int, ...], heads_split: int = 1, transport: str = "kv"
) -> Piece:
    """``Piece(...)`` without the frozen dataclass's per-field ``object.__setattr__``: a
    plan for 16K ranks builds ~10^5 pieces, and this is three times faster (same object)."""
    p = _new_object(Piece)
    d = p.__dict__
    d["seq_id"] = seq_id
    d["seq_len"] = seq_len
    d["ranges"] = ranges
    d["ring"] = ring
    d["heads_split"] = heads_split
    d["transport"] = transport
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
        d["transport"] = "kv"
        out.append(p)
    return tuple(out)


def ring_pieces(
    seq_id: int, seq_len: int, ring: tuple[int, ...], heads_split: int = 1, transport: str = "kv"
) -> list[Piece]:
    """The zigzag pieces of one sequence over ``ring``, in ring order (``heads_split``: two-level;
    ``transport``: what the ring carries)."""
    shares = zigzag_ranges(seq_len, len(ring))
    ring = tuple(ring)
    return [_piece(seq_id, seq_len, share, ring, heads_split, transport) for share in shares]
