"""All-to-all inside one group of ring members, over point-to-point sends (two-level attention).

Like ``RingComm``, a group gets no process group of its own: every member posts one send to
and one receive from each other member with ``batch_isend_irecv`` over the HDP group (HDP
ranks translated to global ranks), then waits for all of them. Sends are counted in the
ring's ``P2PCounter``. On a cluster the group is one node, so this traffic stays on NVLink.

``SelfRing`` stands in for the ring across groups when there is one group only (the
all-to-all alone then covers the sequence): it sends nothing and hands the tensor back.
``LocalGroup`` is the exchange for group members that are threads of one process (like
``ring_comm.LocalRing``; a single-device check), never touching torch.distributed.
"""

from __future__ import annotations

import queue

import torch
import torch.distributed as dist

from ..errors import ConfigError, PlanError
from .ring_comm import P2PCounter, Pending

A2A_TAG = 2  # beside ring_comm's KV_TAG and GRAD_TAG


class GroupExchange:
    """This rank's place ``index`` in ``group`` (HDP ranks) over the HDP process group."""

    def __init__(self, group_ranks: tuple[int, ...], index: int, group=None, counter: P2PCounter | None = None):
        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError(
                f"two-level attention over group {group_ranks} needs torch.distributed initialised "
                "(init_process_group) first"
            )
        size = dist.get_world_size(group)
        outside = [r for r in group_ranks if not 0 <= r < size]
        if outside:
            raise PlanError(f"group {group_ranks} names ranks {outside} outside the HDP group of {size} ranks")
        if dist.get_rank(group) != group_ranks[index]:
            raise PlanError(
                f"layout was built for HDP rank {group_ranks[index]} (group {group_ranks}), but this process is "
                f"HDP rank {dist.get_rank(group)}; build the layout with this process's rank in the HDP group"
            )
        to_global = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
        self.index, self.size = index, len(group_ranks)
        self.group, self.counter = group, counter
        self._peers = [to_global(r) for r in group_ranks]

    def exchange(
        self, sends: list[torch.Tensor | None], recv_shapes: list[tuple], dtype, device
    ) -> list[torch.Tensor | None]:
        """Send ``sends[b]`` to member b and receive a ``recv_shapes[b]`` tensor from it, for
        every b but this rank (whose entries are ignored and come back None)."""
        ops, recvs = [], [None] * self.size
        for b in range(self.size):
            if b == self.index:
                continue
            send = sends[b].contiguous()
            recvs[b] = torch.empty(recv_shapes[b], dtype=dtype, device=device)
            ops.append(dist.P2POp(dist.isend, send, self._peers[b], self.group, A2A_TAG))
            ops.append(dist.P2POp(dist.irecv, recvs[b], self._peers[b], self.group, A2A_TAG))
            if self.counter is not None:
                self.counter.add(send)
        if ops:
            Pending(dist.batch_isend_irecv(ops), None, self.counter).wait()
        return recvs


class SelfRing:
    """A ring of one member: ``send_recv`` returns what it is given, sending nothing."""

    size, index = 1, 0

    def send_recv(self, send: torch.Tensor, recv_shape, tag: int = 0) -> _Ready:
        return _Ready(send)


class _Ready:
    def __init__(self, tensor: torch.Tensor):
        self._tensor = tensor

    def wait(self) -> torch.Tensor:
        return self._tensor


class LocalGroup:
    """``size`` group members in one process, one thread each, exchanging through queues."""

    def __init__(self, size: int, timeout_s: float = 300.0):
        self.size, self.timeout_s = size, timeout_s
        self._inbox = [[queue.Queue() for _ in range(size)] for _ in range(size)]  # [receiver][sender]

    def member(self, index: int, counter: P2PCounter | None = None) -> LocalGroupMember:
        return LocalGroupMember(self, index, counter)


class LocalGroupMember:
    def __init__(self, hub: LocalGroup, index: int, counter: P2PCounter | None):
        self.hub, self.index, self.size, self.counter = hub, index, hub.size, counter

    def exchange(self, sends, recv_shapes, dtype, device):
        for b in range(self.size):
            if b != self.index:
                self.hub._inbox[b][self.index].put(sends[b].clone())  # a copy, as a real send would be
                if self.counter is not None:
                    self.counter.add(sends[b])
        recvs = [None] * self.size
        for b in range(self.size):
            if b == self.index:
                continue
            try:
                got = self.hub._inbox[self.index][b].get(timeout=self.hub.timeout_s)
            except queue.Empty:
                raise TimeoutError(f"group member received nothing within {self.hub.timeout_s:.0f} s") from None
            if tuple(got.shape) != tuple(recv_shapes[b]):
                raise PlanError(f"group member expected a {tuple(recv_shapes[b])} block, received {tuple(got.shape)}")
            recvs[b] = got
        return recvs
