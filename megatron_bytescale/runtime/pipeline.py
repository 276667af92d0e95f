"""1F1B over the stages of one pipeline, for pipelines that each run their own micro-batches.

Under HDP every pipeline (the PP stages of one HDP rank) runs its own list of micro-batches:
any count, zero included, and any lengths. Each stage runs them in exactly the order the plan
gives: its own per-stage order when it has one (``Plan.stage_orders``, e.g. from
``planner.order.stage_schedule``), else ``planner.contract.one_f_one_b`` (Megatron's
non-interleaved 1F1B: ``p - k - 1`` warm-up forwards on stage ``k``, then one forward one
backward, then the cool-down backwards); either is an order the planner proves free of
deadlock when ring micro-batches join stages of different pipelines.

Virtual pipeline stages (Megatron's interleaved layout): each device holds ``chunks`` model
chunks, chunk ``c`` of device ``d`` being virtual stage ``c * p + d``. An operation is an
``Op(direction, micro_batch, chunk)`` (``planner.contract.ops``); the forward of virtual
stage ``vs`` receives from ``vs - 1``
(device ``d - 1`` mod ``p``: device 0's chunk ``c > 0`` follows chunk ``c - 1`` of device
``p - 1``) and sends to ``vs + 1``, backward the reverse; ``vs = 0`` embeds, ``vs = p * chunks
- 1`` computes the loss. Without an order from the plan a device runs
``contract.interleaved_order`` (1F1B for one chunk).

Why not megatron-core's ``forward_backward_pipelining_without_interleaving`` (it does handle
``variable_seq_lengths``): it takes one micro-batch count, shape and data iterator and
nothing per micro-batch, while each HDP micro-batch needs its layout active around its
forward (ring attention, true positions) and its own offload ratio; and it allocates on
``"cuda"`` and calls ``torch.cuda.synchronize`` in its shape exchange, so it does not run on
CPU/gloo, where exactness is tested. The stages' compute is still megatron-core's own
``forward_step`` / ``backward_step`` (the caller's ``forward`` / ``backward``).

Transfers: activations go to the next virtual stage and their gradients back, each preceded
by its shape (the receiver allocates from it, so stages need no agreement on lengths beyond
the plan). Messages between two devices are matched in posting order per communicator (NCCL
ignores tags), so activations travel on the pipeline group and gradients on a second group
over the same ranks (``gradient_group``): with chunks, activations and gradients both flow
from device 0 to device 1, and each direction must be its own stream. Both ends of each
stream must agree on the order of the micro-batches crossing it;
``contract.crossing_order_mismatch`` checks it (``Plan.validate`` too). Sends are
posted and only waited at the end of the step, so a stage blocks only where the schedule
needs its input; this is the dependency structure ``find_pipeline_deadlock`` models.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from ..errors import PlanError
from ..planner.contract import FORWARD, Op, as_ops, interleaved_order

MAX_DIMS = 4  # shape header: [ndim, d0, .., d3]
SHAPE_TAG, DATA_TAG = 0, 1

_gradient_groups: dict[int, tuple] = {}  # id(pp_group) -> (pp_group, its gradient group)


def gradient_group(pp_group, device: torch.device = torch.device("cpu")):
    """A second communicator over ``pp_group``'s ranks, for the gradients sent upstream.

    Created once per pipeline group, collectively: every rank of the world gathers every
    rank's pipeline and creates one group per pipeline, in the same order (``new_group`` is a
    collective of the whole world). Every rank of the world must call it together, as every
    rank runs the HDP step. ``device``: where the world's collectives take tensors."""
    cached = _gradient_groups.get(id(pp_group))
    if cached is not None and cached[0] is pp_group:
        return cached[1]
    ranks = tuple(dist.get_process_group_ranks(pp_group))
    mine = torch.tensor(ranks, dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    own = None
    for members in sorted({tuple(int(r) for r in t.tolist()) for t in everyone}):
        group = dist.new_group(list(members))
        if members == ranks:
            own = group
    _gradient_groups[id(pp_group)] = (pp_group, own)  # keeps pp_group alive: its id is not reused
    return own


class StageLink:
    """Point-to-point exchange with the neighbouring virtual stages of this rank's pipeline
    (``pp_group`` None: a pipeline of one stage, which exchanges nothing). ``chunks``: model
    chunks per device; ``grad_group``: the communicator for gradients (default ``pp_group``)."""

    def __init__(
        self, pp_group=None, header_device: torch.device = torch.device("cpu"), chunks: int = 1, grad_group=None
    ):
        self.group = pp_group
        self.grad_group = grad_group if grad_group is not None else pp_group
        self.stages = dist.get_world_size(pp_group) if pp_group is not None else 1
        self.stage = dist.get_rank(pp_group) if pp_group is not None else 0
        self.chunks = chunks
        if chunks < 1 or (chunks > 1 and self.stages < 2):
            raise PlanError(
                f"{chunks} model chunks on a pipeline of {self.stages} stage(s): virtual pipeline stages need "
                "--pipeline-model-parallel-size 2 or more"
            )
        self.first, self.last = self.is_first(0), self.is_last(chunks - 1)  # of this device's chunks
        if self.stages > 1:
            self._prev = dist.get_global_rank(pp_group, (self.stage - 1) % self.stages)
            self._next = dist.get_global_rank(pp_group, (self.stage + 1) % self.stages)
        self._device = header_device
        self._sends: list = []  # (work, tensor) kept alive until finish()
        self.bytes_sent = 0

    def virtual_stage(self, chunk: int) -> int:
        return chunk * self.stages + self.stage

    def is_first(self, chunk: int = 0) -> bool:
        """Does ``chunk`` of this device hold the first virtual stage (the embedding)?"""
        return self.virtual_stage(chunk) == 0

    def is_last(self, chunk: int = 0) -> bool:
        """Does ``chunk`` of this device hold the last virtual stage (the loss)?"""
        return self.virtual_stage(chunk) == self.stages * self.chunks - 1

    def _send(self, tensor: torch.Tensor, peer: int, group) -> None:
        tensor = tensor.detach().contiguous()
        if tensor.dim() > MAX_DIMS:
            raise PlanError(
                f"pipeline stages exchange tensors of at most {MAX_DIMS} dimensions, got {tuple(tensor.shape)}"
            )
        header = torch.zeros(MAX_DIMS + 1, dtype=torch.int64, device=self._device)
        header[0] = tensor.dim()
        header[1 : 1 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
        for t, tag in ((header, SHAPE_TAG), (tensor, DATA_TAG)):
            self._sends.append((dist.isend(t, peer, group=group, tag=tag), t))
        self.bytes_sent += tensor.numel() * tensor.element_size()

    def _recv(self, peer: int, group, dtype: torch.dtype, device: torch.device, requires_grad: bool) -> torch.Tensor:
        header = torch.empty(MAX_DIMS + 1, dtype=torch.int64, device=self._device)
        dist.recv(header, peer, group=group, tag=SHAPE_TAG)
        ndim = int(header[0])
        shape = [int(d) for d in header[1 : 1 + ndim].tolist()]
        out = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(out, peer, group=group, tag=DATA_TAG)
        return out.requires_grad_(requires_grad)

    def recv_forward(self, dtype, device, chunk: int = 0) -> torch.Tensor | None:
        """The previous virtual stage's output for ``chunk``'s next forward (None on the first)."""
        if self.is_first(chunk):
            return None
        return self._recv(self._prev, self.group, dtype, device, requires_grad=True)

    def send_forward(self, output: torch.Tensor, chunk: int = 0) -> None:
        if not self.is_last(chunk):
            self._send(output, self._next, self.group)

    def recv_backward(self, dtype, device, chunk: int = 0) -> torch.Tensor | None:
        """The gradient of ``chunk``'s output from the next virtual stage (None on the last)."""
        if self.is_last(chunk):
            return None
        return self._recv(self._next, self.grad_group, dtype, device, requires_grad=False)

    def send_backward(self, input_grad: torch.Tensor | None, chunk: int = 0) -> None:
        if not self.is_first(chunk):
            if input_grad is None:
                raise PlanError("a pipeline stage produced no gradient for its input; its output does not depend on it")
            self._send(input_grad, self._prev, self.grad_group)

    def finish(self) -> None:
        """Wait for every posted send (their tensors stay alive until then)."""
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()


def run_one_f_one_b(
    count: int,
    link: StageLink,
    forward: Callable[[int, int, torch.Tensor | None], torch.Tensor],
    backward: Callable[[int, int, torch.Tensor | None, torch.Tensor, torch.Tensor | None], torch.Tensor | None],
    *,
    dtype: torch.dtype,
    device: torch.device,
    forward_only: bool = False,
    release: Callable[[torch.Tensor], None] | None = None,
    order: list[Op] | None = None,
) -> None:
    """Run ``count`` micro-batches through this device's chunks in ``order`` (its ops, the
    plan's order for this device), or when ``order`` is None in the default order (1F1B, or
    ``interleaved_order`` with ``link.chunks`` > 1).

    ``forward(m, chunk, input)`` returns the chunk's output (the loss on the last virtual
    stage); ``backward(m, chunk, input, output, output_grad)`` returns the gradient of
    ``input``. ``forward_only`` runs the forwards in order and keeps nothing for backward.
    ``release(output)`` runs once an output is sent (Megatron frees its data there; autograd
    keeps its graph).
    """
    if order is None:
        order = interleaved_order(count, link.stages, link.stage, link.chunks)
    ops = as_ops(order)
    if forward_only:
        ops = [op for op in ops if op[0] == FORWARD]
    saved: dict[tuple[int, int], tuple] = {}  # (micro-batch, chunk) -> (input, output)
    try:
        for direction, m, c in ops:
            if direction == FORWARD:
                x = link.recv_forward(dtype, device, c)
                y = forward(m, c, x)
                link.send_forward(y, c)
                if release is not None:
                    release(y)
                if not forward_only:
                    saved[m, c] = (x, y)
            else:
                x, y = saved.pop((m, c))
                g = link.recv_backward(dtype, device, c)
                link.send_backward(backward(m, c, x, y, g), c)
    finally:
        link.finish()
