"""Run a function on N processes joined in a process group: gloo on CPU, or NCCL with one GPU per rank.

Spawning costs a few seconds per process (importing torch), so tests batch many cases into one
world: ``run_world(4, _cases_fn, cases)`` where ``_cases_fn(rank, world_size, cases)`` loops.
The function must be defined at module level (it is pickled by name into the children).

``backend="nccl"`` pins rank r to ``cuda:r`` (``torch.cuda.set_device`` and ``device_id`` at
``init_process_group``, so the communicator is created eagerly on that device). Either way a rank that
raises sends its traceback to the parent, which re-raises it as ``DistributedFailure`` once every rank
has exited, or ``_FAILURE_GRACE_S`` seconds after the first failure (a peer blocked in a collective on
the failed rank never returns by itself: NCCL waits 10 minutes, gloo 30), or at ``timeout``.
"""
from __future__ import annotations

import os
import socket
import sys
import time
import traceback
from multiprocessing.connection import wait

import torch.multiprocessing as mp

_BACKENDS = ("gloo", "nccl")
# Seconds the other ranks get to finish (or report their own failure) after one rank failed.
_FAILURE_GRACE_S = 10.0
# The store's port is chosen free in the parent, then bound by rank 0 seconds later (after importing torch); another
# process (a parallel tox env, an ephemeral client socket) can take it meanwhile. Then the world starts again on a
# new port, at most _PORT_ATTEMPTS times in all.
_PORT_TAKEN = ("EADDRINUSE", "Address already in use")
_PORT_ATTEMPTS = 3


class DistributedFailure(AssertionError):
    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank, world_size, port, backend, fn, args, kwargs, results):
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    initialised, status = False, 0
    try:
        if backend == "nccl":
            # CPU work in a GPU test is small (inputs, references on the host): share the cores, no oversubscription.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", rank=rank, world_size=world_size, device_id=device)
        else:
            torch.set_num_threads(1)   # many ranks on few cores: one thread each
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        initialised = True
        value = fn(rank, world_size, *args, **kwargs)
        results.put(("ok", rank, value))
        # Rank 0 hosts the store: it must not exit while a slower peer still uses it (a subgroup's gloo
        # rendezvous reads the store; a peer got "connection closed" in CI). The result is already reported, so
        # a peer that failed meanwhile (and left this barrier unfinished) changes nothing here.
        _wait_for_peers(dist)
    except BaseException as exc:  # reported first: tearing the group down may block on a peer that waits for us
        text = traceback.format_exc()
        port_taken = not initialised and any(s in str(exc) for s in _PORT_TAKEN)
        results.put(("port taken" if port_taken else "error", rank, text))
        status = 1
    finally:
        if initialised:
            dist.destroy_process_group()
    exit_now(status)


def exit_now(status: int) -> None:
    """End the rank without interpreter finalization. Its outcome is already in the (unbuffered) results queue and
    its process groups are destroyed; what finalization could still do is abort: a gloo worker thread that
    outlives the interpreter aborts the process ("terminate called without an active exception", exit -6; seen
    once in CI after every rank had reported "ok"), which would fail a test whose ranks all passed."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream has nothing left to flush
            pass
    os._exit(status)


def _wait_for_peers(dist) -> None:
    try:
        dist.barrier()
    except Exception:   # noqa: BLE001 - teardown only: the peer's own failure is what gets reported
        pass


def _check_arguments(world_size, backend, timeout) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"run_world: world_size must be an int >= 1, got {world_size!r}")
    if backend not in _BACKENDS:
        raise ValueError(f"run_world: backend={backend!r} is not supported; use one of {_BACKENDS}")
    if not timeout > 0:
        raise ValueError(f"run_world: timeout must be > 0 seconds, got {timeout!r}")
    if backend == "nccl":
        import torch

        found = torch.cuda.device_count()
        if found < world_size:
            raise ValueError(f"run_world: backend='nccl' needs one CUDA device per rank ({world_size}), found "
                             f"{found}; skip the test with fewer GPUs (pytest.mark.skipif) or use backend='gloo'")


def _start(procs, env: dict) -> None:
    """Start the ranks with ``env`` added to their environment (spawn copies the parent's at start)."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        for p in procs:
            p.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _supervise(procs, results, timeout: float):
    """Wait for the ranks; stop the rest ``_FAILURE_GRACE_S`` after a failure, or all at ``timeout``.

    Returns (messages from the ranks, ranks stopped after a failure, ranks stopped at the timeout). The queue
    is drained while waiting, so a rank never blocks on a full pipe while writing a long traceback."""
    messages, deadline, failed_at = [], time.monotonic() + timeout, None
    while True:
        while not results.empty():
            messages.append(results.get())
        alive = [p for p in procs if p.is_alive()]
        now = time.monotonic()
        if failed_at is None and (any(kind != "ok" for kind, _, _ in messages)
                                  or any(p.exitcode not in (None, 0) for p in procs)):
            failed_at = now
        if not alive or now >= deadline or (failed_at is not None and now - failed_at >= _FAILURE_GRACE_S):
            break
        wait([p.sentinel for p in alive], timeout=0.2)
    stopped = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in stopped:
        procs[r].kill()
    for p in procs:
        p.join()
    while not results.empty():
        messages.append(results.get())
    after_failure = stopped if failed_at is not None else []
    return messages, after_failure, [] if failed_at is not None else stopped


def run_world(world_size: int, fn, *args, backend: str = "gloo", timeout: float = 300.0,
              env: dict | None = None, **kwargs) -> list:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` processes; re-raise failures.

    backend: "gloo" (CPU) or "nccl" (rank r on cuda:r; needs ``world_size`` GPUs). timeout: seconds for the
    whole world, start-up included. env: variables set for the children only. Returns the ranks' return values
    (index = rank; they must pickle). Raises ``DistributedFailure`` with every failed rank's traceback."""
    _check_arguments(world_size, backend, timeout)
    for _ in range(_PORT_ATTEMPTS):
        messages, stopped_after_failure, hung, procs = _run_once(world_size, fn, args, kwargs, backend, timeout, env)
        if not any(kind == "port taken" for kind, _, _ in messages):
            break
    else:
        taken = "\n".join(text for kind, _, text in messages if kind == "port taken")
        raise DistributedFailure(f"the store's port was taken before rank 0 could bind it, {_PORT_ATTEMPTS} times "
                                 f"in a row ({backend}):\n{taken}")
    failures = sorted((rank, text) for kind, rank, text in messages if kind == "error")
    if failures:
        msg = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in failures)
        note = (f"\n(ranks {stopped_after_failure} were stopped {_FAILURE_GRACE_S:g}s after the first failure)"
                if stopped_after_failure else "")
        raise DistributedFailure(f"{len(failures)} of {world_size} ranks failed ({backend}):\n{msg}{note}")
    if hung:
        raise DistributedFailure(f"ranks {hung} did not finish within {timeout}s ({backend}; deadlock?)")
    bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
    if bad:
        raise DistributedFailure(f"ranks exited with non-zero codes and no traceback ({backend}): {bad}")
    values = {rank: value for kind, rank, value in messages if kind == "ok"}
    return [values[r] for r in range(world_size)]


def _run_once(world_size, fn, args, kwargs, backend, timeout, env):
    """One start of the world on a fresh port: (messages, ranks stopped after a failure, hung ranks, processes)."""
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_child, args=(r, world_size, port, backend, fn, args, kwargs, results))
             for r in range(world_size)]
    try:
        _start(procs, env or {})
        messages, stopped_after_failure, hung = _supervise(procs, results, timeout)
    except BaseException:   # pytest-timeout or Ctrl-C interrupted the parent: leave no orphaned rank behind
        for p in procs:
            if p.is_alive():
                p.kill()
        raise
    return messages, stopped_after_failure, hung, procs
