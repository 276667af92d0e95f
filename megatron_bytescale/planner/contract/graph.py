"""The dependency graph of pipelines that share ring micro-batches: the one model of what
waits for what, used by ``Plan.validate`` (deadlock), the estimate (1F1B time), the
stage-order search (``stage_schedule``) and the simulator (``sim.timeline``).

A *unit* is one micro-batch as the graph sees it: a ring micro-batch (one unit shared by all
its members: their operations run as one gang), a local micro-batch of one rank, or
whatever the caller merges (the simulator's expert-parallel slots). With ``P = stages *
chunks`` virtual stages, the operation of unit ``u`` on virtual stage ``vs`` in direction
``d`` has the id ``(u * P + vs) * 2 + d``. It waits for

* the previous operation in the order of every member's device (a *resource*: rank ``r``'s
  device ``k`` is resource ``r * stages + k``);
* in its micro-batch: a forward for the previous virtual stage's forward, a backward for the
  next virtual stage's backward (on the last virtual stage: its own forward).

An operation starts when all it waits for has ended and lasts its unit's duration in that
direction (the longest of its members'). A cycle is a deadlock.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from functools import cached_property, lru_cache

from .ops import FORWARD, Op, interleaved_order

Orders = Sequence[Sequence[Sequence[Sequence[int]]]]  # per rank, per device: its ops in run order


class PipelineGraph:
    """Units, operation ids and durations of a batch of pipelines (see the module docstring).

    ``unit_keys[r][m]``: what rank ``r``'s micro-batch ``m`` shares with other ranks (e.g. its
    ``MicroBatch.ring_key``), or None for local work. ``durations(r, m)``: (forward,
    backward) seconds of one chunk operation of that micro-batch on one device (None: 0)."""

    def __init__(
        self,
        unit_keys: Sequence[Sequence[Hashable | None]],
        stages: int,
        chunks: int = 1,
        durations: Callable[[int, int], tuple[float, float]] | None = None,
    ):
        self.p = stages
        self.v = chunks
        vp = self.vp = stages * chunks
        self.n = len(unit_keys)
        unit_of: dict[object, int] = {}
        self.members: list[list[tuple[int, int]]] = []  # per unit: (rank, micro-batch) of each member
        self.unit_at: list[list[int]] = []  # per rank and micro-batch: its unit
        fwd: list[float] = []
        bwd: list[float] = []
        for r, keys in enumerate(unit_keys):
            row = []
            for m, key in enumerate(keys):
                u = None if key is None else unit_of.get(key)
                if u is None:
                    u = len(self.members)
                    if key is not None:
                        unit_of[key] = u
                    self.members.append([])
                    fwd.append(0.0)
                    bwd.append(0.0)
                self.members[u].append((r, m))
                if durations is not None:
                    f, b = durations(r, m)
                    fwd[u] = max(fwd[u], f)
                    bwd[u] = max(bwd[u], b)
                row.append(u)
            self.unit_at.append(row)
        self.units = len(self.members)
        self.size = [len(ms) for ms in self.members]
        self.pos = [min(m for _, m in ms) for ms in self.members]  # the schedule's order
        self.total = self.units * vp * 2
        self.dur = [0.0] * self.total
        if durations is not None:
            for u in range(self.units):
                for vs in range(vp):
                    base = (u * vp + vs) * 2
                    self.dur[base] = fwd[u]
                    self.dur[base + 1] = bwd[u]

    @cached_property
    def res(self) -> list[list[int]]:
        """Per (unit, virtual stage): the resources its operations occupy (the stage-order
        search's; the evaluation does not need them)."""
        p = self.p
        return [[r * p + vs % p for r, _ in self.members[u]] for u in range(self.units) for vs in range(self.vp)]

    @classmethod
    def of_times(cls, unit_keys, times: Sequence[Sequence[float]], stages: int, forward_share: float, chunks: int = 1):
        """The graph with ``times[r][m]`` a micro-batch's seconds on one stage, forward and
        backward: a chunk forward lasts ``forward_share`` of it over ``chunks``."""

        def durations(r: int, m: int) -> tuple[float, float]:
            t = float(times[r][m])
            return forward_share * t / chunks, (1.0 - forward_share) * t / chunks

        return cls(unit_keys, stages, chunks, durations)

    # ----------------------------------------------------------------- ids
    def op(self, r: int, vs: int, d: int, m: int) -> int:
        return (self.unit_at[r][m] * self.vp + vs) * 2 + d

    def id_of(self, r: int, device: int, op: Op) -> int:
        return self.op(r, op.chunk * self.p + device, op.direction, op.micro_batch)

    def split(self, op_id: int) -> tuple[int, int, int]:
        """(unit, virtual stage, direction) of an operation id."""
        return op_id // (2 * self.vp), (op_id // 2) % self.vp, op_id % 2

    def next_op(self, op: int) -> int | None:
        """The operation that waits for ``op`` in the same micro-batch."""
        vp = self.vp
        u, vs, d = op // (2 * vp), (op // 2) % vp, op % 2
        if d == FORWARD:
            return (u * vp + vs + 1) * 2 if vs < vp - 1 else op + 1
        return (u * vp + vs - 1) * 2 + 1 if vs > 0 else None

    # ----------------------------------------------------------------- orders
    def default_orders(self, barriers: Sequence[Sequence[int]] = ()) -> list[list[list[Op]]]:
        """Every device's default order (1F1B, or interleaved with chunks), run separately on
        each segment between ``barriers`` (per barrier: micro-batches finished per rank)."""
        out = []
        for r, row in enumerate(self.unit_at):
            bounds = [0] + [b[r] for b in barriers] + [len(row)]
            per_device = []
            for k in range(self.p):
                if not barriers:
                    per_device.append(interleaved_order(len(row), self.p, k, self.v))
                    continue
                order = []
                for lo, hi in zip(bounds, bounds[1:]):
                    order += [Op(d, lo + m, c) for d, m, c in interleaved_order(hi - lo, self.p, k, self.v)]
                per_device.append(order)
            out.append(per_device)
        return out

    def sequences(self, orders: Orders | None = None, barriers: Sequence[Sequence[int]] = ()) -> list[list[int]]:
        """Per resource (rank * stages + device): its operation ids in run order (``orders``
        per rank and device; None: the default orders). Barrier ``b`` is the node ``total +
        b`` in every resource's sequence, after the micro-batches finished before it."""
        if orders is None and not barriers:
            return self._default_sequences()
        if orders is None:
            orders = self.default_orders(barriers)
        elif barriers:
            raise ValueError("barriers need the default orders: stage orders and barriers do not mix")
        out = []
        p, vp, total = self.p, self.vp, self.total
        if not barriers:  # the loop below without its barrier bookkeeping
            for r in range(self.n):
                units = self.unit_at[r]
                for k in range(p):
                    out.append(
                        [
                            (units[op[1]] * vp + (op[2] if len(op) == 3 else 0) * p + k) * 2 + op[0]
                            for op in orders[r][k]
                        ]
                    )
            return out
        for r in range(self.n):
            bounds = [b[r] for b in barriers]
            units = self.unit_at[r]
            for k in range(p):
                seq, b = [], 0
                for op in orders[r][k]:
                    d, m, c = op if len(op) == 3 else (op[0], op[1], 0)
                    while b < len(bounds) and m >= bounds[b]:  # the default orders run segment by segment
                        seq.append(total + b)
                        b += 1
                    seq.append((units[m] * vp + c * p + k) * 2 + d)
                seq += [total + i for i in range(b, len(bounds))]
                out.append(seq)
        return out

    def _default_sequences(self) -> list[list[int]]:
        """``sequences()`` for the default orders without barriers: each device's order is a
        fixed pattern per micro-batch count (``_default_pattern``), mapped to operation ids."""
        out = []
        p, vp = self.p, self.vp
        for units in self.unit_at:
            for k in range(p):
                out.append([(units[m] * vp + vs) * 2 + d for d, m, vs in _default_pattern(len(units), p, k, self.v)])
        return out

    # ----------------------------------------------------------------- evaluation
    def edges(self, seqs: Sequence[Sequence[int]], extra: int = 0) -> tuple[list[list[int]], list[int]]:
        """(successors, in-degree) of every node: ``total`` operations and ``extra`` barriers."""
        n = self.total + extra
        indeg = [0] * n
        succ: list[list[int]] = [[] for _ in range(n)]
        for seq in seqs:
            for a, b in zip(seq, seq[1:]):
                if a != b:
                    succ[a].append(b)
                    indeg[b] += 1
        # in each micro-batch (``next_op``, unrolled): forward vs -> forward vs + 1, the last
        # forward -> the last backward, backward vs -> backward vs - 1
        last = 2 * (self.vp - 1)
        for base in range(0, self.total, 2 * self.vp):
            for f in range(base, base + last, 2):
                succ[f].append(f + 2)
                indeg[f + 2] += 1
            succ[base + last].append(base + last + 1)
            indeg[base + last + 1] += 1
            for b in range(base + 3, base + last + 2, 2):
                succ[b].append(b - 2)
                indeg[b - 2] += 1
        return succ, indeg

    def evaluate(self, seqs: Sequence[Sequence[int]], barriers: int = 0) -> list[float] | None:
        """End of every node when each resource runs ``seqs`` in order and an operation starts
        once all it waits for has ended; None if the orders deadlock."""
        succ, indeg = self.edges(seqs, barriers)
        return longest_paths(succ, indeg, self.dur + [0.0] * barriers)

    def finish(self, end: Sequence[float]) -> list[float]:
        """Per rank: when its last operation ends (a unit's backward on virtual stage 0)."""
        finish = [0.0] * self.n
        for u in range(self.units):
            e = end[(u * self.vp) * 2 + 1]
            for r, _ in self.members[u]:
                if e > finish[r]:
                    finish[r] = e
        return finish

    def orders(self, seqs: Sequence[Sequence[int]]) -> list[list[list[Op]]]:
        """Per rank and device: its ops, from operation-id sequences (no barriers)."""
        out = [[[] for _ in range(self.p)] for _ in range(self.n)]
        vp = self.vp
        for idx, seq in enumerate(seqs):
            r, k = divmod(idx, self.p)
            mine = {self.unit_at[r][m]: m for m in range(len(self.unit_at[r]))}
            out[r][k] = [Op(op % 2, mine[op // (2 * vp)], ((op // 2) % vp) // self.p) for op in seq]
        return out

    def peak(self, seqs: Sequence[Sequence[int]]) -> int:
        """Most forwards any resource runs before their backwards."""
        peak = 0
        for seq in seqs:
            c = 0
            for op in seq:
                if op < self.total:
                    c += 1 if op % 2 == FORWARD else -1
                    peak = max(peak, c)
        return peak

    def stuck(self, seqs: Sequence[Sequence[int]], indeg: Sequence[int], limit: int | None = None) -> list[str]:
        """After a failed ``longest_paths``: each resource's first operation still waiting, for
        the first ``limit`` resources that have one (all if None). A deadlocked plan can leave
        every resource waiting on a ring of thousands of members: the messages only name a
        few, so only those are looked up."""
        out = []
        for idx, seq in enumerate(seqs):
            if limit is not None and len(out) >= limit:
                break
            first = next((x for x in seq if indeg[x] > 0 and x < self.total), None)
            if first is not None:
                r, k = divmod(idx, self.p)
                u, _, d = self.split(first)
                m = next(m for x, m in self.members[u] if x == r)
                out.append(f"rank {r} stage {k} {'forward' if d == FORWARD else 'backward'} of micro-batch {m}")
        return out


@lru_cache(maxsize=4096)
def _default_pattern(count: int, stages: int, device: int, chunks: int) -> tuple[tuple[int, int, int], ...]:
    """(direction, micro-batch, virtual stage) of each op of a device's default order."""
    return tuple((d, m, c * stages + device) for d, m, c in interleaved_order(count, stages, device, chunks))


def longest_paths(succ: Sequence[Sequence[int]], indeg: list[int], duration: Sequence[float]) -> list[float] | None:
    """End time of every node of a DAG (a node starts at the latest end of its predecessors),
    walked in Kahn's order; ``indeg`` is consumed. None if a cycle leaves nodes unvisited:
    those keep ``indeg > 0`` (``PipelineGraph.stuck`` names them)."""
    start = [0.0] * len(succ)
    end = [0.0] * len(succ)
    ready = [v for v, d in enumerate(indeg) if d == 0]
    done = 0
    while ready:
        v = ready.pop()
        done += 1
        e = end[v] = start[v] + duration[v]
        for w in succ[v]:
            if e > start[w]:
                start[w] = e
            indeg[w] -= 1
            if indeg[w] == 0:
                ready.append(w)
    return end if done == len(succ) else None


def find_pipeline_deadlock(unit_keys, stages: int, orders: Orders | None = None, chunks: int = 1) -> str | None:
    """None if ranks running their default orders (or ``orders``) over ``stages`` devices of
    ``chunks`` model chunks always make progress, else where they get stuck."""
    graph = PipelineGraph(unit_keys, stages, chunks)
    seqs = graph.sequences(orders)
    succ, indeg = graph.edges(seqs)
    if longest_paths(succ, indeg, graph.dur) is not None:
        return None
    stuck = graph.stuck(seqs, indeg, limit=3)
    waiting = sum(d > 0 for d in indeg)
    return f"{waiting} pipeline operations wait in a cycle, e.g. {'; '.join(stuck)}"


def pipelined_finish_times(
    unit_keys,
    times: Sequence[Sequence[float]],
    stages: int,
    forward_share: float,
    orders: Orders | None = None,
    chunks: int = 1,
) -> list[float] | None:
    """Finish per rank when every rank runs its default orders (or ``orders``) over ``stages``
    equal stages of ``chunks`` equal chunks each, ``times[r][m]`` a micro-batch's seconds on
    one stage (a shared unit lasts its slowest member's): the longest paths through the
    graph. None if it deadlocks."""
    graph = PipelineGraph.of_times(unit_keys, times, stages, forward_share, chunks)
    end = graph.evaluate(graph.sequences(orders))
    return None if end is None else graph.finish(end)


def one_f_one_b_time(mb_times: Sequence[float], stages: int, forward_share: float) -> float:
    """Seconds one pipeline of ``stages`` equal stages takes for micro-batches of these stage
    times under 1F1B, nothing else waiting."""
    if not mb_times:
        return 0.0
    if stages <= 1:
        return float(sum(mb_times))
    return max(pipelined_finish_times([[None] * len(mb_times)], [mb_times], stages, forward_share))
