"""Point-to-point exchange round one ring of HDP ranks.

Rings are formed per micro-batch from the plan and never get a process group of their own
(no ``new_group``): a member sends to its successor and receives from its predecessor with
``batch_isend_irecv`` over the one HDP group, translating HDP ranks to global ranks. An
exchange is posted first and waited later, so the next block is in flight while the current
one is computed.

NCCL note: if a ring exchange is the first communication on the group, every group member
must take part in it (a NCCL rule for ``batch_isend_irecv``); a training step's earlier
collectives satisfy this.

``LocalRing`` is the same interface for ring members that are threads of one process (a
single-device check of the ring schedule); it never touches torch.distributed.
"""

from __future__ import annotations

import os
import queue
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import ConfigError, PlanError

KV_TAG, GRAD_TAG = 0, 1  # the two streams that travel round a ring: KV blocks and dK/dV accumulators
# gloo only: a ring exchange that makes no progress for this long names its peers and fails,
# instead of gloo's whole-job timeout (10 min). Not for NCCL: a timed wait would block the CPU
# on the GPU stream and lose the overlap.
RING_TIMEOUT_S = float(os.environ.get("BYTESCALE_RING_TIMEOUT_S", "60"))


@dataclass
class P2PCounter:
    """Bytes (and messages) this rank has sent through ring exchanges, and the time it spent
    waiting for them to complete (communication not hidden behind compute). ``by_transport``:
    the bytes per ring transport (``ring_transport``: "kv", or an MLA ring's "latent")."""

    bytes_sent: int = 0
    messages: int = 0
    wait_s: float = 0.0
    by_transport: dict[str, int] = field(default_factory=dict)

    def add(self, tensor: torch.Tensor, transport: str = "kv") -> None:
        sent = tensor.numel() * tensor.element_size()
        self.bytes_sent += sent
        self.messages += 1
        self.by_transport[transport] = self.by_transport.get(transport, 0) + sent

    def reset(self) -> None:
        self.bytes_sent = 0
        self.messages = 0
        self.wait_s = 0.0
        self.by_transport = {}


class Pending:
    """A posted exchange; ``wait()`` returns the received tensor."""

    def __init__(
        self,
        works,
        recv: torch.Tensor,
        counter: P2PCounter | None = None,
        timeout_s: float | None = None,
        peers: str = "",
    ):
        self._works, self._recv, self._counter = works, recv, counter
        self._timeout, self._peers = timeout_s, peers

    def wait(self) -> torch.Tensor:
        start = time.perf_counter()
        for w in self._works:
            if self._timeout is None:
                w.wait()
                continue
            try:
                w.wait(timeout=timedelta(seconds=self._timeout))
            except RuntimeError as exc:
                if "timed out" not in str(exc).lower() and "timeout" not in str(exc).lower():
                    raise
                raise TimeoutError(f"ring exchange made no progress for {self._timeout:.0f} s: {self._peers}") from None
        self._works = []
        if self._counter is not None:
            self._counter.wait_s += time.perf_counter() - start
        return self._recv


class RingComm:
    """This rank's place in one ring over ``group`` (None: the default world group); its bytes
    count under ``transport`` (what the ring carries)."""

    def __init__(
        self,
        ring: tuple[int, ...],
        index: int,
        group=None,
        counter: P2PCounter | None = None,
        transport: str = "kv",
    ):
        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError(
                f"ring attention over ring {ring} needs torch.distributed initialised (init_process_group) first"
            )
        size = dist.get_world_size(group)
        outside = [r for r in ring if not 0 <= r < size]
        if outside:
            raise PlanError(f"ring {ring} names ranks {outside} outside the HDP group of {size} ranks")
        me = dist.get_rank(group)
        if me != ring[index]:
            raise PlanError(
                f"layout was built for HDP rank {ring[index]} (ring {ring}, index {index}), but this process is "
                f"HDP rank {me}; build the layout with this process's rank in the HDP group"
            )
        to_global = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
        self.ring, self.index, self.size = tuple(ring), index, len(ring)
        self.group, self.counter, self.transport = group, counter, transport
        self._next = to_global(ring[(index + 1) % self.size])
        self._prev = to_global(ring[(index - 1) % self.size])
        self._timeout = RING_TIMEOUT_S if dist.get_backend(group) == "gloo" else None
        self._peers = (
            f"ring {self.ring}: this rank (global {dist.get_rank()}) sends to global rank {self._next} and "
            f"receives from global rank {self._prev}; one of them is stopped, dead or stuck"
        )

    def send_recv(self, send: torch.Tensor, recv_shape, tag: int = KV_TAG) -> Pending:
        """Post: send ``send`` to the successor, receive a ``recv_shape`` tensor from the predecessor."""
        send = send.contiguous()
        recv = torch.empty(recv_shape, dtype=send.dtype, device=send.device)
        ops = [
            dist.P2POp(dist.isend, send, self._next, self.group, tag),
            dist.P2POp(dist.irecv, recv, self._prev, self.group, tag),
        ]
        works = dist.batch_isend_irecv(ops)
        if self.counter is not None:
            self.counter.add(send, self.transport)
        return Pending(works, recv, self.counter, self._timeout, self._peers)


class LocalRing:
    """``size`` ring members living in one process, one thread each, exchanging through queues."""

    def __init__(self, size: int, timeout_s: float = 300.0):
        self.size, self.timeout_s = size, timeout_s
        self._inbox = [{KV_TAG: queue.Queue(), GRAD_TAG: queue.Queue()} for _ in range(size)]

    def member(self, index: int, counter: P2PCounter | None = None, transport: str = "kv") -> LocalRingMember:
        return LocalRingMember(self, index, counter, transport)


class LocalRingMember:
    def __init__(self, hub: LocalRing, index: int, counter: P2PCounter | None, transport: str = "kv"):
        self.hub, self.index, self.size, self.counter = hub, index, hub.size, counter
        self.transport = transport

    def send_recv(self, send: torch.Tensor, recv_shape, tag: int = KV_TAG) -> _LocalPending:
        self.hub._inbox[(self.index + 1) % self.size][tag].put(send.clone())  # a copy, as a real send would be
        if self.counter is not None:
            self.counter.add(send, self.transport)
        return _LocalPending(self.hub._inbox[self.index][tag], tuple(recv_shape), self.hub.timeout_s)


class _LocalPending:
    def __init__(self, inbox: queue.Queue, shape: tuple, timeout_s: float):
        self._inbox, self._shape, self._timeout = inbox, shape, timeout_s

    def wait(self) -> torch.Tensor:
        try:
            got = self._inbox.get(timeout=self._timeout)
        except queue.Empty:
            raise TimeoutError(f"ring member received nothing within {self._timeout:.0f} s") from None
        if tuple(got.shape) != self._shape:
            raise PlanError(f"ring member expected a {self._shape} block, received {tuple(got.shape)}")
        return got
