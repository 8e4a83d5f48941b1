"""ring_kernels.world, the local worlds of the tests (through tests/_dist.py) and of the command line: gloo worlds on
CPU, NCCL worlds on 2 GPUs (skipped without them)."""
import os
import time

import pytest
import torch
import torch.distributed as dist

from ring_kernels import world
from ring_kernels.world import DistributedFailure, report, run_world

needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")


def _allreduce(rank, world_size, device="cpu"):
    t = torch.tensor([float(rank + 1)], device=device)
    dist.all_reduce(t)
    assert t.item() == world_size * (world_size + 1) / 2
    return {"rank": rank, "backend": dist.get_backend(), "env_rank": int(os.environ["RANK"])}


def _fail_on_rank_1(rank, world_size):
    if rank == 1:
        raise ValueError("boom from rank 1")


def _rank_0_hangs_rank_1_fails(rank, world_size):
    if rank == 1:
        raise ValueError("boom from rank 1")
    time.sleep(600)              # stands for a rank blocked in a collective its failed peer never joins


def _sleep(rank, world_size):
    time.sleep(600)


def _count_up(rank, world_size, n):
    for i in range(n):
        report((rank, i))
    return "done"


def test_world_runs_collectives_and_returns_each_ranks_value():
    values = run_world(3, _allreduce)
    assert values == [{"rank": r, "backend": "gloo", "env_rank": r} for r in range(3)]


def _environment(rank, world_size, names):
    return {name: os.environ.get(name) for name in names}


def test_ranks_get_the_callers_environment_at_the_call(monkeypatch):
    """Ranks fork from a server started with an earlier world's environment; each world's ranks still see the
    caller's os.environ as it is at the call, with ``env`` added for them only."""
    run_world(2, _environment, ["HFPATCH_WORLD_A"])                 # the fork server is up from here on
    monkeypatch.setenv("HFPATCH_WORLD_A", "set after the server started")
    monkeypatch.delenv("HFPATCH_WORLD_GONE", raising=False)
    values = run_world(2, _environment, ["HFPATCH_WORLD_A", "HFPATCH_WORLD_B", "HFPATCH_WORLD_GONE"],
                       env={"HFPATCH_WORLD_B": "for the ranks"})
    assert values == [{"HFPATCH_WORLD_A": "set after the server started", "HFPATCH_WORLD_B": "for the ranks",
                       "HFPATCH_WORLD_GONE": None}] * 2
    assert "HFPATCH_WORLD_B" not in os.environ
    if "forkserver" in torch.multiprocessing.get_all_start_methods():
        assert world.start_method() == "forkserver"


def test_the_environment_is_set_before_the_callers_module_is_imported(tmp_path, monkeypatch):
    """A module that reads a variable when it is imported, imported in the ranks only to find ``fn``, reads the
    caller's value."""
    (tmp_path / "reads_env_at_import.py").write_text(
        "import os\nSEEN = os.environ.get('HFPATCH_WORLD_IMPORT')\n\n\ndef fn(rank, world_size):\n    return SEEN\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("HFPATCH_WORLD_IMPORT", "outer")
    import reads_env_at_import

    assert run_world(2, reads_env_at_import.fn, env={"HFPATCH_WORLD_IMPORT": "for the ranks"}) == ["for the ranks"] * 2


def test_world_reports_the_failing_rank():
    with pytest.raises(DistributedFailure, match="(?s)1 of 2 ranks failed.*rank 1.*boom from rank 1"):
        run_world(2, _fail_on_rank_1, timeout=60)


def test_ranks_report_while_they_run_and_a_world_may_have_no_time_limit():
    seen = []
    assert run_world(2, _count_up, 3, timeout=None, on_report=lambda rank, value: seen.append((rank, value))) \
        == ["done", "done"]
    assert sorted(seen) == [(r, (r, i)) for r in range(2) for i in range(3)]
    assert [v for r, v in seen if r == 0] == [(0, 0), (0, 1), (0, 2)]      # each rank's reports in order


def test_report_outside_a_world_is_an_error():
    with pytest.raises(RuntimeError, match="report\\(\\) is for a rank of run_world"):
        report(1)


def test_a_failure_stops_a_hung_peer_after_the_grace_period(monkeypatch):
    """Without the grace period the parent would wait for the whole timeout (here 120 s). Rank 1 may be stopped
    too: it reported its traceback, then tearing down the group can wait for rank 0."""
    monkeypatch.setattr(world, "FAILURE_GRACE_S", 1.0)
    start = time.monotonic()
    with pytest.raises(DistributedFailure, match=r"(?s)boom from rank 1.*ranks \[0(, 1)?\] were stopped 1s after"):
        run_world(2, _rank_0_hangs_rank_1_fails, timeout=120)
    assert time.monotonic() - start < 60


def test_a_hung_world_fails_at_the_timeout():
    with pytest.raises(DistributedFailure, match=r"ranks \[0\] did not finish within 3s \(gloo; deadlock\?\)"):
        run_world(1, _sleep, timeout=3)


class _Interrupted(Exception):
    pass


def test_an_interrupted_parent_leaves_no_rank_running():
    """What pytest-timeout does to a hung test (an exception in the parent's main thread): the ranks are killed."""
    import multiprocessing
    import signal

    def interrupt(signum, frame):
        raise _Interrupted()

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.alarm(2)
    try:
        with pytest.raises(_Interrupted):
            run_world(2, _sleep, timeout=120)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    deadline = time.monotonic() + 10
    while multiprocessing.active_children() and time.monotonic() < deadline:   # reaps the killed ranks
        time.sleep(0.1)
    assert multiprocessing.active_children() == []


@pytest.mark.parametrize("kwargs, match", [
    (dict(world_size=0), r"world_size must be an int >= 1, got 0"),
    (dict(world_size=2, backend="mpi"), r"backend='mpi' is not supported; use one of \('gloo', 'nccl'\)"),
    (dict(world_size=2, timeout=0), r"timeout must be > 0 seconds, got 0"),
    (dict(world_size=torch.cuda.device_count() + 1, backend="nccl"),
     r"backend='nccl' needs one CUDA device per rank \(\d+\), found \d+; skip the test"),
])
def test_bad_arguments_are_refused_before_spawning(kwargs, match):
    world_size = kwargs.pop("world_size")
    with pytest.raises(ValueError, match=match):
        run_world(world_size, _allreduce, **kwargs)


def _nccl_rank(rank, world_size):
    assert torch.cuda.current_device() == rank
    values = _allreduce(rank, world_size, device="cuda")
    bound = getattr(dist.group.WORLD, "bound_device_id", None)   # set by device_id= (torch >= 2.3)
    return {**values, "bound": None if bound is None else str(bound)}


def _nccl_rank_1_fails(rank, world_size):
    if rank == 1:
        raise ValueError("boom from rank 1 on cuda:1")
    t = torch.ones(1, device="cuda")
    dist.all_reduce(t)          # rank 1 never joins: NCCL blocks here until the harness stops this rank
    torch.cuda.synchronize()


@pytest.mark.gpu
@needs_two_gpus
def test_nccl_world_runs_one_gpu_per_rank_and_reports_failures(monkeypatch):
    values = run_world(2, _nccl_rank, backend="nccl", timeout=120)
    assert [v["backend"] for v in values] == ["nccl", "nccl"]
    assert [v["bound"] for v in values] in ([None, None], ["cuda:0", "cuda:1"]), values
    monkeypatch.setattr(world, "FAILURE_GRACE_S", 3.0)
    with pytest.raises(DistributedFailure, match=r"(?s)rank 1.*boom from rank 1 on cuda:1"):
        run_world(2, _nccl_rank_1_fails, backend="nccl", timeout=120)


def test_a_taken_store_port_starts_the_world_again_on_another(monkeypatch):
    """The parent picks a free port that rank 0 binds seconds later; when something took it meanwhile, the world
    starts again on a fresh port instead of failing."""
    import socket

    holder = socket.socket()
    holder.bind(("", 0))
    holder.listen()
    taken = holder.getsockname()[1]
    ports = iter([taken])
    free = world.free_port
    monkeypatch.setattr(world, "free_port", lambda: next(ports, None) or free())
    monkeypatch.setattr(world, "FAILURE_GRACE_S", 1.0)
    try:
        values = run_world(2, _allreduce, timeout=120)
    finally:
        holder.close()
    assert [v["rank"] for v in values] == [0, 1]
    assert next(ports, "used") == "used"   # the taken port was handed out first


def test_a_port_taken_every_time_is_reported(monkeypatch):
    import socket

    holder = socket.socket()
    holder.bind(("", 0))
    holder.listen()
    monkeypatch.setattr(world, "free_port", lambda: holder.getsockname()[1])
    monkeypatch.setattr(world, "FAILURE_GRACE_S", 0.5)
    try:
        with pytest.raises(DistributedFailure, match=r"(?s)port was taken before rank 0 could bind it, 3 times"):
            run_world(2, _allreduce, timeout=120)
    finally:
        holder.close()
