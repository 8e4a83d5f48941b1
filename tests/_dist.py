"""Run a function on N CPU processes joined in a gloo process group.

Spawning costs a few seconds per process (importing torch), so tests batch many cases into one
world: ``run_world(4, _cases_fn, cases)`` where ``_cases_fn(rank, world_size, cases)`` loops.
The function must be defined at module level (it is pickled by name into the children).
"""
from __future__ import annotations

import os
import socket
import traceback

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank, world_size, port, fn, args, kwargs, errors):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["LOCAL_RANK"] = str(rank)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        try:
            fn(rank, world_size, *args, **kwargs)
        finally:
            dist.destroy_process_group()
    except BaseException:  # reported to the parent, which re-raises it
        errors.put((rank, traceback.format_exc()))
        raise SystemExit(1)


class DistributedFailure(AssertionError):
    pass


def run_world(world_size: int, fn, *args, timeout: float = 300.0, env: dict | None = None, **kwargs) -> None:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo processes; re-raise failures."""
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    port = _free_port()
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        procs = [
            ctx.Process(target=_child, args=(r, world_size, port, fn, args, kwargs, errors), daemon=False)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    if failures:
        failures.sort()
        msg = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in failures)
        raise DistributedFailure(f"{len(failures)} of {world_size} ranks failed:\n{msg}")
    if hung:
        raise DistributedFailure(f"ranks {hung} did not finish within {timeout}s (deadlock?)")
    bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
    if bad:
        raise DistributedFailure(f"ranks exited with non-zero codes: {bad}")
