"""The Plan: the contract between the planner and everything that executes or costs it.

It imports only the base layer (``errors``, ``units``): the runtime, the simulator and the
Megatron glue read plans through it without loading the schedulers above it.

* ``plan``: ``Piece``, ``MicroBatch`` (with its ``ring_key``), ``Plan``, JSON, fast builders;
* ``ops``: ``Op``, one pipeline operation, its encoding in ``Plan.stage_orders``, and the
  default orders (1F1B, Megatron's interleaved 1F1B);
* ``graph``: the one dependency graph of pipelines sharing ring micro-batches (deadlock,
  longest paths, finish times);
* ``rules``: the invariants ``Plan.validate`` checks, one function each; ``slots``: the
  expert-parallel slot rule; ``zigzag``: each ring member's share of a sequence;
  ``transports``: what a ring may carry (K and V, or an MLA latent).
"""

from .graph import PipelineGraph, find_pipeline_deadlock, longest_paths, one_f_one_b_time, pipelined_finish_times
from .ops import (
    BACKWARD,
    FORWARD,
    Op,
    as_ops,
    decode_order,
    encode_stage_orders,
    interleaved_order,
    megatron_interleaved_orders,
    one_f_one_b,
)
from .plan import PLAN_FORMAT_VERSION, MicroBatch, Piece, Plan, micro_batch, ring_pieces, whole_piece, whole_pieces
from .rules import crossing_order_mismatch, plan_pipeline_deadlock, resident_fraction
from .transports import RING_TRANSPORTS
from .zigzag import rank_tokens, zigzag_ranges

__all__ = [
    "BACKWARD",
    "FORWARD",
    "PLAN_FORMAT_VERSION",
    "RING_TRANSPORTS",
    "MicroBatch",
    "Op",
    "Piece",
    "PipelineGraph",
    "Plan",
    "as_ops",
    "crossing_order_mismatch",
    "decode_order",
    "encode_stage_orders",
    "find_pipeline_deadlock",
    "interleaved_order",
    "longest_paths",
    "megatron_interleaved_orders",
    "micro_batch",
    "one_f_one_b",
    "one_f_one_b_time",
    "pipelined_finish_times",
    "plan_pipeline_deadlock",
    "rank_tokens",
    "resident_fraction",
    "ring_pieces",
    "whole_piece",
    "whole_pieces",
    "zigzag_ranges",
]
