import pytest
import torch
import torch.distributed as dist

from megatron_bytescale.local_world import WorkerError, run_local_world


def _sum_ranks(rank, world_size):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def _fail_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("boom on purpose")
    dist.barrier()


def test_ranks_run_collectives():
    assert run_local_world(_sum_ranks, 3, timeout_s=30) == [3.0, 3.0, 3.0]


def test_a_failing_rank_surfaces_its_traceback_and_nothing_hangs():
    with pytest.raises(WorkerError, match=r"(?s)rank 1 failed.*boom on purpose"):
        run_local_world(_fail_on_rank_one, 2, timeout_s=10)
