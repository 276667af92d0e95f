"""One pipeline operation, ``Op``, its encoding in a Plan, and the standard orders.

Names, used everywhere (planner, runtime, simulator, tests):

* a *stage* (or *device*) is one GPU of a pipeline of ``stages``;
* a *chunk* is one of the ``chunks`` model chunks a device holds (Megatron's virtual
  pipeline: ``Plan.virtual_stages`` chunks per device; 1 without interleaving);
* the *virtual stage* of chunk ``c`` on device ``d`` is ``c * stages + d``: where it sits in
  the model's layer order (Megatron's interleaved layout);
* an *op* is the forward or the backward of one chunk of one micro-batch on one device:
  ``Op(direction, micro_batch, chunk)``; a device's *order* is its ops in run order.

``Plan.stage_orders`` stores an op as one signed int (``Op.code``): ``m * chunks + c`` for a
forward, ``-1 - (m * chunks + c)`` for a backward.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from functools import lru_cache
from typing import NamedTuple

FORWARD, BACKWARD = 0, 1


class Op(NamedTuple):
    """The forward (``direction`` 0) or backward (1) of chunk ``chunk`` of micro-batch
    ``micro_batch`` on one device."""

    direction: int
    micro_batch: int
    chunk: int = 0

    def code(self, chunks: int) -> int:
        """This op as ``Plan.stage_orders`` stores it."""
        x = self.micro_batch * chunks + self.chunk
        return x if self.direction == FORWARD else -1 - x

    @classmethod
    def from_code(cls, code: int, chunks: int) -> Op:
        direction, x = (FORWARD, code) if code >= 0 else (BACKWARD, -1 - code)
        m, c = divmod(x, chunks)
        return cls(direction, m, c)

    def virtual_stage(self, device: int, stages: int) -> int:
        return self.chunk * stages + device


def as_ops(order: Iterable[Sequence[int]]) -> list[Op]:
    """An order's entries as ``Op`` (a (direction, micro-batch) pair is chunk 0)."""
    return [Op(*op) for op in order]


def encode_stage_orders(orders, chunks: int = 1) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """``Plan.stage_orders`` from orders per rank and device (``Op`` or tuples)."""
    return tuple(tuple(tuple(op.code(chunks) for op in as_ops(stage)) for stage in rank) for rank in orders)


def decode_order(codes: Sequence[int], chunks: int = 1) -> list[Op]:
    """One device's order from its ``Plan.stage_orders`` codes."""
    return [Op.from_code(code, chunks) for code in codes]


def one_f_one_b(count: int, stages: int, stage: int) -> list[Op]:
    """1F1B on one stage of a ``stages``-deep pipeline: ``stages - stage - 1`` warm-up
    forwards, then one forward one backward, then the cool-down backwards."""
    warmup = min(stages - stage - 1, count)
    order = [Op(FORWARD, m) for m in range(warmup)]
    for i in range(count - warmup):
        order.append(Op(FORWARD, warmup + i))
        order.append(Op(BACKWARD, i))
    order.extend(Op(BACKWARD, m) for m in range(count - warmup, count))
    return order


def interleaved_order(count: int, stages: int, stage: int, chunks: int) -> list[Op]:
    """The default order of device ``stage``: Megatron's interleaved 1F1B
    (``megatron_interleaved_orders``) for any count; ``chunks == 1`` is ``one_f_one_b``."""
    if chunks == 1:
        return one_f_one_b(count, stages, stage)
    return list(_megatron_orders(count, stages, chunks)[stage])


@lru_cache(maxsize=256)
def _megatron_orders(count: int, stages: int, chunks: int) -> tuple[tuple[Op, ...], ...]:
    return tuple(tuple(o) for o in megatron_interleaved_orders(count, stages, chunks))


def megatron_interleaved_orders(count: int, stages: int, chunks: int) -> list[list[Op]]:
    """Every device's order under Megatron's interleaved 1F1B for ``count`` micro-batches:
    forwards in groups of ``stages`` micro-batches, each group chunk by chunk, backwards in
    the same order with the chunks reversed; device ``d`` runs ``2 (stages - 1 - d) +
    (chunks - 1) stages`` warm-up forwards, then one forward one backward, then the cool-down
    backwards. When ``count`` is not a multiple of ``stages`` the schedule is made for
    ``count`` rounded up to one and the phantom micro-batches are dropped (why this cannot
    deadlock: docs/design.md, "Virtual pipeline stages")."""
    p, v = stages, chunks
    padded = -(-count // p) * p
    total = padded * v

    def chunk_op(k: int, direction: int) -> Op:
        m = (k // (p * v)) * p + k % p
        c = (k % (p * v)) // p
        return Op(direction, m, c if direction == FORWARD else v - 1 - c)

    orders = []
    for d in range(p):
        warmup = min(2 * (p - 1 - d) + (v - 1) * p, total)
        order = [chunk_op(k, FORWARD) for k in range(warmup)]
        for i in range(total - warmup):
            order.append(chunk_op(warmup + i, FORWARD))
            order.append(chunk_op(i, BACKWARD))
        order.extend(chunk_op(k, BACKWARD) for k in range(total - warmup, total))
        orders.append([op for op in order if op.micro_batch < count])
    return orders
