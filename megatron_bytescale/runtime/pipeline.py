"""1F1B over the stages of one pipeline, for pipelines that each run their own micro-batches.

Under HDP every pipeline (the PP stages of one HDP rank) runs its own list of micro-batches:
any count, zero included, and any lengths. Each stage runs them in exactly the order the plan
gives: its own per-stage order when it has one (``Plan.stage_orders``, e.g. from
``planner.stage_schedule``), else ``planner.pipeline_order.one_f_one_b`` (Megatron's
non-interleaved 1F1B: ``p - k - 1`` warm-up forwards on stage ``k``, then one forward one
backward, then the cool-down backwards); either is an order the planner proves free of
deadlock when ring micro-batches join stages of different pipelines.

Why not megatron-core's ``forward_backward_pipelining_without_interleaving`` (it does handle
``variable_seq_lengths``): it takes one micro-batch count, shape and data iterator and
nothing per micro-batch, while each HDP micro-batch needs its layout active around its
forward (ring attention, true positions) and its own offload ratio; and it allocates on
``"cuda"`` and calls ``torch.cuda.synchronize`` in its shape exchange, so it does not run on
CPU/gloo, where exactness is tested. The stages' compute is still megatron-core's own
``forward_step`` / ``backward_step`` (the caller's ``forward`` / ``backward``).

Transfers: activations go to the next stage and their gradients back, each preceded by its
shape (the receiver allocates from it, so stages need no agreement on lengths beyond the
plan). Messages between two stages are matched in posting order, so both ends must agree on
the order of the micro-batches crossing them: forwards leave stage ``k`` in its order of
forwards, and stage ``k + 1`` must run its forwards in the same order (backwards likewise
upstream); ``pipeline_order.crossing_order_mismatch`` checks it (``Plan.validate`` too). Sends are posted and only waited at the end of the step, so a stage blocks only where
1F1B needs its input; this is the dependency structure ``find_pipeline_deadlock`` models.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from ..errors import PlanError
from ..planner.pipeline_order import FORWARD, one_f_one_b

MAX_DIMS = 4  # shape header: [ndim, d0, .., d3]
SHAPE_TAG, DATA_TAG = 0, 1


class StageLink:
    """Point-to-point exchange with the previous and next stage of this rank's pipeline
    (``pp_group`` None: a pipeline of one stage, which exchanges nothing)."""

    def __init__(self, pp_group=None, header_device: torch.device = torch.device("cpu")):
        self.group = pp_group
        self.stages = dist.get_world_size(pp_group) if pp_group is not None else 1
        self.stage = dist.get_rank(pp_group) if pp_group is not None else 0
        self.first, self.last = self.stage == 0, self.stage == self.stages - 1
        self._prev = None if self.first else dist.get_global_rank(pp_group, self.stage - 1)
        self._next = None if self.last else dist.get_global_rank(pp_group, self.stage + 1)
        self._device = header_device
        self._sends: list = []  # (work, tensor) kept alive until finish()
        self.bytes_sent = 0

    def _send(self, tensor: torch.Tensor, peer: int) -> None:
        tensor = tensor.detach().contiguous()
        if tensor.dim() > MAX_DIMS:
            raise PlanError(f"pipeline stages exchange tensors of at most {MAX_DIMS} dimensions, got {tuple(tensor.shape)}")
        header = torch.zeros(MAX_DIMS + 1, dtype=torch.int64, device=self._device)
        header[0] = tensor.dim()
        header[1 : 1 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
        for t, tag in ((header, SHAPE_TAG), (tensor, DATA_TAG)):
            self._sends.append((dist.isend(t, peer, group=self.group, tag=tag), t))
        self.bytes_sent += tensor.numel() * tensor.element_size()

    def _recv(self, peer: int, dtype: torch.dtype, device: torch.device, requires_grad: bool) -> torch.Tensor:
        header = torch.empty(MAX_DIMS + 1, dtype=torch.int64, device=self._device)
        dist.recv(header, peer, group=self.group, tag=SHAPE_TAG)
        ndim = int(header[0])
        shape = [int(d) for d in header[1 : 1 + ndim].tolist()]
        out = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(out, peer, group=self.group, tag=DATA_TAG)
        return out.requires_grad_(requires_grad)

    def recv_forward(self, dtype, device) -> torch.Tensor | None:
        """The previous stage's output for this stage's next forward (None on the first stage)."""
        return None if self.first else self._recv(self._prev, dtype, device, requires_grad=True)

    def send_forward(self, output: torch.Tensor) -> None:
        if not self.last:
            self._send(output, self._next)

    def recv_backward(self, dtype, device) -> torch.Tensor | None:
        """The gradient of this stage's output from the next stage (None on the last stage)."""
        return None if self.last else self._recv(self._next, dtype, device, requires_grad=False)

    def send_backward(self, input_grad: torch.Tensor | None) -> None:
        if not self.first:
            if input_grad is None:
                raise PlanError("a pipeline stage produced no gradient for its input; its output does not depend on it")
            self._send(input_grad, self._prev)

    def finish(self) -> None:
        """Wait for every posted send (their tensors stay alive until then)."""
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()


def run_one_f_one_b(
    count: int,
    link: StageLink,
    forward: Callable[[int, torch.Tensor | None], torch.Tensor],
    backward: Callable[[int, torch.Tensor | None, torch.Tensor, torch.Tensor | None], torch.Tensor | None],
    *,
    dtype: torch.dtype,
    device: torch.device,
    forward_only: bool = False,
    release: Callable[[torch.Tensor], None] | None = None,
    order: list[tuple[int, int]] | None = None,
) -> None:
    """Run ``count`` micro-batches through this stage in ``order`` ((direction, micro-batch)
    pairs, the plan's order for this stage), or in 1F1B order when ``order`` is None.

    ``forward(m, input)`` returns the stage's output (the loss on the last stage);
    ``backward(m, input, output, output_grad)`` returns the gradient of ``input``.
    ``forward_only`` runs the forwards in order and keeps nothing for backward. ``release(output)``
    runs once an output is sent (Megatron frees its data there; autograd keeps its graph).
    """
    if forward_only:
        order = [(FORWARD, m) for d, m in order if d == FORWARD] if order is not None else [(FORWARD, m) for m in range(count)]
    elif order is None:
        order = one_f_one_b(count, link.stages, link.stage)
    saved: dict[int, tuple] = {}
    try:
        for direction, m in order:
            if direction == FORWARD:
                x = link.recv_forward(dtype, device)
                y = forward(m, x)
                link.send_forward(y)
                if release is not None:
                    release(y)
                if not forward_only:
                    saved[m] = (x, y)
            else:
                x, y = saved.pop(m)
                g = link.recv_backward(dtype, device)
                link.send_backward(backward(m, x, y, g))
    finally:
        link.finish()
