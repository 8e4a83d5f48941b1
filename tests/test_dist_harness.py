import pytest
import torch
import torch.distributed as dist

from _dist import DistributedFailure, run_world


def _allreduce(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    assert t.item() == world_size * (world_size + 1) / 2


def _fail_on_rank_1(rank, world_size):
    if rank == 1:
        raise ValueError("boom from rank 1")


def test_world_runs_collectives():
    run_world(3, _allreduce)


def test_world_reports_the_failing_rank():
    with pytest.raises(DistributedFailure, match="boom from rank 1"):
        run_world(2, _fail_on_rank_1, timeout=60)
