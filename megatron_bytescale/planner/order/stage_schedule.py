"""Per-stage operation orders for pipelines that share ring micro-batches, found by simulation.

``stage_schedule`` simulates all pipelines together and lets every stage pick what runs next
(``_list_schedule``): backwards first, then larger rings, then the rank's list order; a ready
operation of a larger ring reserves its members (smaller work only backfills); devices pass
messages in posting order; a stage holds at most ``cap`` micro-batches between forward and
backward (default ``p``: 1F1B's first stage). The orders are timed on the contract's
dependency graph (``contract.graph.PipelineGraph``, the simulator's rule) and kept only if
shorter than the base orders (1F1B, or the interleaved order with chunks). ``chunk_schedule``
does the same over chunk operations with ``V > 1`` model chunks per device and keeps the
shortest of it and the slot-aligned interleaved orders (``order/interleaved.py``). Why the orders
cannot deadlock, and what the search buys on which batches: docs/design.md, "Stage orders".
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..contract import BACKWARD, FORWARD, Op, PipelineGraph, interleaved_order
from .interleaved import slot_interleaved_orders, slot_offsets
from .walk import Longer, end_times, finish_times_of

_EPS = 1e-12
# With chunks, Megatron's warm-up cap is tried after 1F1B's only on batches of at most this
# many operations (each try simulates every operation)
SECOND_CAP_OPS = 60_000
# ``chunk_schedule``'s candidates: the default interleaved order, the slot-aligned ones (the
# greedy run's, Megatron's fixed schedule) and the list schedule
CHUNK_ORDERS = ("interleaved", "slot-aligned", "megatron", "list")


@dataclass
class StageSchedule:
    orders: list[list[list[Op]]]  # per rank, per stage: its ops in run order
    finish: list[float]  # estimated finish per rank (its stages' last end)
    peak_in_flight: int  # most micro-batches (chunk forwards) any stage held between forward and backward
    cap: int = 0  # the memory cap the orders were scheduled under (chunk forwards with chunks)

    @property
    def makespan(self) -> float:
        return max(self.finish, default=0.0)


def stage_schedule(
    ring_keys: Sequence[Sequence[object | None]],
    times: Sequence[Sequence[float]],
    stages: int,
    forward_share: float,
    cap: int | None = None,
    base_orders=None,
    chunks: int = 1,
) -> StageSchedule | None:
    """The list schedule's per-stage orders for these pipelines (see the module docstring),
    or None when they do not beat ``base_orders`` (default 1F1B). They are timed by
    ``PipelineGraph.evaluate`` (the simulator's rule), so the finish times are what the simulator
    will find. ``ring_keys[r][m]``: the ring micro-batch rank ``r``'s micro-batch ``m``
    belongs to (None: local); ``times[r][m]``: its seconds on one stage, forward + backward
    (a ring operation lasts its slowest member's share). With ``chunks`` model chunks per
    device the operations are chunk operations, ``cap`` counts chunk forwards (default
    ``p * chunks``: the activations of 1F1B's ``p`` micro-batches) and the default base is
    the interleaved order; the orders are ``Op`` lists per rank and device."""
    p = stages
    # With chunks: first 1F1B's memory (p x V chunk forwards); gangs of rings can stall each
    # other under it, so also Megatron's interleaved warm-up (p x V + p - 1: what the
    # default interleaved order holds on the first device anyway); the shorter is kept.
    caps = ([p] if chunks == 1 else [p * chunks, p * chunks + p - 1]) if cap is None else [cap]
    if min(caps) < 1:
        raise ValueError(f"cap must be >= 1 micro-batch in flight, got {cap}")
    ops = PipelineGraph.of_times(ring_keys, times, p, forward_share, chunks)
    if base_orders is None:
        base_orders = [[interleaved_order(len(keys), p, k, chunks) for k in range(p)] for keys in ring_keys]
    base = ops.sequences(base_orders)
    base_end = end_times(ops, base)
    best = None
    best_time = max(ops.finish(base_end), default=0.0) if base_end is not None else float("inf")
    ran = False
    if cap is None and chunks > 1:  # only if both stall: more memory, then no cap (the peak is reported)
        caps += [2 * p * chunks, ops.total]
    for i, c in enumerate(caps):
        if ran and (c > p * chunks + p - 1 or (i > 0 and ops.total > SECOND_CAP_OPS)):
            break
        seqs = _list_schedule(ops, c)
        ran = ran or seqs is not None
        if seqs is not None:
            end = end_times(ops, seqs)
            if end is not None:
                t = max(ops.finish(end), default=0.0)
                if t < best_time * (1 - 1e-9):
                    best, best_time = (seqs, end, c), t
    if best is None:
        return None
    seqs, end, c = best
    return StageSchedule(ops.orders(seqs), ops.finish(end), ops.peak(seqs), c)


def _list_schedule(ops: PipelineGraph, cap: int) -> list[list[int]] | None:
    """Per-resource sequences from simulating all pipelines with the rules of the module
    docstring (event by event), or None if the simulation stalls."""
    p, n, vp = ops.p, ops.n, ops.vp
    size, pos, dur, res_of = ops.size, ops.pos, ops.dur, ops.res
    nres = n * p
    busy_until = [0.0] * nres
    # memory in chunk forwards: a micro-batch entering a device (its chunk 0 there) reserves
    # the places of all its V chunks at once, released by its backwards, so its later chunks
    # never wait for memory that earlier micro-batches hold (no memory deadlock across chunks)
    inflight = [0] * nres
    v = ops.v
    announced: list[set[int]] = [set() for _ in range(nres)]  # known ready time, not started
    ready_at = [0.0] * ops.total
    started = [False] * ops.total
    seqs: list[list[int]] = [[] for _ in range(nres)]
    events: list[tuple[float, int]] = []  # (end, op) of running operations
    # Devices exchange activations in posting order, one stream per device pair and
    # direction (device d sends forwards to d + 1 mod p, backwards to d - 1 mod p): a
    # receiving operation runs only when it is the next message of its stream. Per resource:
    # the (unit, virtual stage) messages it sent forward (backward), and how many it received.
    f_sent: list[list[tuple[int, int]]] = [[] for _ in range(nres)]
    b_sent: list[list[tuple[int, int]]] = [[] for _ in range(nres)]
    f_got = [0] * nres
    b_got = [0] * nres

    def in_turn(op: int) -> bool:
        u, vs, d = op // (2 * vp), (op // 2) % vp, op % 2
        if d == FORWARD and vs > 0:
            for res in res_of[op // 2]:
                sent = f_sent[(res // p) * p + (vs - 1) % p]
                got = f_got[res]
                if got >= len(sent) or sent[got] != (u, vs):
                    return False
        elif d == BACKWARD and vs < vp - 1:
            for res in res_of[op // 2]:
                sent = b_sent[(res // p) * p + (vs + 1) % p]
                got = b_got[res]
                if got >= len(sent) or sent[got] != (u, vs):
                    return False
        return True

    def prio(op: int) -> tuple:  # backwards, larger rings, list order, deeper chunks first
        u, d = op // (2 * vp), op % 2
        return (-d, -size[u], pos[u], -((op // 2) % vp), u)

    def announce(op: int, when: float) -> None:
        ready_at[op] = when
        for res in res_of[op // 2]:
            announced[res].add(op)

    for u in range(ops.units):
        announce((u * vp) * 2, 0.0)  # forwards on the first virtual stage need nothing
    done = 0
    t = 0.0
    todo = set(range(nres))
    while done < ops.total:
        est_memo: dict[int, float] = {}
        full_memo: dict[int, bool] = {}

        def est_of(q: int) -> float:
            e = est_memo.get(q)
            if e is None:
                e = ready_at[q]
                for res in res_of[q // 2]:
                    if busy_until[res] > e:
                        e = busy_until[res]
                est_memo[q] = e
            return e

        def full(q: int) -> bool:
            f = full_memo.get(q)
            if f is None:
                f = full_memo[q] = (q // 2) % vp < p and any(inflight[x] + v > cap for x in res_of[q // 2])
            return f

        cands = set()
        for res in todo:
            if busy_until[res] <= t + _EPS:
                for op in announced[res]:
                    if ready_at[op] <= t + _EPS:
                        cands.add(op)
        for op in sorted(cands, key=prio):
            if started[op]:
                continue
            resources = res_of[op // 2]
            if any(busy_until[res] > t + _EPS for res in resources):
                continue
            d, me = op % 2, size[op // (2 * vp)]
            enters = d == FORWARD and (op // 2) % vp < p  # chunk 0: the micro-batch enters the device
            if enters and any(inflight[res] + v > cap for res in resources):
                continue
            if not in_turn(op):
                continue
            op_end = t + dur[op]
            ok = True
            for res in resources:
                for q in announced[res]:
                    if q == op or size[q // (2 * vp)] <= me or not in_turn(q):
                        continue  # only a larger ring's operation that may run next reserves
                    if q % 2 == FORWARD:
                        if full(q):
                            continue  # waits for memory anyway: no reservation
                        if enters and cap > v and inflight[res] + 2 * v > cap:
                            ok = False  # keep the larger ring's forward a place on this stage
                            break
                    if op_end > est_of(q) + _EPS:
                        ok = False
                        break
                if not ok:
                    break
            if not ok:
                continue
            started[op] = True
            done += 1
            full_memo.clear()
            est_memo.clear()
            u, vs = op // (2 * vp), (op // 2) % vp
            for res in resources:
                busy_until[res] = op_end
                announced[res].discard(op)
                inflight[res] += (v if enters else 0) if d == FORWARD else -1
                seqs[res].append(op)
                _message(res, d, u, vs, vp, f_sent, f_got, b_sent, b_got)
            heapq.heappush(events, (op_end, op))
            nxt = ops.next_op(op)
            if nxt is not None:
                announce(nxt, op_end)
        if done == ops.total:
            break
        if not events:
            if todo == set(range(nres)):
                return None  # nothing runs and nothing can start: stalled
            todo = set(range(nres))
            continue
        t = events[0][0]
        todo = set()
        while events and events[0][0] <= t + _EPS:
            _, op = heapq.heappop(events)
            todo.update(res_of[op // 2])
            nxt = ops.next_op(op)
            if nxt is not None:
                todo.update(res_of[nxt // 2])
    return seqs


def _message(res: int, d: int, u: int, vs: int, vp: int, f_sent, f_got, b_sent, b_got) -> None:
    """Resource ``res`` started (unit ``u``, virtual stage ``vs``, direction ``d``): the
    message it sends on (forward to the next virtual stage, backward to the previous) and
    the one it received."""
    if d == FORWARD:
        if vs < vp - 1:
            f_sent[res].append((u, vs + 1))
        if vs > 0:
            f_got[res] += 1
    else:
        if vs > 0:
            b_sent[res].append((u, vs - 1))
        if vs < vp - 1:
            b_got[res] += 1


def chunk_schedule(
    ring_keys: Sequence[Sequence[object | None]],
    times: Sequence[Sequence[float]],
    stages: int,
    forward_share: float,
    chunks: int,
    known: dict | None = None,
) -> tuple[list | None, list[float], int, str] | None:
    """Chunk orders for pipelines of ``chunks`` model chunks per device: the shortest estimated
    of the default interleaved order (if it does not deadlock), the slot-aligned interleaved
    orders (``interleaved.slot_interleaved_orders``, the greedy run's and Megatron's fixed
    schedule: safe whenever the rings sit at one slot, as ``order_runs``
    places them) and, where they all deadlock or the batch is small, the list schedule over
    chunk operations (``stage_schedule``); those of ``CHUNK_ORDERS``. Returns (orders, None for
    the default; finish per rank; the most chunk forwards a device may hold under them; what
    was kept), or None if every candidate deadlocks. ``known``: orders already evaluated for
    these runs (``slots.rank_estimates``' ``known``), reused instead of evaluated again;
    a slot-aligned order's walk stops once it is longer than the shortest so far or known
    (``Longer``, named in what was kept as "over" that step)."""
    p = stages
    megatron_cap = p * chunks + p - 1  # Megatron's interleaved warm-up, first device
    cands = []
    known = known or {}
    finish_of = finish_times_of(ring_keys, times, p, forward_share, chunks)  # the graph's arrays made once
    _, finish = known.get(None) or (None, None)
    if None not in known or isinstance(finish, Longer):  # not walked, or stopped at another plan's step
        finish = finish_of(None)
    longer = []  # (name, limit) of the orders whose walks stopped once longer than a shorter one
    if finish is not None and "interleaved" in CHUNK_ORDERS:
        cands.append((max(finish, default=0.0), None, finish, "the interleaved order"))
    # Megatron's groups of p slots, shifted by phantom slots so that a group starts where some
    # pipeline starts (a pipeline starting mid-group runs a short first group: more bubble)
    offsets = slot_offsets(ring_keys)
    shifts = sorted({-o % p for o in offsets}) if offsets else [0]
    variants = [(False, 0)] + [(True, k) for k in shifts]
    variants = [v for v in variants if ("megatron" if v[0] else "slot-aligned") in CHUNK_ORDERS]
    # the shortest of the orders already walked (``known``) bounds the walks from the start:
    # an order walked before one known to be shorter stops at that one's step
    shortest = min(
        (
            max(f, default=0.0)
            for v, (_, f) in known.items()
            if (v in variants or (v is None and "interleaved" in CHUNK_ORDERS)) and isinstance(f, list)
        ),
        default=math.inf,
    )
    for megatron, shift in variants:
        if (megatron, shift) in known:
            orders, finish = known[megatron, shift]
        else:
            orders = (
                None if offsets is None else slot_interleaved_orders(ring_keys, p, chunks, megatron, shift, offsets)
            )
            # the walk may stop once longer than the shortest so far: it could not be kept
            finish = None if orders is None else finish_of(orders, min([shortest] + [c[0] for c in cands]))
        name = (
            "the slot-aligned "
            + ("Megatron " if megatron else "")
            + "interleaved order"
            + (f" (shifted {shift})" if shift else "")
        )
        if isinstance(finish, Longer):
            longer.append((name, finish.limit))
        elif finish is not None:
            cands.append((max(finish, default=0.0), orders, finish, name))
    best = min(cands, key=lambda c: c[0]) if cands else None
    ops = 2 * p * chunks * sum(len(k) for k in ring_keys)
    if (best is None or ops <= SECOND_CAP_OPS) and "list" in CHUNK_ORDERS:
        found = stage_schedule(
            ring_keys, times, p, forward_share, chunks=chunks, base_orders=None if best is None else best[1]
        )
        if found is not None and (best is None or found.makespan < best[0]):
            against = f" against {best[3]}'s {best[0]:.4g} s)" if best else ")"
            what = f"the list schedule ({found.makespan:.4g} s" + against
            return found.orders, found.finish, found.cap, what
    if best is None:
        return None
    others = ", ".join(
        [f"{c[3]} {c[0]:.4g} s" for c in cands if c is not best] + [f"{n} over {t:.4g} s" for n, t in longer]
    )
    return best[1], best[2], megatron_cap, f"{best[3]} ({best[0]:.4g} s" + (f"; {others})" if others else ")")
