"""A local world: run a function on N processes of this machine joined in a process group.

    values = run_world(2, fn, *args)             # fn(rank, world_size, *args) on 2 gloo CPU processes
    values = run_world(2, fn, backend="nccl")    # rank r on cuda:r

One spawner for everything that needs ranks on one machine: trying ``ring_kernels`` without a launcher,
``hfpatch demo``, ``hfpatch check``'s dry run, the model sweep, and the tests. ``fn`` must be defined at module
level (it is pickled by name into the children); its return values must pickle.

The ranks are forked from multiprocessing's fork server, which imports this module (so torch) and whatever
``preload_in_ranks`` named once, when the process's first world starts (seconds); each later world starts in a
fraction of a second. (A spawned rank imports torch and the caller's modules anew: seconds per world.) A rank
gets the parent's environment at the time of the call (``os.environ`` with ``env`` added), applied before any of
the caller's modules is imported in it; modules the server preloaded saw the environment of the first world's
start. Where the platform has no fork server, ranks are spawned.

``backend="nccl"`` pins rank r to ``cuda:r`` (``torch.cuda.set_device`` and ``device_id`` at
``init_process_group``, so the communicator is created eagerly on that device); gloo ranks use one CPU thread
each. A rank that raises sends its traceback to the parent, which raises ``DistributedFailure`` naming every
failed rank once every rank has exited, or ``FAILURE_GRACE_S`` seconds after the first failure (a peer blocked
in a collective on the failed rank never returns by itself: NCCL waits 10 minutes, gloo 30), or at ``timeout``.
A rank may send values while it runs (``report(value)``): the parent hands each to ``on_report(rank, value)`` as
it arrives (progress of a long world).

The store's port is chosen free in the parent (``free_port``), then bound by rank 0 seconds later (after importing
torch); another process (a parallel test run, an ephemeral client socket) can take it meanwhile. Then the world
starts again on a new port, at most ``PORT_ATTEMPTS`` times in all.
"""
from __future__ import annotations

import datetime
import os
import socket
import sys
import time
import traceback
from multiprocessing.connection import wait
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run_world", "report", "free_port", "exit_now", "preload_in_ranks", "start_method", "DistributedFailure",
           "BACKENDS", "FAILURE_GRACE_S", "PORT_ATTEMPTS"]

BACKENDS = ("gloo", "nccl")
# Seconds the other ranks get to finish (or report their own failure) after one rank failed.
FAILURE_GRACE_S = 10.0
PORT_ATTEMPTS = 3
_PORT_TAKEN = ("EADDRINUSE", "Address already in use")
_POLL_S = 0.2
# The child's end of the results queue and its rank, for ``report`` (set in each spawned rank only).
_channel: Optional[tuple] = None


class DistributedFailure(RuntimeError):
    """A rank failed, hung past the timeout, or exited without a result; the message has every rank's traceback.

    Fields: ``failed`` {rank: traceback text}, ``hung`` the ranks still running at the timeout."""

    def __init__(self, message: str, *, failed: Optional[dict] = None, hung: tuple = ()):
        super().__init__(message)
        self.failed = dict(failed or {})
        self.hung = tuple(hung)


def free_port() -> int:
    """A TCP port of 127.0.0.1 that is free now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def report(value: Any) -> None:
    """From inside a rank of ``run_world``: send ``value`` (it must pickle) to the parent's ``on_report`` now."""
    if _channel is None:
        raise RuntimeError("report() is for a rank of run_world; this process is not one")
    results, rank = _channel
    results.put(("report", rank, value))


def exit_now(status: int) -> None:
    """End the process without interpreter finalization. Its outcome is already reported and its process groups
    are destroyed; what finalization could still do is abort: a gloo worker thread that outlives the interpreter
    aborts the process ("terminate called without an active exception", exit -6), which would fail a world whose
    ranks all passed."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream has nothing left to flush
            pass
    os._exit(status)


class _Environment:
    """The parent's environment for a rank: unpickling it (the first of the rank's arguments, before ``fn`` and the
    modules ``fn`` needs are imported) makes it the rank's ``os.environ``."""

    def __init__(self, environ: dict) -> None:
        self.environ = environ

    def __reduce__(self):
        return _set_environment, (self.environ,)


def _set_environment(environ: dict) -> None:
    os.environ.clear()
    os.environ.update(environ)


def _child(environ, rank, world_size, port, backend, group_timeout, fn, args, kwargs, results):
    # ``environ`` (an ``_Environment``) did its work when the rank unpickled it, before ``fn``
    global _channel
    _channel = (results, rank)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    initialised, status = False, 0
    timeout = {} if group_timeout is None else {"timeout": datetime.timedelta(seconds=group_timeout)}
    try:
        if backend == "nccl":
            # CPU work in a GPU world is small (inputs, references on the host): share the cores.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", rank=rank, world_size=world_size, device_id=device, **timeout)
        else:
            torch.set_num_threads(1)   # many ranks on few cores: one thread each
            dist.init_process_group("gloo", rank=rank, world_size=world_size, **timeout)
            # gloo connects every pair inside init; a rank that returned from it may still be connecting its
            # peers. Without this barrier a rank whose ``fn`` fails at once exits while a peer is mid-connect,
            # and that peer's init fails too ("Connection closed by peer"): the world would report two failures
            # for one.
            dist.barrier()
        initialised = True
        value = fn(rank, world_size, *args, **kwargs)
        results.put(("ok", rank, value))
        # Rank 0 hosts the store: it must not exit while a slower peer still uses it (a subgroup's gloo
        # rendezvous reads the store). The result is already reported, so a peer that failed meanwhile (and left
        # this barrier unfinished) changes nothing here.
        _wait_for_peers()
    except BaseException as exc:  # reported first: tearing the group down may block on a peer that waits for us
        text = traceback.format_exc()
        port_taken = not initialised and any(s in str(exc) for s in _PORT_TAKEN)
        results.put(("port taken" if port_taken else "error", rank, text))
        status = 1
    finally:
        if initialised:
            dist.destroy_process_group()
    exit_now(status)


def _wait_for_peers() -> None:
    try:
        dist.barrier()
    except Exception:   # noqa: BLE001 - teardown only: the peer's own failure is what gets reported
        pass


def _check_arguments(world_size, backend, timeout) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"run_world: world_size must be an int >= 1, got {world_size!r}")
    if backend not in BACKENDS:
        raise ValueError(f"run_world: backend={backend!r} is not supported; use one of {BACKENDS}")
    if timeout is not None and not timeout > 0:
        raise ValueError(f"run_world: timeout must be > 0 seconds, got {timeout!r} (None: no limit)")
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise ValueError(f"run_world: backend='nccl' needs one CUDA device per rank ({world_size}), found "
                         f"{torch.cuda.device_count()}; skip the test (or the run) with fewer GPUs, or use "
                         "backend='gloo'")


def _supervise(procs, results, timeout: Optional[float], on_report):
    """Wait for the ranks; stop the rest ``FAILURE_GRACE_S`` after a failure, or all at ``timeout``.

    Returns (messages from the ranks, ranks stopped after a failure, ranks stopped at the timeout). The queue
    is drained while waiting, so a rank never blocks on a full pipe while writing a long traceback."""
    messages, failed_at = [], None
    deadline = None if timeout is None else time.monotonic() + timeout

    def drain():
        while not results.empty():
            kind, rank, value = results.get()
            if kind == "report":
                if on_report is not None:
                    on_report(rank, value)
            else:
                messages.append((kind, rank, value))

    while True:
        drain()
        alive = [p for p in procs if p.is_alive()]
        now = time.monotonic()
        if failed_at is None and (any(kind != "ok" for kind, _, _ in messages)
                                  or any(p.exitcode not in (None, 0) for p in procs)):
            failed_at = now
        if (not alive or (deadline is not None and now >= deadline)
                or (failed_at is not None and now - failed_at >= FAILURE_GRACE_S)):
            break
        wait([p.sentinel for p in alive], timeout=_POLL_S)
    stopped = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in stopped:
        procs[r].kill()
    for p in procs:
        p.join()
    drain()
    after_failure = stopped if failed_at is not None else []
    return messages, after_failure, [] if failed_at is not None else stopped


def run_world(world_size: int, fn: Callable, *args, backend: str = "gloo", timeout: Optional[float] = 300.0,
              group_timeout: Optional[float] = None, env: Optional[dict] = None,
              on_report: Optional[Callable[[int, Any], None]] = None, **kwargs) -> list:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` processes; raise on any failure.

    backend: "gloo" (CPU) or "nccl" (rank r on cuda:r; needs ``world_size`` GPUs). timeout: seconds for the whole
    world, start-up included (None: no limit). group_timeout: seconds a collective of the process group may wait
    before it raises (None: torch's default). env: variables set for the children only. on_report: called in
    this process with (rank, value) for every ``report(value)`` of a rank, as it arrives. Returns the ranks' return
    values (index = rank). Raises ``DistributedFailure`` with every failed rank's traceback."""
    _check_arguments(world_size, backend, timeout)
    for _ in range(PORT_ATTEMPTS):
        messages, stopped_after_failure, hung, procs = _run_once(world_size, fn, args, kwargs, backend, timeout,
                                                                 group_timeout, env, on_report)
        if not any(kind == "port taken" for kind, _, _ in messages):
            break
    else:
        taken = "\n".join(text for kind, _, text in messages if kind == "port taken")
        raise DistributedFailure(f"the store's port was taken before rank 0 could bind it, {PORT_ATTEMPTS} times "
                                 f"in a row ({backend}):\n{taken}")
    failures = sorted((rank, text) for kind, rank, text in messages if kind == "error")
    if failures:
        msg = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in failures)
        note = (f"\n(ranks {stopped_after_failure} were stopped {FAILURE_GRACE_S:g}s after the first failure)"
                if stopped_after_failure else "")
        raise DistributedFailure(f"{len(failures)} of {world_size} ranks failed ({backend}):\n{msg}{note}",
                                 failed=dict(failures))
    if hung:
        raise DistributedFailure(f"ranks {hung} did not finish within {timeout}s ({backend}; deadlock?)", hung=hung)
    bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
    if bad:
        raise DistributedFailure(f"ranks exited with non-zero codes and no traceback ({backend}): {bad}")
    values = {rank: value for kind, rank, value in messages if kind == "ok"}
    return [values[r] for r in range(world_size)]


# Modules the fork server imports once, so that each rank forked from it starts with them imported (a spawned rank
# imports torch anew: seconds). This module is one of them, so that a rank finds ``_child`` without importing
# anything before its environment is set. ``preload_in_ranks`` adds to it before the first world starts.
PRELOAD = [__name__]
_CONTEXT = None


def preload_in_ranks(*modules: str) -> None:
    """Have every rank start with ``modules`` imported (the fork server imports them once); effective only before
    the first world of this process starts."""
    PRELOAD.extend(m for m in modules if m not in PRELOAD)


def start_method() -> str:
    """How this process starts ranks: "forkserver", or "spawn" where the platform has no fork server."""
    return _context().get_start_method()


def _context():
    """The fork-server context (ranks forked from one server that imported ``PRELOAD``), or spawn where the
    platform has no fork server."""
    global _CONTEXT
    if _CONTEXT is None:
        if "forkserver" in mp.get_all_start_methods():
            _CONTEXT = mp.get_context("forkserver")
            _CONTEXT.set_forkserver_preload(list(PRELOAD))
        else:
            _CONTEXT = mp.get_context("spawn")
    return _CONTEXT


def _run_once(world_size, fn, args, kwargs, backend, timeout, group_timeout, env, on_report):
    """One start of the world on a fresh port: (messages, ranks stopped after a failure, hung ranks, processes)."""
    ctx = _context()
    results = ctx.SimpleQueue()
    port = free_port()
    environ = _Environment({**os.environ, **(env or {})})
    procs = [ctx.Process(target=_child, args=(environ, r, world_size, port, backend, group_timeout, fn, args, kwargs,
                                              results))
             for r in range(world_size)]
    try:
        for p in procs:
            p.start()
        messages, stopped_after_failure, hung = _supervise(procs, results, timeout, on_report)
    except BaseException:   # a test timeout or Ctrl-C interrupted the parent: leave no orphaned rank behind
        for p in procs:
            if p.is_alive():
                p.kill()
        raise
    return messages, stopped_after_failure, hung, procs
