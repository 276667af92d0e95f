"""The Plan contract (``planner/contract/``) on its own: loading it loads nothing above it, an op
survives its encoding, and the dependency graph times one pipeline as 1F1B's textbook makespan
and waits at barriers."""

import subprocess
import sys

import pytest

from megatron_bytescale.planner.contract import (
    BACKWARD,
    FORWARD,
    Op,
    PipelineGraph,
    decode_order,
    encode_stage_orders,
    find_pipeline_deadlock,
    interleaved_order,
    pipelined_finish_times,
)


def test_loading_the_contract_loads_no_scheduler_and_no_third_party_package():
    code = (
        "import sys, megatron_bytescale.planner.contract as c; "
        "print(sorted(m for m in sys.modules if m.startswith(('megatron_bytescale', 'numpy', 'torch', 'yaml'))))"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    names = eval(loaded)  # a printed list of module names
    # the package's own __init__ installs triton_stand_ins (standard library only) before anything
    # can import megatron-core
    assert all(
        n == "megatron_bytescale"
        or n.startswith("megatron_bytescale.planner.contract")
        or n in ("megatron_bytescale.errors", "megatron_bytescale.planner", "megatron_bytescale.triton_stand_ins")
        for n in names
    ), names


@pytest.mark.parametrize("chunks", [1, 3])
def test_an_op_survives_its_code(chunks):
    ops = [Op(d, m, c) for m in range(4) for c in range(chunks) for d in (FORWARD, BACKWARD)]
    codes = [op.code(chunks) for op in ops]
    assert len(set(codes)) == len(ops)
    assert decode_order(codes, chunks) == ops
    assert encode_stage_orders([[ops]], chunks) == ((tuple(codes),),)
    assert Op(FORWARD, 2).code(1) == 2 and Op(BACKWARD, 2).code(1) == -3  # m and -1 - m without chunks


@pytest.mark.parametrize("p, m", [(2, 1), (4, 3), (4, 9), (3, 6)])
def test_one_pipeline_of_equal_micro_batches_takes_m_plus_p_minus_1_stage_times(p, m):
    (finish,) = pipelined_finish_times([[None] * m], [[3.0] * m], p, 1 / 3)
    assert finish == pytest.approx((m + p - 1) * 3.0)


def test_a_ring_is_one_gang_and_a_crossed_order_deadlocks():
    keys = [["a", "b"], ["b", "a"]]  # two rings, in opposite orders on their two members
    assert "wait in a cycle" in find_pipeline_deadlock(keys, 1)
    assert find_pipeline_deadlock([["a", "b"], ["a", "b"]], 1) is None
    graph = PipelineGraph([["a", None], ["a"]], 2, durations=lambda r, m: (1.0, 2.0))
    assert graph.units == 2 and graph.size == [2, 1]  # the ring once for both members, the local micro-batch


def test_a_barrier_holds_every_device_until_all_arrive():
    # rank 0 runs a long micro-batch, rank 1 a short one, each then a second one after the barrier
    times = {(0, 0): 9.0, (0, 1): 1.0, (1, 0): 1.0, (1, 1): 1.0}

    def durations(r, m):
        return times[r, m] / 3, 2 * times[r, m] / 3

    graph = PipelineGraph([[None, None], [None, None]], 1, durations=durations)
    seqs = graph.sequences(None, [[1, 1]])
    end = graph.evaluate(seqs, barriers=1)
    assert end[graph.total] == pytest.approx(9.0)  # the barrier: when the slower rank arrives
    assert max(graph.finish(end)) == pytest.approx(10.0) and min(graph.finish(end)) == pytest.approx(10.0)
    assert [len(s) for s in seqs] == [5, 5]  # two ops, the barrier, two ops
    assert seqs[0][2] == seqs[1][2] == graph.total
    assert interleaved_order(2, 1, 0, 1) == [Op(FORWARD, 0), Op(BACKWARD, 0), Op(FORWARD, 1), Op(BACKWARD, 1)]
