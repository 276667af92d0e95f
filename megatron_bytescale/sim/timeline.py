"""Cost a Plan on a Cluster: the per-GPU timeline of one training step.

Every strategy is costed here with the same ``CostModel`` and the same rules:

* **Micro-batch work.** Per layer, a rank computes ``layer_time`` of its tokens: the linear
  part ``b1 * tokens + g`` plus attention ``a1 * pairs``, where a whole sequence of ``s``
  tokens contributes ``s^2`` pairs and a zigzag share of a ring of ``N`` contributes
  ``s^2 / N`` (zigzag gives every ring step the same causal work). Forward takes
  ``forward_share`` of it (``CostModel.forward_share``), backward the rest.
* **Ring micro-batches.** All members start together, when the last of them is ready, and
  run in lockstep layer by layer. In each layer the linear part runs first (the ring waits
  for its slowest member), then the ring runs ``N`` steps; a step lasts
  ``max(attention compute of the step, the hop that overlaps it)``. A hop moves the block
  of KV (backward: KV + dKV) each member passes to its successor; it takes
  ``CostModel.hop_time`` over NVLink if the two share a node and over the network if not,
  and the step waits for the slowest hop. Forward has ``N - 1`` hops, backward ``N - 1``
  plus a last dKV-only hop that nothing overlaps. Short sequences packed whole next to the
  distributed pieces compute in step 0. *Exposed communication* of a member is the step
  time its own compute does not cover because a hop is still in flight.
* **Offloading.** A micro-batch with offload ratio ``r`` copies ``r * Act(tokens)`` bytes of
  each of ``l - 2`` layers to the host during the forward and back during the backward; the
  device-to-host copy of a layer hides behind that layer's forward compute only, the
  host-to-device copy behind its backward compute only, and whatever exceeds it is exposed
  in that pass (``planner.sizing.offload.copy_exposure``, the rule the planner plans with).
  The bytes parked in host memory are reported per GPU (the largest micro-batch's, times
  the micro-batches a 1F1B stage holds in flight).
* **Activation recompute** (``CostModel.with_recompute``): in backward, each recomputed layer
  first runs its forward again: the attention part (with its ring steps and forward hops,
  exposed as in forward) in ``m`` of ``l`` layers, the linear part in ``k``; recomputed layers
  keep nothing, so offloading concerns ``cost.activation_layers`` of them.
* **Pipelines.** Each HDP rank is one pipeline of ``pp`` stages (equal layer counts) running
  its micro-batches with 1F1B (warm-up, steady state, cool-down), or in the plan's own
  per-stage orders (``Plan.stage_orders``); a ring micro-batch's work on a stage starts when
  every member pipeline has reached it there. With ``plan.virtual_stages = V > 1`` every
  device holds ``V`` model chunks (virtual stage ``c * pp + d``, Megatron's interleaved
  layout) and follows ``Plan.chunk_order`` (the plan's orders, else the interleaved order):
  an op is one chunk of one micro-batch and does ``1 / V`` of the stage's work (compute,
  ring hops, offload copies); a ring's op is one gang of its members per virtual stage, a
  forward waits for the previous virtual stage's, a backward for the next one's (the
  contract's dependency graph, ``contract.graph.PipelineGraph``). Activation transfers
  between stages are not costed (the same omission for every strategy).
* **Expert parallelism** (``plan.expert_parallel`` > 1, ``planner.expert.slots``): the
  members of an EP group run slot k together, and a ring joins the slots of its members, so
  the forward (and the backward) of one such merged slot starts when all its participants are
  free and ends with the slowest; each adds its MoE all-to-alls (``all_to_all_time``: half in
  forward, half in backward, over NVLink when the EP group sits in one node), and an empty
  slot is a rank waiting. A plan of a strategy without its own slots (static) is aligned
  first, as the planner aligns HDP's (with pipelines: ``planner.expert.pipelines``).
* **Barriers.** ``plan.barriers`` (Megatron's hybrid CP) lists, per barrier, how many
  micro-batches each rank has finished when it enters; nobody continues until all arrive,
  and pipelines are flushed there.
* **Gradient reduction** and the optimizer step are left out of the step time of every
  strategy: every strategy reduces the same gradients over the same ranks. What of the
  reduction stays exposed, with and without ``--overlap-grad-reduce``, is reported beside it
  (``sim.grad_reduction``): that depends on how each plan ends.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field, replace

import numpy as np

from ..errors import PlanError
from ..planner.contract import BACKWARD, FORWARD, MicroBatch, PipelineGraph, Plan
from ..planner.contract.rules import barrier_errors
from ..planner.contract.slots import ep_groups, slot_errors, slot_nodes
from ..planner.cost_model import CostModel
from ..planner.expert.pipelines import align_pipelined_slots
from ..planner.expert.slots import align_expert_slots
from ..planner.expert.timing import all_to_all_time
from ..planner.order.walk import graph_ends
from ..planner.ring_traffic import p2p_bytes_per_rank
from ..planner.sizing import two_level
from ..planner.sizing.offload import copy_exposure, host_bytes
from .cluster import Cluster
from .grad_reduction import exposed_reduction


@dataclass(frozen=True)
class Work:
    """One micro-batch on one pipeline stage in one direction, as one rank sees it."""

    duration: float  # wall time from start to end (the same for every member of a ring)
    compute: float  # busy computing
    comm: float  # exposed communication: waiting for ring hops that compute does not cover
    offload: float  # exposed PCIe copies of offloaded activations
    a2a: float = 0.0  # two-level attention's head all-to-alls inside the node (NVLink, exposed)
    moe_a2a: float = 0.0  # expert parallelism: the MoE layers' token all-to-alls (exposed)


@dataclass(frozen=True)
class MemberLoad:
    """What one rank holds in one micro-batch, reduced to what the cost model needs."""

    tokens: int
    dist_tokens: int  # tokens of distributed pieces: this rank's KV block in the ring
    dist_pairs: float  # attention pairs of distributed pieces (s^2 / N each)
    local_pairs: float  # attention pairs of whole sequences (s^2 each)
    offload_ratio: float

    @classmethod
    def of(cls, mb: MicroBatch) -> MemberLoad:
        tokens = dist_tokens = 0
        dist_pairs = local_pairs = 0.0
        for p in mb.pieces:  # plain attribute access: static plans hold ~10^6 pieces
            n = len(p.ring)
            if n > 1:
                held = 0
                for start, end in p.ranges:
                    held += end - start
                dist_tokens += held
                tokens += held
                dist_pairs += p.seq_len * p.seq_len / n
            else:
                tokens += p.seq_len
                local_pairs += p.seq_len * p.seq_len
        return cls(tokens, dist_tokens, dist_pairs, local_pairs, mb.offload_ratio)


def ring_key(mb: MicroBatch) -> tuple | None:
    """``mb.ring_key``; PlanError if its distributed pieces use more than one ring."""
    if mb.ring is None and len({p.ring for p in mb.pieces if p.is_distributed}) > 1:
        raise PlanError(
            "a micro-batch's distributed pieces use "
            f"{len({p.ring for p in mb.pieces if p.is_distributed})} rings; one allowed"
        )
    return mb.ring_key


def offload_exposure(load: MemberLoad, cost: CostModel, layers: int) -> tuple[float, float, float]:
    """(exposed forward seconds, exposed backward seconds, bytes copied to the host), per
    stage, of one micro-batch: ``copy_exposure`` for each of the ``l - 2`` offloaded layers;
    layers recomputed whole keep nothing to copy."""
    layers -= cost.recomputed_layers
    if load.offload_ratio <= 0 or layers <= 2:
        return 0.0, 0.0, 0.0
    fwd, bwd = copy_exposure(cost, load.tokens, load.dist_pairs + load.local_pairs, load.offload_ratio)
    return (layers - 2) * fwd, (layers - 2) * bwd, host_bytes(cost, load.tokens, load.offload_ratio, layers)


def local_work(load: MemberLoad, cost: CostModel, layers: int) -> tuple[Work, Work]:
    pairs = load.local_pairs + load.dist_pairs
    redo = cost.recompute_time(load.tokens, pairs) * layers  # recomputed forwards: in backward
    t = cost.layer_time(load.tokens, pairs) * layers - redo
    off_f, off_b, _ = offload_exposure(load, cost, layers)
    f = cost.forward_share
    return (
        Work(duration=f * t + off_f, compute=f * t, comm=0.0, offload=off_f),
        Work(duration=(1.0 - f) * t + redo + off_b, compute=(1.0 - f) * t + redo, comm=0.0, offload=off_b),
    )


def ring_work(
    ring: tuple[int, ...],
    loads: list[MemberLoad],
    cluster: Cluster,
    cost: CostModel,
    layers: int,
    transport: str = "kv",
) -> list[tuple[Work, Work]]:
    """(forward, backward) Work of each member (in ring order) of one ring micro-batch. A
    latent ring (``transport``) moves the narrower latent blocks and re-expands each received
    block before attending to it: that GEMM (``CostModel.expand_time``) adds to the step's
    compute, forward and backward."""
    n = len(ring)
    width, grad_width = cost.ring_bytes(transport)
    block = np.array([ld.dist_tokens for ld in loads], dtype=float)
    inter = np.array([not cluster.same_node(ring[i], ring[(i + 1) % n]) for i in range(n)])
    bw = np.where(inter, cost.bw_inter_node, cost.bw_intra_node)
    # layer_seconds' terms apart (linear first, attention over the ring's steps), recompute below
    lin = np.array([cost.b1 * ld.tokens + cost.g for ld in loads])
    attn = np.array([cost.a1 * ld.dist_pairs for ld in loads])
    local = np.array([cost.a1 * ld.local_pairs for ld in loads])
    exposure = [offload_exposure(ld, cost, layers) for ld in loads]
    off_by_dir = {
        FORWARD: np.array([e[0] / layers for e in exposure]),
        BACKWARD: np.array([e[1] / layers for e in exposure]),
    }
    # hop k (0 <= k < n-1): member i passes the block that started at member (i - k)
    sender_block = block[(np.arange(n)[:, None] - np.arange(n - 1)[None, :]) % n]  # [member, hop]
    # step k (1 <= k < n): member i attends to the block that started at member (i - k)
    received = block[(np.arange(n)[:, None] - np.arange(1, n)[None, :]) % n]  # [member, step - 1]
    lat = cost.p2p_latency_s
    results = []
    redo_attn = cost.recompute_attention_share  # m / l: forward ring pass again in backward
    redo_lin = cost.recomputed_layers / layers if layers else 0.0  # k / l
    fwd_ring = fwd_exposed = fwd_compute = None
    fs = cost.forward_share
    for direction, share in ((FORWARD, fs), (BACKWARD, 1.0 - fs)):
        off = off_by_dir[direction]  # exposed copy seconds per layer in this pass
        per_token = width + (grad_width if direction == BACKWARD else 0.0)
        hops = lat + (sender_block * (per_token / bw)[:, None]).max(axis=0)  # [n-1], slowest link
        a = share * attn / n  # per step, per member
        first = a + share * local  # step 0 also computes the whole sequences
        expand = cost.expand_time(received, direction == BACKWARD, transport)  # [member, step - 1]
        later = a[:, None] + expand
        step_max = np.empty(n)
        step_max[0] = max(first.max(), hops[0])
        step_max[1:] = later.max(axis=0) if n > 1 else []
        step_max[1 : n - 1] = np.maximum(step_max[1 : n - 1], hops[1:])
        if n == 1:
            step_max[0] = first.max()
        tail = 0.0
        if direction == BACKWARD:  # the dKV accumulators travel home once more
            tail = lat + (block[(np.arange(n) + 1) % n] * (grad_width / bw)).max()
        pre = share * lin + off
        layer_time = pre.max() + step_max.sum() + tail
        exposed = (
            np.maximum(0.0, hops[0] - first) + np.maximum(0.0, hops[None, 1:] - later[:, : n - 2]).sum(axis=1) + tail
        )
        compute = share * (lin + attn + local) + expand.sum(axis=1)
        if direction == FORWARD:
            fwd_ring, fwd_exposed = step_max.sum(), exposed
            fwd_compute = fs * (attn + local) + expand.sum(axis=1), fs * lin
        elif redo_attn:  # activation recompute: the forward again, before this backward
            layer_time += redo_attn * fwd_ring + redo_lin * (fs * lin).max()
            exposed = exposed + redo_attn * fwd_exposed
            compute = compute + redo_attn * fwd_compute[0] + redo_lin * fwd_compute[1]
        for i in range(n):
            w = Work(
                duration=layers * layer_time,
                compute=layers * compute[i],
                comm=layers * exposed[i],
                offload=layers * off[i],
            )
            if direction == FORWARD:
                results.append([w])
            else:
                results[i].append(w)
    return [(f, b) for f, b in results]


def two_level_ring_work(
    ring: tuple[int, ...], u: int, loads: list[MemberLoad], cluster: Cluster, cost: CostModel, layers: int
) -> list[tuple[Work, Work]]:
    """(forward, backward) Work of each member of a two-level ring micro-batch (groups of u).

    Per layer and direction: the linear part, then the head all-to-all inside each group
    (NVLink, nothing overlaps it: ``two_level.a2a_time``, half per direction), then the ring
    across the M groups: M steps of a group block (u blocks, the widest head slice), hops
    over the network when neighbouring groups sit on different nodes, and in backward the
    dKV home hop; then the reverse all-to-all (inside the same half)."""
    n = len(ring)
    m = n // u
    fq, fkv = two_level.head_fractions(cost, u) if cost.q_heads else (1.0 / u, 1.0 / u)
    tokens = np.array([ld.dist_tokens for ld in loads], dtype=float)
    block = tokens.reshape(m, u).sum(axis=1) * fkv  # group blocks, in full-head token equivalents
    firsts = [ring[g * u] for g in range(m)]
    inter = np.array([not cluster.same_node(firsts[g], firsts[(g + 1) % m]) for g in range(m)])
    bw = np.where(inter, cost.bw_inter_node, cost.bw_intra_node)
    # layer_seconds' terms apart, as in ring_work (the attention of u blocks, the widest head slice)
    lin = np.array([cost.b1 * ld.tokens + cost.g for ld in loads])
    attn = np.array([cost.a1 * ld.dist_pairs * u * fq for ld in loads])
    local = np.array([cost.a1 * ld.local_pairs for ld in loads])
    off = np.array([offload_exposure(ld, cost, layers)[0] / layers for ld in loads])
    a2a = 0.5 * two_level.a2a_time(cost, float(tokens.max()), u)  # per direction
    sender_block = block[(np.arange(m)[:, None] - np.arange(m - 1)[None, :]) % m]  # [group, hop]
    lat = cost.p2p_latency_s
    results = []
    for direction, share in ((FORWARD, cost.forward_share), (BACKWARD, 1.0 - cost.forward_share)):
        per_token = cost.kv_bytes_per_token + (cost.grad_bytes_per_token if direction == BACKWARD else 0.0)
        hops = lat + (sender_block * (per_token / bw)[:, None]).max(axis=0) if m > 1 else np.zeros(0)
        a = share * attn / m
        first = a + share * local
        steps = [max(first.max(), hops[0]) if m > 1 else first.max()]
        steps += [max(a.max(), h) for h in hops[1:]]
        if m > 1:
            steps.append(a.max())
        tail = 0.0
        if direction == BACKWARD and m > 1:
            tail = lat + (block[(np.arange(m) + 1) % m] * (cost.grad_bytes_per_token / bw)).max()
        layer_time = (share * (lin + off)).max() + a2a + sum(steps) + tail
        exposed = np.full(n, tail)
        if m > 1:
            exposed += np.maximum(0.0, hops[0] - first) + np.maximum(0.0, hops[None, 1:] - a[:, None]).sum(axis=1)
        compute = share * (lin + attn + local)
        for i in range(n):
            w = Work(
                duration=layers * layer_time,
                compute=layers * compute[i],
                comm=layers * exposed[i],
                offload=layers * share * off[i],
                a2a=layers * a2a,
            )
            if direction == FORWARD:
                results.append([w])
            else:
                results[i].append(w)
    return [(f, b) for f, b in results]


@dataclass
class Timeline:
    """One step on every GPU. Rows are GPUs (one per TP group): row = stage * num_ranks + rank."""

    step_time: float
    num_ranks: int
    stages: int
    # per row: array of ops, columns start, end, direction, compute, comm, offload
    ops: list[np.ndarray] = field(repr=False)
    barriers: list[float] = field(default_factory=list)  # times all ranks leave each barrier
    # expert parallelism: the busiest device's slots, each as long as its EP group's slowest
    # member (with its all-to-alls) there: a floor of the step no stage order beats (0: no EP)
    ep_slot_floor: float = 0.0
    chunks: int = 1  # model chunks per device (virtual stages); each op is one chunk's
    # most forwards (chunk forwards, with chunks > 1) any device held before their backward:
    # 1F1B's first stage holds p micro-batches, i.e. p x chunks chunk forwards of activations
    peak_in_flight: int = 0

    COLUMNS = ("start", "end", "direction", "compute", "comm", "offload", "a2a", "moe_a2a")

    def row(self, rank: int, stage: int = 0) -> np.ndarray:
        return self.ops[stage * self.num_ranks + rank]

    def totals(self, column: str) -> np.ndarray:
        c = self.COLUMNS.index(column)
        return np.array([ops[:, c].sum() if len(ops) else 0.0 for ops in self.ops])

    @property
    def busy(self) -> np.ndarray:
        return self.totals("compute")

    @property
    def comm(self) -> np.ndarray:
        return self.totals("comm")

    @property
    def offload(self) -> np.ndarray:
        return self.totals("offload")

    @property
    def a2a(self) -> np.ndarray:
        """Exposed two-level head all-to-all (NVLink) per GPU."""
        return self.totals("a2a")

    @property
    def moe_a2a(self) -> np.ndarray:
        """Exposed MoE token all-to-alls (expert parallelism) per GPU."""
        return self.totals("moe_a2a")

    @property
    def idle(self) -> np.ndarray:
        return self.step_time - self.busy - self.comm - self.offload - self.a2a - self.moe_a2a


def parse_barriers(plan: Plan) -> list[list[int]]:
    problems = barrier_errors(plan)
    if problems:
        raise PlanError(problems[0])
    return [list(b) for b in plan.barriers]


def micro_batch_work(plan: Plan, cluster: Cluster, cost: CostModel):
    """Per rank and micro-batch: (forward Work, backward Work, coupling key or None)."""
    layers = plan.num_layers
    work: list[list] = [[None] * len(mbs) for mbs in plan.ranks]
    rings: dict[tuple, dict[int, int]] = defaultdict(dict)
    for rank, mbs in enumerate(plan.ranks):
        for m, mb in enumerate(mbs):
            key = ring_key(mb)
            if key is None:
                f, b = local_work(MemberLoad.of(mb), cost, layers)
                work[rank][m] = (f, b, None)
            elif rank in rings[key]:
                raise PlanError(f"rank {rank}: the ring micro-batch of sequences {list(key[1])} appears twice")
            else:
                rings[key][rank] = m
    for key, where in rings.items():
        ring = key[0]
        if set(where) != set(ring):
            raise PlanError(
                f"ring micro-batch of sequences {list(key[1])} on ring {ring} "
                f"is scheduled only on ranks {sorted(where)}"
            )
        loads = [MemberLoad.of(plan.ranks[r][where[r]]) for r in ring]
        first = plan.ranks[ring[0]][where[ring[0]]]
        u = first.heads_split
        costed = (
            two_level_ring_work(ring, u, loads, cluster, cost, layers)
            if u > 1
            else ring_work(ring, loads, cluster, cost, layers, first.transport)
        )
        for r, (f, b) in zip(ring, costed):
            work[r][where[r]] = (f, b, key)
    return work


def simulate(plan: Plan, cluster: Cluster, cost: CostModel) -> Timeline:
    """Run ``plan`` through the event model above; raise PlanError if it would deadlock."""
    if plan.num_ranks != cluster.d_hdp:
        raise PlanError(f"plan has {plan.num_ranks} ranks but the cluster has {cluster.d_hdp} HDP ranks")
    if plan.num_layers != cost.num_layers:
        raise PlanError(
            f"plan counts {plan.num_layers} layers per stage, the cost model {cost.num_layers}; "
            "build both for the same PP"
        )
    stages = cluster.pp
    if cluster.ep > 1 and plan.expert_parallel == 1:  # a baseline's plan, aligned as HDP's are
        if stages > 1:
            plan = align_pipelined_slots(plan, cluster.ep)
        else:
            plan = align_expert_slots(plan, cluster.ep)
    work = micro_batch_work(plan, cluster, cost)
    barriers = parse_barriers(plan)
    orders = plan.decoded_stage_orders()
    if orders is not None and (plan.stage_count != stages or barriers):
        raise PlanError(
            f"the plan orders {plan.stage_count} pipeline stages{' and has barriers' if barriers else ''}; "
            f"the cluster has PP {stages}: plan with pipeline_stages={stages} (stage orders and barriers do not mix)"
        )
    slot_of = _expert_slots(plan, cluster, cost, work, barriers)
    ep_floor = 0.0
    if slot_of is not None:  # every device runs its group's slots one after another
        for group in ep_groups(plan.num_ranks, plan.expert_parallel):
            slots = zip(*(work[r] for r in group))
            ep_floor = max(ep_floor, sum(max(f.duration + b.duration for f, b, _ in slot) for slot in slots))

    chunks = plan.virtual_stages
    if chunks > 1 and stages <= 1:
        raise PlanError(
            f"the plan has {chunks} virtual stages per device but the cluster has PP {stages}; "
            "plan with virtual_stages=1"
        )
    if chunks > 1:  # a chunk op does 1/V of the micro-batch's work on the device
        work = [[(_scaled(f, chunks), _scaled(b, chunks), key) for f, b, key in row] for row in work]

    def durations(rank: int, m: int) -> tuple[float, float]:
        f, b, _ = work[rank][m]
        return f.duration, b.duration

    if slot_of is not None:  # a merged slot: one unit, as long as its slowest participant
        units = [[slot_of[(rank, m)] for m in range(len(mbs))] for rank, mbs in enumerate(plan.ranks)]
    else:  # a ring micro-batch: one gang per virtual stage across its members
        units = [[key for _, _, key in row] for row in work]
    graph = PipelineGraph(units, stages, chunks, durations)
    seqs = graph.sequences(orders, barriers)
    end = _longest_paths(graph, seqs, len(barriers))
    ops = []
    peak = 0
    for idx in range(stages * plan.num_ranks):
        rank, stage = idx % plan.num_ranks, idx // plan.num_ranks
        row = [x for x in seqs[rank * stages + stage] if x < graph.total]
        arr = np.empty((len(row), len(Timeline.COLUMNS)))
        held = 0
        mine = {u: m for m, u in enumerate(graph.unit_at[rank])}  # this rank's micro-batch of each unit
        for j, nid in enumerate(row):
            u, _, direction = graph.split(nid)
            w = work[rank][mine[u]][direction]
            arr[j] = (end[nid] - w.duration, end[nid], direction, w.compute, w.comm, w.offload, w.a2a, w.moe_a2a)
            held += 1 if direction == FORWARD else -1
            peak = max(peak, held)
        ops.append(arr)
    step_time = max((float(end.max()) if len(end) else 0.0), 0.0)
    return Timeline(
        step_time=step_time,
        num_ranks=plan.num_ranks,
        stages=stages,
        ops=ops,
        barriers=[float(end[graph.total + b]) for b in range(len(barriers))],
        chunks=chunks,
        peak_in_flight=peak,
        ep_slot_floor=ep_floor,
    )


def _scaled(w: Work, share: float) -> Work:
    """``w`` divided among ``share`` model chunks: each chunk op does 1/share of it."""
    return Work(
        w.duration / share, w.compute / share, w.comm / share, w.offload / share, w.a2a / share, w.moe_a2a / share
    )


def _expert_slots(plan: Plan, cluster: Cluster, cost: CostModel, work, barriers) -> dict | None:
    """With expert parallelism: each micro-batch's merged slot (``planner/expert/slots.py``), with its
    MoE all-to-alls added to ``work`` in place; None without."""
    e = plan.expert_parallel
    if e == 1:
        return None
    if cluster.ep != e or barriers:
        raise PlanError(
            f"a plan with EP {e} slots runs on a cluster with EP {e}, without barriers "
            f"(this one: EP {cluster.ep}, {len(barriers)} barriers)"
        )
    problems = slot_errors(plan)
    if problems:
        raise PlanError(f"the plan's expert-parallel slots would deadlock: {problems[0]}")
    inter = [len({cluster.node_of(r) for r in g}) > 1 for g in ep_groups(plan.num_ranks, e)]
    for rank, mbs in enumerate(plan.ranks):
        for m, mb in enumerate(mbs):
            half = 0.5 * all_to_all_time(cost, max(mb.tokens, 1), e, inter[rank // e])
            f, b, key = work[rank][m]
            work[rank][m] = (
                replace(f, duration=f.duration + half, moe_a2a=half),
                replace(b, duration=b.duration + half, moe_a2a=half),
                key,
            )
    return slot_nodes(plan)


def _longest_paths(graph: PipelineGraph, seqs, barriers: int) -> np.ndarray:
    """End time of every node (start = latest end of all it waits for); PlanError on a cycle."""
    end, indeg = graph_ends(graph, seqs, barriers)
    if end is None:
        stuck = graph.stuck(seqs, indeg, limit=5)
        raise PlanError(
            "the plan deadlocks: ring micro-batches wait on each other in a cycle under the 1F1B order "
            f"(e.g. {'; '.join(stuck)}); order ring micro-batches so every member reaches them at the same "
            "1F1B position"
        )
    return end


def lower_bound(seq_lens, cluster: Cluster, cost: CostModel) -> float:
    """Seconds a step needs if all FLOPs were spread perfectly over all GPUs and nothing else cost time:

        LB = L * sum_s (a1 * s^2 + b1 * s) / (d_hdp * pp)

    with ``L`` the model's layers (``cost.num_layers * pp``): the attention and linear work of
    every sequence, whole (never split, so no ring), on one TP group at the cost model's
    throughput, divided by the number of TP groups. No per-micro-batch overhead ``g``, no
    communication, no offloading, no bubbles.
    """
    return cost.compute_bound(seq_lens, cluster.d_hdp)


def critical_path(seq_lens, cluster: Cluster, cost: CostModel) -> float:
    """Seconds the longest sequence needs on its own, at the best ring size, by the rules above.

    A lower bound no plan can beat, whatever else it runs: the sequence passes through every
    layer (all ``pp`` stages) in lockstep on one ring of some ``N`` ranks (1 .. d_hdp, memory
    ignored), each member holding ``s / N`` tokens; a ring larger than a node pays the
    network for its hops. With large rings each member still receives every KV block, so the
    time stops falling with ``N``: a 2M-token sequence cannot finish faster than its O(s)
    ring traffic, however much compute is spread.
    """
    s = float(max(seq_lens))
    n = np.arange(1, cluster.d_hdp + 1, dtype=float)
    n = n[n <= s]
    inter = n > cluster.hdp_per_node
    best = math.inf
    for transport in cost.ring_transports:  # each ring transport the model has: the better one
        ring = np.where(n > 1, cost.ring_layer_time(s, n, inter, transport), cost.layer_time(s))
        best = min(best, float(ring.min()) * cost.num_layers)
    sizes = np.arange(1, min(cluster.d_hdp, int(s)) + 1)
    for u in two_level.valid_splits(cost, cluster.hdp_per_node) if cluster.d_hdp > cluster.hdp_per_node else []:
        best = min(best, float(two_level.share_times(cost, int(s), sizes, u, cluster.hdp_per_node).min()))
    return best * cluster.pp


def pipeline_ring_floor(plan: Plan, cluster: Cluster, cost: CostModel) -> float:
    """Seconds no stage order can beat when some ring micro-batches span every pipeline
    (0 without pipelines or such rings). Every stage runs all of them one after another; the
    last stage cannot start one before a forward has crossed the ``p - 1`` stages above it,
    and after its last one a backward still crosses them back:

        (p - 1) * min_i F_i + sum_i (F_i + B_i) + (p - 1) * min_i B_i

    with ``F_i``, ``B_i`` ring ``i``'s forward and backward on one stage. For ``m`` equal
    rings that is ``(m + p - 1) x`` one ring's stage time: the 1F1B makespan of those rings
    alone, which other work cannot shorten (it can only fill the idle stages around them).
    With ``V`` model chunks per device (``plan.virtual_stages``) a forward crosses the
    ``p - 1`` devices above the last one chunk by chunk, ``F_i / V`` each, so both bubble
    terms shrink by ``V``: ``(m + (p - 1) / V) x`` one ring's stage time. But one ring alone
    still passes every virtual stage one after another, ``p (F_i + B_i)``, which no order
    shortens: with fewer rings than stages (``m < p``) that chain is the floor."""
    p = cluster.pp
    if p <= 1:
        return 0.0
    spans: dict[tuple, tuple[float, float]] = {}
    for mbs in plan.ranks:
        for mb in mbs:
            key = mb.ring_key
            if key is not None and len(key[0]) == plan.num_ranks and key not in spans:
                spans[key] = (0.0, 0.0)
    if not spans:
        return 0.0
    work = micro_batch_work(plan, cluster, cost)
    for r, mbs in enumerate(plan.ranks):
        for m, _mb in enumerate(mbs):
            f, b, key = work[r][m]
            if key in spans:
                spans[key] = (max(spans[key][0], f.duration), max(spans[key][1], b.duration))
    fs = [f for f, _ in spans.values()]
    bs = [b for _, b in spans.values()]
    v = plan.virtual_stages
    chain = p * max(f + b for f, b in zip(fs, bs))
    return max((p - 1) * min(fs) / v + sum(fs) + sum(bs) + (p - 1) * min(bs) / v, chain)


@dataclass
class StepResult:
    strategy: str
    timeline: Timeline
    lower_bound: float
    critical_path: float
    p2p_bytes: float  # all GPUs together
    p2p_bytes_max_gpu: float
    offload_bytes: float  # all GPUs together, device to host
    host_bytes_max_gpu: float  # pinned host memory the busiest GPU needs for offloaded activations
    microbatches: list[int]
    plan_time_s: float
    notes: list[str] = field(default_factory=list)
    grad_reduce_s: float = 0.0  # exposed gradient reduction after the step (sim.grad_reduction)
    grad_reduce_overlap_s: float = 0.0  # the same with --overlap-grad-reduce
    two_level_rings: int = 0  # ring micro-batches run two-level
    pipeline_ring_floor: float = 0.0  # rings spanning every pipeline: what no stage order beats
    virtual_stages: int = 1  # model chunks per pipeline device
    peak_in_flight: int = 0  # most (chunk) forwards any device held before their backward

    def metrics(self) -> dict:
        t = self.timeline
        busy = t.busy
        return {
            "step_time_s": t.step_time,
            "lower_bound_s": self.lower_bound,
            "critical_path_s": self.critical_path,
            "pipeline_ring_floor_s": self.pipeline_ring_floor,
            "ep_slot_floor_s": t.ep_slot_floor,
            "virtual_stages": self.virtual_stages,
            "chunks_in_flight_max": self.peak_in_flight,
            "x_lower_bound": t.step_time / self.lower_bound,
            "x_bound": t.step_time / max(self.lower_bound, self.critical_path),
            "busy_max_s": float(busy.max()),
            "busy_mean_s": float(busy.mean()),
            "idle_mean_s": float(t.idle.mean()),
            "exposed_comm_s": float(t.comm.mean()),
            "exposed_comm_max_s": float(t.comm.max()),
            "exposed_offload_s": float(t.offload.mean()),
            "exposed_a2a_s": float(t.a2a.mean()),
            "exposed_moe_a2a_s": float(t.moe_a2a.mean()),
            "two_level_rings": self.two_level_rings,
            "p2p_bytes": self.p2p_bytes,
            "p2p_bytes_max_gpu": self.p2p_bytes_max_gpu,
            "offload_bytes": self.offload_bytes,
            "host_bytes_max_gpu": self.host_bytes_max_gpu,
            "exposed_grad_reduce_s": self.grad_reduce_s,
            "exposed_grad_reduce_overlap_s": self.grad_reduce_overlap_s,
            "microbatches_max": max(self.microbatches),
            "microbatches_mean": float(np.mean(self.microbatches)),
            "plan_time_s": self.plan_time_s,
        }


def evaluate(plan: Plan, cluster: Cluster, cost: CostModel) -> StepResult:
    """Simulate ``plan`` and gather the per-strategy figures."""
    timeline = simulate(plan, cluster, cost)
    p2p = p2p_bytes_per_rank(
        plan,
        cost.kv_bytes_per_token,
        cost.grad_bytes_per_token,
        cost.num_layers,
        recomputed_layers=cost.recomputed_attention_layers,
        q_bytes_per_token=cost.q_bytes_per_token,
        latent_bytes_per_token=cost.latent_bytes_per_token if cost.latent_bytes_per_token > 0 else None,
        latent_grad_bytes_per_token=cost.latent_grad_bytes_per_token,
        o_bytes_per_token=cost.o_bytes_per_token or None,
    )
    gpus_per_rank = cluster.tp * cluster.pp  # every TP shard of every stage sends its share
    offload = 0.0
    host_max = 0.0
    v = plan.virtual_stages
    for mbs in plan.ranks:
        parked = []
        for mb in mbs:
            if mb.offload_ratio > 0:
                parked.append(offload_exposure(MemberLoad.of(mb), cost, plan.num_layers)[2])
        offload += sum(parked)
        # 1F1B: stage 0 holds up to pp micro-batches' activations before its first backward;
        # with V chunks a chunk forward holds 1/V of one, and the order may hold more or fewer
        # than pp x V of them (timeline.peak_in_flight): its micro-batch equivalents, rounded up
        held = cluster.pp if v == 1 else -(-timeline.peak_in_flight // v)
        host_max = max(host_max, sum(sorted(parked, reverse=True)[:held]))
    strategy = str(plan.meta.get("strategy", "?"))
    hdp = strategy not in ("static", "megatron-dcp", "megatron-dcp-dev")  # their rings run on CP groups of their own
    return StepResult(
        grad_reduce_s=exposed_reduction(plan, timeline, cost, cluster, overlap=False),
        grad_reduce_overlap_s=exposed_reduction(plan, timeline, cost, cluster, overlap=True, hdp_rule=hdp),
        strategy=strategy,
        timeline=timeline,
        lower_bound=lower_bound(plan.seq_lens, cluster, cost),
        critical_path=critical_path(plan.seq_lens, cluster, cost),
        pipeline_ring_floor=pipeline_ring_floor(plan, cluster, cost),
        virtual_stages=v,
        peak_in_flight=timeline.peak_in_flight,
        p2p_bytes=float(sum(p2p)) * gpus_per_rank,
        p2p_bytes_max_gpu=float(max(p2p)) if p2p else 0.0,
        offload_bytes=offload * gpus_per_rank,
        host_bytes_max_gpu=host_max,
        microbatches=[len(mbs) for mbs in plan.ranks],
        plan_time_s=float(plan.meta.get("plan_time_s", math.nan)),
        notes=list(plan.meta.get("notes", [])),
        two_level_rings=two_level_rings(plan),
    )


def two_level_rings(plan: Plan) -> int:
    """Ring micro-batches run two-level: one look per ring micro-batch (its members share one
    ``heads_split``), not one per member (a static plan's micro-batches hold ~10^2 pieces each)."""
    first: dict[tuple, MicroBatch] = {}
    for mbs in plan.ranks:
        for mb in mbs:
            key = mb.ring_key
            if key is not None and key not in first:
                first[key] = mb
    return sum(1 for mb in first.values() if mb.heads_split > 1)
