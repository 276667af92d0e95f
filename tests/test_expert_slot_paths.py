"""Expert slots (planner/expert/) against their definitions:

* slots from ring times (a longest path over the rings, ``expert.slots.item_slots`` run
  compiled and as Python) = the slot-by-slot scan, on random queues of rings and local
  micro-batches, cycles and malformed rings included;
* finish times over EP groups' slots (Kahn's order, cached micro-batch times) = the plain
  definition over every rank's slots (``contract.slots.slot_nodes`` and a topological sort).
"""

from collections import defaultdict
from graphlib import CycleError, TopologicalSorter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_bytescale.errors import ConfigError
from megatron_bytescale.planner import jit
from megatron_bytescale.planner.contract import Plan, micro_batch, ring_pieces, whole_piece
from megatron_bytescale.planner.contract.slots import ep_groups, slot_nodes
from megatron_bytescale.planner.estimate import crosses_nodes, micro_batch_time, whole_sequences_time
from megatron_bytescale.planner.expert import slots as expert_slots
from megatron_bytescale.planner.expert import timing
from megatron_bytescale.planner.expert.slots import EMPTY, align_expert_slots
from megatron_bytescale.planner.expert.timing import all_to_all_time

from planner_cases import small_cost


@st.composite
def ring_plans(draw, aligned: bool = False):
    """A plan of random rings and whole sequences on ``e * groups`` ranks. Rings are taken in
    one global order by their members (no cycle) unless ``shuffle`` reorders a rank's list;
    a rank's local micro-batches sit anywhere. ``aligned``: EP groups' lists made equal in
    length with empty slots (rings may then sit at different slots: cycles happen)."""
    e = draw(st.sampled_from([1, 2, 3]))
    n = e * draw(st.integers(1, 4))
    lists: list[list] = [[] for _ in range(n)]
    lens: list[int] = []
    for _ in range(draw(st.integers(0, 8))):
        size = draw(st.integers(2, n)) if n > 1 and draw(st.booleans()) else 1
        ring = tuple(draw(st.permutations(range(n)))[:size])
        seq_len = draw(st.integers(size, 40))
        sid = len(lens)
        lens.append(seq_len)
        if size == 1:
            beside = [whole_piece(sid, seq_len, ring[0])]
            lists[ring[0]].append(micro_batch(tuple(beside), draw(st.sampled_from([0.0, 0.0, 0.5]))))
            continue
        for r, piece in zip(ring, ring_pieces(sid, seq_len, ring, draw(st.sampled_from([1, 1, size])))):
            extra = ()
            if draw(st.integers(0, 4)) == 0:  # a whole sequence packed beside the share
                lens.append(draw(st.integers(1, 20)))
                extra = (whole_piece(len(lens) - 1, lens[-1], r),)
            lists[r].append(micro_batch((piece, *extra)))
    for r in range(n):  # local packs, spread through the list
        for _ in range(draw(st.integers(0, 3))):
            pieces = []
            for _ in range(draw(st.integers(1, 3))):
                lens.append(draw(st.integers(1, 30)))
                pieces.append(whole_piece(len(lens) - 1, lens[-1], r))
            lists[r].insert(draw(st.integers(0, len(lists[r]))), micro_batch(tuple(pieces)))
    if draw(st.integers(0, 5)) == 0:  # a malformed plan: one rank's list in another order
        r = draw(st.integers(0, n - 1))
        lists[r] = draw(st.permutations(lists[r]))
    if aligned:
        for group in ep_groups(n, e):
            longest = max(len(lists[r]) for r in group)
            for r in group:
                for _ in range(longest - len(lists[r])):
                    lists[r].insert(draw(st.integers(0, len(lists[r]))), EMPTY)
    ranks = tuple(tuple(mbs) for mbs in lists)
    return Plan(num_ranks=n, capacity=100, num_layers=6, seq_lens=tuple(lens), ranks=ranks, expert_parallel=e)


@pytest.mark.parametrize("mode", ["compiled", "python"])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=ring_plans())
def test_slots_from_ring_times_are_the_scans_slots(mode, plan):
    """``_slots_from_ring_times`` (``item_slots`` compiled and as Python) against the scan:
    the same slot of every micro-batch, None where it raises."""
    queues, keys = zip(*(expert_slots._longest_first(mbs) for mbs in plan.ranks))
    with jit.use(mode):
        fast = expert_slots._slots_from_ring_times(queues, keys)
    try:
        plain = expert_slots._slots_by_scan([list(q) for q in queues])
    except ConfigError:
        assert fast is None  # rings in a cycle: the fast path leaves the error to the scan
        if plan.expert_parallel > 1:
            with pytest.raises(ConfigError, match="ordered inconsistently"):
                align_expert_slots(plan, plan.expert_parallel)
        return
    assert fast is not None  # each ring is held once by each member here: only cycles fall back
    assert [sorted(d) for d in fast] == [sorted(d) for d in plain]
    assert all(fast[r][s] is plain[r][s] for r in range(len(plain)) for s in plain[r])


@pytest.mark.parametrize("mode", ["compiled", "python"])
def test_a_ring_missing_from_a_member_or_held_by_another_rank_is_left_out(mode):
    """A ring key whose ranks do not all hold it, or held by a rank outside it: no slots from
    ring times (``align_expert_slots`` then scans), compiled or not."""
    shares = ring_pieces(0, 10, (0, 1))
    one = [[micro_batch((shares[0],))], []]  # rank 1 never holds its share
    other = [[micro_batch((shares[0],))], [], [micro_batch((shares[1],))]]  # rank 2 holds rank 1's
    with jit.use(mode):
        for lists in (one, other):
            keys = [[mb.ring_key for mb in mbs] for mbs in lists]
            assert expert_slots._slots_from_ring_times(lists, keys) is None


def test_a_ring_held_twice_by_its_members_is_left_to_the_scan():
    shares = ring_pieces(0, 10, (0, 1))
    lists = [[micro_batch((shares[r],)), micro_batch((shares[r],))] for r in (0, 1)]
    keys = [[mb.ring_key for mb in mbs] for mbs in lists]
    assert expert_slots._slots_from_ring_times(lists, keys) is None
    plain = Plan(num_ranks=2, capacity=100, num_layers=6, seq_lens=(10,), ranks=tuple(map(tuple, lists)))
    assert align_expert_slots(plain, 2).ranks == plain.ranks  # the scan runs both copies together


def plain_slot_finish_times(plan, cost, ranks_per_node):
    """``slot_finish_times`` as first written: every rank's slot, merged by ``slot_nodes``."""
    e = plan.expert_parallel
    node = slot_nodes(plan)
    inter = {g[0]: crosses_nodes(g, ranks_per_node) for g in ep_groups(plan.num_ranks, e)}
    members = defaultdict(list)
    for x, n in node.items():
        members[n].append(x)
    duration = {}
    for n, events in members.items():
        longest = 0.0
        for rank, k in events:
            mb = plan.ranks[rank][k]
            ring_inter = mb.ring is not None and crosses_nodes(mb.ring, ranks_per_node)
            a2a = all_to_all_time(cost, max(mb.tokens, 1), e, inter[rank - rank % e])
            longest = max(longest, micro_batch_time(cost, mb, ring_inter) + a2a)
        duration[n] = longest
    before = defaultdict(set)
    for rank, mbs in enumerate(plan.ranks):
        for k in range(len(mbs)):
            before[node[(rank, k)]]
            if k:
                before[node[(rank, k)]].add(node[(rank, k - 1)])
    end = {}
    for n in TopologicalSorter(before).static_order():
        end[n] = max((end[p] for p in before[n]), default=0.0) + duration[n]
    return [end[node[(rank, len(mbs) - 1)]] if mbs else 0.0 for rank, mbs in enumerate(plan.ranks)]


COSTS = [
    small_cost(moe_a2a_bytes_per_token=64.0),
    small_cost(bw_offload=1e3, moe_a2a_bytes_per_token=64.0, recomputed_layers=2, recomputed_attention_layers=3),
]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ring_plans(aligned=True), st.sampled_from(COSTS), st.sampled_from([1, 2, 4]))
def test_finish_times_over_group_slots_are_the_plain_ones(plan, cost, ranks_per_node):
    try:
        want = plain_slot_finish_times(plan, cost, ranks_per_node)
    except CycleError:
        with pytest.raises(CycleError):
            timing.slot_finish_times(plan, cost, ranks_per_node)
        return
    assert timing.slot_finish_times(plan, cost, ranks_per_node) == want  # bit for bit


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ring_plans(), st.sampled_from(COSTS), st.booleans(), st.booleans())
def test_cached_micro_batch_times_are_micro_batch_time(plan, cost, ring_inter, group_inter):
    timer = timing.SlotTimer(cost, 4)
    for mb in [mb for mbs in plan.ranks for mb in mbs] * 2 + [EMPTY]:  # twice: the cache answers
        want = micro_batch_time(cost, mb, ring_inter) + all_to_all_time(cost, max(mb.tokens, 1), 4, group_inter)
        assert timer.time(mb, ring_inter, group_inter) == want
        if mb.pieces and all(len(p.ring) == 1 for p in mb.pieces):
            pairs = float(sum(p.seq_len**2 for p in mb.pieces))
            assert whole_sequences_time(cost, mb.tokens, pairs, mb.offload_ratio) == micro_batch_time(cost, mb)


def test_a_pack_too_large_for_exact_integer_sums_is_costed_the_plain_way():
    huge = micro_batch(tuple(whole_piece(i, 70_000_000, 0) for i in range(3)))  # sum of s^2 > 2^53
    cost = COSTS[0]
    want = micro_batch_time(cost, huge) + all_to_all_time(cost, huge.tokens, 2, False)
    assert timing.SlotTimer(cost, 2).time(huge, False, False) == want


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from([(0,), (1,), (0, 1), (1, 0), (0, 1, 2), (2, 3)]), st.integers(3, 30)),
        max_size=5,
    ),
    st.booleans(),
)
def test_micro_batch_ring_key_and_tokens_are_their_definitions(pieces, share_ring_objects):
    """``MicroBatch.ring``/``ring_key``/``tokens`` (loops, a one-piece shortcut) against the
    set-of-rings definitions; rings equal but not identical objects when not shared."""
    made = []
    for sid, (ring, seq_len) in enumerate(pieces):
        ring = ring if share_ring_objects else tuple(list(ring))
        made.append(whole_piece(sid, seq_len, ring[0]) if len(ring) == 1 else ring_pieces(sid, seq_len, ring)[0])
    mb = micro_batch(tuple(made))
    rings = {p.ring for p in mb.pieces if p.is_distributed}
    ring = next(iter(rings)) if len(rings) == 1 else None
    assert mb.ring == ring
    ids = tuple(sorted(p.seq_id for p in mb.pieces if p.is_distributed))
    assert mb.ring_key == (None if ring is None else (ring, ids))
    assert mb.tokens == sum(end - start for p in mb.pieces for start, end in p.ranges)
