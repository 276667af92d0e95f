"""Ring placement: which ranks form a ring, in which order.

HDP ranks are numbered node by node (``ranks_per_node`` consecutive ranks share a node's
NVLink). A ring that fits in a node is placed inside one node; a larger ring takes the
least-loaded ranks with ties going to lower ranks, so on an idle cluster it takes whole
consecutive nodes. Members are ordered by rank: consecutive members are neighbours, and a
ring crosses node boundaries only where it must. The ring order is the placement order.

Both functions choose among ``loads`` (estimated seconds, or tokens, already on each rank):
the ring can start only when its last member is free, so they minimise that start, then the
idle time of the members that wait.
"""

from __future__ import annotations

from itertools import accumulate

import numpy as np

from ..errors import ConfigError, PlanError


def check_shape(num_ranks: int, ranks_per_node: int) -> None:
    if ranks_per_node < 1:
        raise ConfigError(
            f"ranks_per_node must be at least 1, got {ranks_per_node}; pass the HDP ranks per node (GPUs per node / TP)"
        )
    if num_ranks > ranks_per_node and num_ranks % ranks_per_node:
        raise ConfigError(
            f"{num_ranks} HDP ranks do not fill whole nodes of {ranks_per_node} ranks; "
            f"use a rank count that is a multiple of ranks_per_node (or fewer ranks than one node)"
        )


class RingPlacer:
    def __init__(self, num_ranks: int, ranks_per_node: int):
        check_shape(num_ranks, ranks_per_node)
        self.num_ranks = num_ranks
        self.ranks_per_node = min(ranks_per_node, num_ranks)
        self.num_nodes = num_ranks // self.ranks_per_node
        # every node's loads in ascending order, kept up to date between calls: a call
        # re-sorts only the nodes whose loads changed since the last (a ring or a few
        # sequences), not all of them (16,384 ranks: ~6,500 rings a step)
        self._seen: np.ndarray | None = None
        self._sorted: np.ndarray | None = None
        self._prefix: np.ndarray | None = None
        self._negative: set[int] = set()  # nodes with a load below 0 (none from the scheduler)
        # the caller's array the order was last kept for, and the ranks it says changed
        # since (None: unknown, compare the whole array)
        self._source: np.ndarray | None = None
        self._pending: list[int] | None = None

    def place(self, loads: np.ndarray, ring_size: int, group: int = 1, changed: list[int] | None = None) -> np.ndarray:
        """Ordered global ranks of a new ring of ``ring_size`` members (``group`` > 1: in
        groups of that many members of one node, consecutive in the ring: two-level).

        ``changed``: the ranks whose loads changed since the last call with this same
        ``loads`` array, when the caller knows (the balance scheduler does); it spares a
        comparison of every rank."""
        return np.asarray(self.place_ranks(loads, ring_size, group, changed), dtype=np.int64)

    def place_ranks(
        self, loads: np.ndarray, ring_size: int, group: int = 1, changed: list[int] | None = None
    ) -> list[int]:
        """``place`` as a list of ranks (what the scheduler uses)."""
        if not 1 <= ring_size <= self.num_ranks:
            raise PlanError(f"a ring of {ring_size} ranks does not fit {self.num_ranks} ranks")
        self._note_changes(loads, changed)
        if ring_size <= self.ranks_per_node:
            return self._inside_one_node(loads, ring_size)
        if group > 1 and ring_size % group == 0 and self.ranks_per_node % group == 0:
            return self._in_groups(loads, ring_size, group).tolist()
        # the ring_size least-loaded ranks, ties to the lowest ranks (exact, O(N))
        least = loads.min()
        idle = np.flatnonzero(loads == least)
        if idle.size >= ring_size:  # enough ranks at the least load (rings placed early): the lowest of them
            return idle[:ring_size].tolist()
        threshold = np.partition(loads, ring_size - 1)[ring_size - 1]
        below = np.flatnonzero(loads < threshold)
        tied = np.flatnonzero(loads == threshold)[: ring_size - below.size]
        return np.sort(np.concatenate([below, tied])).tolist()

    def _note_changes(self, loads: np.ndarray, changed: list[int] | None) -> None:
        """Keep the ranks told changed for the next ``_node_order`` (every call must pass its
        ``changed`` here, placed by this class or not, or the kept order goes stale)."""
        if changed is not None and loads is self._source and self._pending is not None:
            self._pending.extend(changed)
        else:
            self._pending = None

    def _node_order(self, loads: np.ndarray) -> np.ndarray:
        """Each node's loads, ascending, as ``ranks_per_node x num_nodes`` (row ``k``: every
        node's ``k+1``-th smallest load, contiguous); ``self._prefix`` holds their running
        sums down the rows (row ``k``: the node's ``k+1`` smallest loads added in order)."""
        rpn = self.ranks_per_node
        by_node = loads.reshape(self.num_nodes, rpn)
        pending, self._pending, self._source = self._pending, [], loads
        if pending is None:  # changes unknown: compare with the loads seen last
            if self._seen is None or self._seen.shape != loads.shape:
                self._sorted = np.ascontiguousarray(np.sort(by_node, axis=1).T)
                self._prefix = np.cumsum(self._sorted, axis=0)
                self._negative = set(np.flatnonzero(self._sorted[0] < 0.0).tolist())
                self._seen = loads.copy()
                return self._sorted
            pending = np.flatnonzero(loads != self._seen).tolist()
            self._seen = loads.copy()
        else:
            self._seen = None  # kept from the changes told, no longer from a copy
        if len(pending) <= 2 * rpn:  # a ring or a few sequences: a few nodes, in Python
            for node in {r // rpn for r in pending}:
                base = node * rpn
                column = sorted(loads[base : base + rpn].tolist())
                self._sorted[:, node] = column
                self._prefix[:, node] = list(accumulate(column))
                if column[0] < 0.0:
                    self._negative.add(node)
                else:
                    self._negative.discard(node)
        else:
            nodes = np.unique(np.array(pending, dtype=np.int64) // rpn)
            columns = np.sort(by_node[nodes], axis=1).T
            self._sorted[:, nodes] = columns
            self._prefix[:, nodes] = np.cumsum(columns, axis=0)
            below = columns[0] < 0.0
            self._negative.difference_update(nodes[~below].tolist())
            self._negative.update(nodes[below].tolist())
        return self._sorted

    def _inside_one_node(self, loads: np.ndarray, ring_size: int) -> list[int]:
        rpn = self.ranks_per_node
        ordered = self._node_order(loads)
        start = ordered[ring_size - 1]  # per node: the ring starts when its last member is free
        # earliest start, then least idle (ring_size * start - the members' loads), then lowest node
        node = int(start.argmin())
        first = float(start[node])
        if first == 0.0 and not self._negative:
            pass  # every node that ties has ring_size idle ranks (idle time 0): the lowest wins
        elif (candidates := (start == first).nonzero()[0]).size > 1:
            # the tied nodes all start at ``first``: idle = ring_size * first - their loads
            idle = ring_size * first - self._prefix[ring_size - 1, candidates]
            node = int(candidates[idle.argmin()])
        # the node's ring_size least-loaded ranks, ties to lower ranks (a stable sort of 8
        # values is faster in Python than in numpy)
        base = node * rpn
        here = loads[base : base + rpn].tolist()
        return sorted(base + i for i in sorted(range(rpn), key=here.__getitem__)[:ring_size])

    def _in_groups(self, loads: np.ndarray, ring_size: int, group: int) -> np.ndarray:
        """The ring_size / group least-loaded groups: each node's ranks, least-loaded first,
        cut into groups of ``group`` (a group is as loaded as its busiest member; ties to
        lower nodes); ordered by node, each group by rank."""
        rpn = self.ranks_per_node
        by_node = loads.reshape(self.num_nodes, rpn)
        # Rings placed early find enough groups all at the least load: those groups come
        # first (least busiest member, then lowest node and group), and a node's such groups
        # are its ranks at the least load, in rank order, cut into runs of ``group``.
        idle = by_node == loads.min()
        if np.count_nonzero(idle) >= ring_size:  # else not enough even before cutting into groups
            place = np.cumsum(idle, axis=1)  # 1, 2, ... over each node's ranks at the least load
            whole = place[:, -1] // group * group  # per node: its ranks in groups all at the least load
            if int(whole.sum()) >= ring_size:
                return (idle & (place <= whole[:, None])).ravel().nonzero()[0][:ring_size]
        # each node's groups' busiest members: every group-th of its sorted loads (kept up to
        # date between calls by ``_node_order``), node by node
        busiest = self._node_order(loads)[group - 1 :: group].T.ravel()  # [node, group], flattened
        # the count least-loaded groups, ties to the lower node and group (exact, O(N)), by
        # node, then by load within the node
        count = ring_size // group
        threshold = np.partition(busiest, count - 1)[count - 1]
        below = np.flatnonzero(busiest < threshold)
        chosen = np.sort(np.concatenate([below, np.flatnonzero(busiest == threshold)[: count - below.size]]))
        nodes, idx = np.divmod(chosen, rpn // group)
        # the chosen nodes' ranks least-loaded first (ties to the lower rank), cut into groups
        used, at = np.unique(nodes, return_inverse=True)
        local = np.argsort(by_node[used], axis=1, kind="stable").reshape(used.size, rpn // group, group)
        groups = np.sort(local[at, idx], axis=1) + (nodes * rpn)[:, None]
        return groups.ravel()
