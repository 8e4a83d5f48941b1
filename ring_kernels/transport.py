"""Ring exchange over the GPU's copy engines (torch symmetric memory), and the choice between it and NCCL.

Why: NCCL's SendRecv kernels need SMs. Launched next to an attention kernel that fills every SM (cuDNN), the
K/V transfer of a ring step only starts at that kernel's tail and leaves the compute stream idle meanwhile
(docs/performance.md, "Where the time goes", has the measurements). A peer-to-peer ``tensor.copy_`` between symmetric-memory buffers is a
copy-engine (CE) transfer over NVLink: no SMs. What remains is telling the peers "my staging is filled" and
"I have read yours", two ways (``signal=``):
- "barrier" (default): torch's one-block barrier kernel, with a timeout. It still needs an SM for a moment;
  its side stream has high priority, so it gets the first free one.
- "stream_memop": sequence numbers written into the peer's symmetric flags with ``cuStreamWriteValue32`` and
  awaited with ``cuStreamWaitValue32``, both executed by the stream's front end: no kernel, no SM; but a peer
  that never arrives stalls the side stream (no timeout), so it is opt-in until measured.

One exchange (``CopyEngineExchange.start``), all on a high-priority side stream per (group, tag, device, signal):

    side waits for the current stream            # send is ready
    [stream_memop: wait until the last reader of my staging said it is done]
    my staging[offsets] <- send                  # local copy into symmetric memory
    signal "filled"                              # barrier(READY) / write my reader's flag, wait for my source's
    recv <- staging of the source rank           # CE pull over NVLink        -> event ``done``
    signal "read"                                # barrier(DONE) / write my source's flag

``wait()`` makes the current stream wait for ``done`` (recv filled, send already copied out), so the "read"
signal never delays the caller; the next exchange of the same tag is queued behind it on the side stream.
Two tags in flight at once (K/V tag 0, dK/dV tag 1) have separate stagings, streams and signal pads/flags.

Allocator safety: ``send``/``recv`` belong to the caller's stream. Instead of ``record_stream`` the exchange
keeps Python references to them until ``wait()``, and ``wait()`` orders the stream they were handed over on
after the last side-stream use (``done``); so the caching allocator can only hand their memory out again
after the side stream is finished with it.

Collective requirements (as for NCCL): every rank of the group starts the same exchanges, with the same byte
sizes, in the same order. Growing a staging (the first exchange of a tag, or a larger one) allocates and
rendezvouses symmetric memory: a collective that blocks the host once; every other ``start`` never blocks it.
"""
from __future__ import annotations

import socket
import warnings
import weakref
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .comm import RingExchange, group_rank_and_size
from .errors import RingInputError
from .options import ENVIRONMENT, SIGNALS, TRANSPORTS, get_options

__all__ = ["CopyEngineExchange", "CopyEngineUnavailableError", "copy_engine_unavailable_reason",
           "make_exchange", "TRANSPORT_ENV", "TRANSPORTS"]

TRANSPORT_ENV = ENVIRONMENT["transport"]
SIGNAL_ENV = ENVIRONMENT["copy_engine_signal"]
_MAX_TENSORS = 4
ALIGN = 256                     # byte alignment of each tensor in a staging (any dtype can view it)
_GROW_GRANULE = 2 << 20         # stagings grow in 2 MiB steps: ring shapes are fixed, so little is wasted
READY, DONE = 0, 1              # barrier channels (each staging has its own signal pad, so tags never collide)
_PROBE_TIMEOUT_MS = 60_000
DEFAULT_TIMEOUT_MS = 600_000    # like NCCL's default: a rank that never arrives traps the barrier kernel


# The CUDA calls of the exchange's data path go through this name, so that tests can run that path on CPU
# processes with stand-ins (tests/ring_kernels/test_transport.py); nothing else replaces it.
cuda = torch.cuda


def exchange_device() -> torch.device:
    """The device this process's exchanges run on: the current CUDA device."""
    return torch.device("cuda", cuda.current_device())


class CopyEngineUnavailableError(RuntimeError):
    """``copy_engine`` transport requested where it cannot run; ``reason`` says why."""

    def __init__(self, message: str, *, reason: str):
        super().__init__(message)
        self.reason = reason


# ---------------------------------------------------------------------------------------------------------
# torch symmetric memory: the few entry points used, checked once

_SYMM_API = ("get_buffer", "barrier", "rank", "world_size")


def symmetric_memory():
    """(module, None) when torch has the symmetric-memory API used here, else (None, why)."""
    try:
        from torch.distributed import _symmetric_memory as symm
        from torch._C._distributed_c10d import _SymmetricMemory
    except ImportError as exc:
        return None, f"this torch build has no symmetric memory ({exc}); torch >= 2.6 with CUDA has it"
    missing = [n for n in ("empty", "rendezvous") if not hasattr(symm, n)]
    missing += [f"_SymmetricMemory.{n}" for n in _SYMM_API if not hasattr(_SymmetricMemory, n)]
    if missing:
        return None, f"torch {torch.__version__} lacks symmetric-memory API {missing}"
    return symm, None


def _group_name(group: Optional[dist.ProcessGroup]) -> str:
    return (group if group is not None else dist.group.WORLD).group_name


def _rendezvous(symm, tensor: torch.Tensor, group_name: str):
    """Collective: exchange ``tensor``'s (symmetric) allocation with the group. Torch releases before
    rendezvous resolved groups by name needed ``enable_symm_mem_for_group`` first; newer ones deprecate it."""
    try:
        return symm.rendezvous(tensor, group_name)
    except RuntimeError as exc:
        enable = getattr(symm, "enable_symm_mem_for_group", None)
        if enable is None or "group" not in str(exc).lower():
            raise
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        enable(group_name)
    return symm.rendezvous(tensor, group_name)


def _aligned(nbytes: int, align: int = ALIGN) -> int:
    return -(-nbytes // align) * align


def layout(tensors: Sequence[torch.Tensor]) -> Tuple[List[int], int]:
    """Byte offsets of ``tensors`` packed one after another in a staging (each ALIGN-aligned), and the total."""
    offsets, end = [], 0
    for t in tensors:
        offsets.append(end)
        end = _aligned(end + t.numel() * t.element_size())
    return offsets, end


def view(raw: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    """The bytes of ``raw`` (uint8) at ``offset`` seen as a tensor of ``like``'s dtype and shape."""
    nbytes = like.numel() * like.element_size()
    return raw[offset:offset + nbytes].view(like.dtype).view(like.shape)


# ---------------------------------------------------------------------------------------------------------
# availability: collective, once per (group, device)

_reasons: Dict[Tuple[str, int], Optional[str]] = {}


def _local_reason(device: torch.device) -> Optional[str]:
    if device.type != "cuda":
        return (f"device {device} is not a CUDA device (the copy-engine transport moves data between GPUs over "
                f"NVLink/PCIe peer access)")
    if not torch.cuda.is_available():
        return "CUDA is not available in this process"
    return symmetric_memory()[1]


def peer_reason(me: int, infos: List[dict]) -> Optional[str]:
    """Why the ranks (``infos``: host, device index, local reason) cannot reach each other, or None."""
    for r, info in enumerate(infos):
        if info["reason"]:
            return f"rank {r} of the group: {info['reason']}"
    hosts = sorted({info["host"] for info in infos})
    if len(hosts) > 1:
        return f"the group spans several hosts {hosts}; copy-engine transfers need every rank on one host"
    devices = [info["device"] for info in infos]
    if len(set(devices)) == len(devices):   # indices name distinct GPUs here (not hidden by CUDA_VISIBLE_DEVICES)
        for r, d in enumerate(devices):
            if r != me and not torch.cuda.can_device_access_peer(devices[me], d):
                return f"cuda:{devices[me]} (rank {me}) has no peer access to cuda:{d} (rank {r})"
    return None


def probe(group: Optional[dist.ProcessGroup], device: torch.device) -> Optional[str]:
    """Collective: one tiny exchange through symmetric memory; None when every value arrived."""
    symm, _ = symmetric_memory()
    rank, world = group_rank_and_size(group)
    try:
        buf = symm.empty(ALIGN, dtype=torch.uint8, device=device)
        handle = _rendezvous(symm, buf, _group_name(group))
        mine = torch.full((4,), rank + 1, dtype=torch.int32, device=device)
        view(buf, 0, mine).copy_(mine)
        handle.barrier(READY, _PROBE_TIMEOUT_MS)
        got = [view(handle.get_buffer(r, (ALIGN,), torch.uint8), 0, mine).clone() for r in range(world)]
        handle.barrier(DONE, _PROBE_TIMEOUT_MS)
        cuda.synchronize(device)
        seen = [int(g[0]) for g in got]
    except Exception as exc:   # any failure of the probe is the reason, reported to every rank
        return f"symmetric-memory probe failed on rank {rank}: {type(exc).__name__}: {exc}"
    if seen != list(range(1, world + 1)):
        return f"symmetric-memory probe on rank {rank} read {seen} from ranks 0..{world - 1}, expected 1..{world}"
    return None


def _all_ranks(group, value) -> list:
    out = [None] * group_rank_and_size(group)[1]
    dist.all_gather_object(out, value, group=group)
    return out


def copy_engine_unavailable_reason(group: Optional[dist.ProcessGroup] = None,
                                   device: Optional[torch.device] = None) -> Optional[str]:
    """None when ``CopyEngineExchange`` can run on ``group`` from ``device`` (default: the current CUDA
    device), else a sentence saying why. Checks: a CUDA device, torch with symmetric memory, every rank of
    the group on this host with peer access, and a real exchange through a rendezvoused buffer.

    Collective on the group the first time (every rank must call it; all ranks get the same answer, so none
    picks a transport its peers did not); cached per (group, device) after that. Without CUDA or an
    initialised process group it returns the reason at once, without communicating.
    """
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if not (dist.is_available() and dist.is_initialized()):
        return "torch.distributed is not initialised (the copy-engine transport exchanges between ranks)"
    local = _local_reason(device)
    if device.type != "cuda":
        return local
    key = (_group_name(group), device.index)
    if key not in _reasons:
        with cuda.device(device):
            rank = group_rank_and_size(group)[0]
            infos = _all_ranks(group, {"host": socket.gethostname(), "device": device.index, "reason": local})
            # Peer access is seen from each rank's side: agree, so that no rank picks a transport alone.
            reason = _agreed(group, peer_reason(rank, infos))
            if reason is None:
                reason = _agreed(group, probe(group, device))
        _reasons[key] = reason
    return _reasons[key]


def _agreed(group, reason: Optional[str]) -> Optional[str]:
    """The lowest rank's reason if any rank has one (so all ranks decide alike), else None. Each reason
    names the rank it was found on."""
    return next((why for why in _all_ranks(group, reason) if why), None)


# ---------------------------------------------------------------------------------------------------------
# staging: one symmetric buffer, side stream and event per (group, tag, device)

class StreamMemOps:
    """``cuStreamWaitValue32`` / ``cuStreamWriteValue32`` from the CUDA driver (ctypes): a 32-bit wait or write
    executed by the stream's front end, so signalling needs no SM at all (unlike the barrier kernel). The wait
    is cyclic ``>=`` (``(int32)(*addr - value) >= 0``), so sequence numbers may wrap."""

    _WAIT_GEQ = 0x0             # CU_STREAM_WAIT_VALUE_GEQ
    _WRITE_DEFAULT = 0x0        # CU_STREAM_WRITE_VALUE_DEFAULT: a memory fence before the write

    def __init__(self):
        import ctypes

        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise CopyEngineUnavailableError(f"CopyEngineExchange(signal='stream_memop'): the CUDA driver library "
                                             f"cannot be loaded ({exc})", reason=str(exc)) from exc
        self._wait, self._write = (self._symbol(lib, name) for name in ("cuStreamWaitValue32", "cuStreamWriteValue32"))
        for fn in (self._wait, self._write):
            fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
            fn.restype = ctypes.c_int

    @staticmethod
    def _symbol(lib, name):
        for candidate in (name + "_v2", name):     # CUDA >= 11.7 exports the _v2 entry points
            fn = getattr(lib, candidate, None)
            if fn is not None:
                return fn
        raise CopyEngineUnavailableError(f"CopyEngineExchange(signal='stream_memop'): the CUDA driver has no "
                                         f"{name}", reason=f"no {name} in libcuda")

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"CopyEngineExchange: {what} failed with CUresult {rc}")

    def wait_geq(self, stream, address: int, value: int) -> None:
        self._check(self._wait(stream.cuda_stream, address, value & 0xFFFFFFFF, self._WAIT_GEQ), "cuStreamWaitValue32")

    def write(self, stream, address: int, value: int) -> None:
        self._check(self._write(stream.cuda_stream, address, value & 0xFFFFFFFF, self._WRITE_DEFAULT),
                    "cuStreamWriteValue32")


_memops: Optional[StreamMemOps] = None


def stream_memops() -> StreamMemOps:
    global _memops
    if _memops is None:
        _memops = StreamMemOps()
    return _memops


class _Staging:
    """The symmetric byte buffer a tag's exchanges stage through, with its side stream and ``done`` event.

    ``owner`` is the exchange in flight (one at a time per tag: they share the buffer). ``signal`` says how
    ranks tell each other "staging filled" and "staging read":
    - "barrier": torch's one-block barrier kernel (with a timeout) on channels READY and DONE;
    - "stream_memop": sequence numbers in a small symmetric flags buffer, written into the peer's flags with
      ``cuStreamWriteValue32`` and waited for locally with ``cuStreamWaitValue32``: no kernel, no SM, but no
      timeout either (a rank that never arrives stalls the side stream). flags[ready + r] = last exchange
      rank r filled its staging for; flags[read + r] = last exchange rank r finished reading ours in.
    """

    def __init__(self, group: Optional[dist.ProcessGroup], tag: int, device: torch.device, signal: str):
        self.group, self.tag, self.device, self.signal = group, tag, device, signal
        self.stream = cuda.Stream(device=device, priority=-1)   # high priority: barriers get an SM soon
        self.done = cuda.Event()
        self.buffer: Optional[torch.Tensor] = None      # (capacity,) uint8 in symmetric memory
        self.handle = None
        self.remote: Dict[int, torch.Tensor] = {}       # group rank -> (capacity,) uint8 view of its buffer
        self.owner = None                               # weakref to the exchange in flight, if any
        self.seq = 0                                    # exchanges started on this staging (same on every rank)
        self.last_reader: Optional[int] = None          # who read our staging in exchange ``seq``
        self.flags: Optional[torch.Tensor] = None       # stream_memop: 3 * world uint32 (see _make_flags)
        self.flag_ptrs: List[int] = []                  # stream_memop: each rank's flags address

    @property
    def capacity(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel()

    def ensure(self, nbytes: int) -> None:
        """Grow to at least ``nbytes`` (the max over ranks). Collective: every rank grows at the same call
        because every rank passes the same sizes; the all-reduce makes the new size agree regardless."""
        if nbytes <= self.capacity:
            return
        need = torch.tensor([nbytes], dtype=torch.int64, device=self.device)
        dist.all_reduce(need, op=dist.ReduceOp.MAX, group=self.group)
        capacity = _aligned(int(need.item()), _GROW_GRANULE)
        symm, why = symmetric_memory()
        if symm is None:
            raise CopyEngineUnavailableError(f"CopyEngineExchange: {why}", reason=why)
        if self.signal == "stream_memop" and self.flags is None:
            self._make_flags(symm)
        # The old buffer may still be read by a peer: wait until the last reader said so, then free it.
        self.gate_fill()
        self.stream.synchronize()
        self.buffer = symm.empty(capacity, dtype=torch.uint8, device=self.device)
        self.handle = _rendezvous(symm, self.buffer, _group_name(self.group))
        self.remote = {r: self.handle.get_buffer(r, (capacity,), torch.uint8)
                       for r in range(self.handle.world_size)}

    def _make_flags(self, symm) -> None:
        """The (3 * world,) uint32 flags: ready, read, and a probe slot per rank; zeroed, then probed."""
        world = group_rank_and_size(self.group)[1]
        self.flags = symm.empty(_aligned(12 * world), dtype=torch.uint8, device=self.device)
        handle = _rendezvous(symm, self.flags, _group_name(self.group))
        self.flags.zero_()
        cuda.synchronize(self.device)
        dist.barrier(group=self.group)     # every rank's flags are zero before anyone signals
        self._flags_handle = handle        # keeps the peers' mappings alive
        self._flag_views = [handle.get_buffer(r, (self.flags.numel(),), torch.uint8) for r in range(world)]
        self.flag_ptrs = [flag.data_ptr() for flag in self._flag_views]
        self._probe_memops()

    def _probe_memops(self, timeout_s: float = 60.0) -> None:
        """Every rank writes 1 into every peer's probe slot for it and waits for the peers' writes, on the side
        stream; the host polls an event, so a driver or mapping that never delivers fails here, with a
        message, instead of stalling every later exchange (stream waits have no timeout)."""
        import time

        me, world, ops = group_rank_and_size(self.group)[0], len(self.flag_ptrs), stream_memops()

        def slot(rank: int, about: int) -> int:
            return self.flag_ptrs[rank] + 4 * (2 * world + about)

        for r in range(world):
            if r != me:
                ops.write(self.stream, slot(r, me), 1)
        for r in range(world):
            if r != me:
                ops.wait_geq(self.stream, slot(me, r), 1)
        arrived = cuda.Event()
        arrived.record(self.stream)
        deadline = time.monotonic() + timeout_s
        while not arrived.query():
            if time.monotonic() > deadline:
                why = (f"no signal arrived within {timeout_s:g} s through cuStreamWriteValue32/WaitValue32 on "
                       f"symmetric memory (rank {me} of {world})")
                raise CopyEngineUnavailableError(f"CopyEngineExchange(signal='stream_memop'): {why}; use "
                                                 f"signal='barrier'", reason=why)
            time.sleep(0.001)

    def _flag(self, rank: int, kind: str, about: int) -> int:
        world = len(self.flag_ptrs)
        return self.flag_ptrs[rank] + 4 * ((0 if kind == "ready" else world) + about)

    # The steps of one exchange, enqueued on the side stream (current stream = side) by CopyEngineExchange.
    def gate_fill(self) -> None:
        """Before refilling our staging: the reader of the previous exchange has finished reading it."""
        if self.signal == "stream_memop" and self.last_reader is not None:
            me = self.handle.rank
            stream_memops().wait_geq(self.stream, self._flag(me, "read", self.last_reader), self.seq)

    def announce_filled(self, reader: int, source: int, timeout_ms: int) -> None:
        """Our staging holds exchange ``seq``'s data for ``reader``; wait until ``source``'s holds ours."""
        if self.signal == "barrier":
            self.handle.barrier(READY, timeout_ms)
            return
        me, ops = self.handle.rank, stream_memops()
        ops.write(self.stream, self._flag(reader, "ready", me), self.seq)
        ops.wait_geq(self.stream, self._flag(me, "ready", source), self.seq)

    def announce_read(self, source: int, timeout_ms: int) -> None:
        """We have read ``source``'s staging for exchange ``seq``."""
        if self.signal == "barrier":
            self.handle.barrier(DONE, timeout_ms)
            return
        stream_memops().write(self.stream, self._flag(source, "read", self.handle.rank), self.seq)


_stagings: Dict[Tuple[str, int, Optional[int], str], _Staging] = {}


def staging_for(group, tag: int, device: torch.device, signal: str = "barrier") -> _Staging:
    key = (_group_name(group), tag, device.index, signal)
    if key not in _stagings:
        _stagings[key] = _Staging(group, tag, device, signal)
    return _stagings[key]


# ---------------------------------------------------------------------------------------------------------
# the exchange

def check_tensors(fn: str, send: Sequence[torch.Tensor], recv: Sequence[torch.Tensor],
                  device: Optional[torch.device]) -> None:
    """send/recv: equal-length lists of 1.._MAX_TENSORS contiguous tensors (on ``device`` when given)."""
    if len(send) != len(recv):
        raise RingInputError(f"{fn}: {len(send)} tensors to send but {len(recv)} receive buffers; pass one "
                             f"receive buffer per sent tensor", argument="recv", value=len(recv))
    if not 1 <= len(send) <= _MAX_TENSORS:
        raise RingInputError(f"{fn}: send has {len(send)} tensors; between 1 and {_MAX_TENSORS} are supported "
                             f"(exchange more in several calls or in a concatenated tensor)",
                             argument="send", value=len(send))
    for name, tensors in (("send", send), ("recv", recv)):
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{fn}: {name}[{i}] is a {type(t).__name__}, expected a torch.Tensor")
            if not t.is_contiguous():
                raise RingInputError(f"{fn}: tensors must be contiguous; {name}[{i}] (shape {tuple(t.shape)}, "
                                     f"stride {t.stride()}) is not; pass {name}[{i}].contiguous()",
                                     argument=f"{name}[{i}]", value=tuple(t.stride()))
            if device is not None and t.device != device:
                raise RingInputError(f"{fn}: {name}[{i}] is on {t.device}, the exchange runs on {device}; move "
                                     f"it there (one GPU per rank)", argument=f"{name}[{i}]", value=str(t.device))


class CopyEngineExchange:
    """``RingExchange``'s interface and semantics on CUDA, moving data with copy engines instead of NCCL kernels.

    ``start(send, recv)`` begins sending ``send[i]`` to the next rank of ``group`` and receiving into
    ``recv[i]`` from the previous one (``reverse=True``: to the previous, from the next); it never blocks the
    host (except the first exchange of a tag or a larger one: a collective allocation). ``wait()`` orders the
    current stream after the transfer: ``recv`` is filled and ``send`` may be overwritten. ``tag`` selects the
    staging, side stream and signals: exchanges with different tags may be in flight together; two with the
    same tag may not (RuntimeError). ``timeout_ms``: how long a barrier waits for a peer before the kernel
    traps (the process fails instead of hanging); 0 waits forever. ``signal``: "barrier" (torch's one-block
    barrier kernel, with the timeout) or "stream_memop" (CUDA stream memory operations: no SM used, no
    timeout); None takes the option ``copy_engine_signal`` (``ring_kernels.options``; default "barrier"). Which one
    hides the transfer better next to an SM-filling kernel is what benchmarks/transport_bench.py measures.
    """

    def __init__(self, group: Optional[dist.ProcessGroup] = None, *, tag: int = 0, reverse: bool = False,
                 timeout_ms: int = DEFAULT_TIMEOUT_MS, signal: Optional[str] = None):
        signal = signal_choice(signal)
        if not isinstance(reverse, bool):
            raise TypeError(f"CopyEngineExchange: reverse={reverse!r} must be a bool (True: send to the previous "
                            f"rank and receive from the next; False, the default: the other way)")
        for name, value in (("tag", tag), ("timeout_ms", timeout_ms)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise RingInputError(f"CopyEngineExchange: {name}={value!r} must be an int >= 0",
                                     argument=name, value=value)
        self.group, self.tag, self.reverse, self.timeout_ms = group, tag, reverse, timeout_ms
        self.rank, self.world_size = group_rank_and_size(group)
        self._peer_next, self._peer_prev = (self.rank + 1) % self.world_size, (self.rank - 1) % self.world_size
        self.next_rank, self.prev_rank = self._global(self._peer_next), self._global(self._peer_prev)
        self.send_rank, self.recv_rank = ((self.prev_rank, self.next_rank) if reverse
                                          else (self.next_rank, self.prev_rank))
        self._source = self._peer_next if reverse else self._peer_prev     # group rank whose staging we read
        self._reader = self._peer_prev if reverse else self._peer_next     # group rank that reads ours
        if not cuda.is_available():
            why = "CUDA is not available in this process (copy engines move data between GPUs)"
            raise CopyEngineUnavailableError(f"CopyEngineExchange: {why}; use ring_kernels.comm.RingExchange or "
                                             f"make_exchange(), which picks it on CPU", reason=why)
        self.device = exchange_device()
        if self.world_size > 1:
            reason = copy_engine_unavailable_reason(group, self.device)
            if reason:
                raise CopyEngineUnavailableError(
                    f"CopyEngineExchange: the copy-engine transport cannot run here: {reason}. Use the NCCL "
                    f"transport (ring_kernels.comm.RingExchange, or the option transport='nccl')", reason=reason)
        self.signal = signal
        if self.world_size > 1 and signal == "stream_memop":
            stream_memops()                    # the driver entry points, checked before anything is enqueued
        self._staging = staging_for(group, tag, self.device, signal) if self.world_size > 1 else None
        self._pending = None     # (send, recv, stream they were handed over on) until wait()

    def _global(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    def start(self, send: Sequence[torch.Tensor], recv: Sequence[torch.Tensor]) -> None:
        """Begin the exchange; ``recv[i]`` must have the shape/dtype of the source rank's ``send[i]``.
        Neither may be touched until ``wait()`` returns."""
        fn = "CopyEngineExchange.start"
        if self._pending is not None:
            raise RuntimeError(f"{fn}: the previous exchange was not waited for; call wait() first")
        check_tensors(fn, send, recv, self.device)
        if self.world_size == 1:
            for s, r in zip(send, recv):   # a ring of one: what we send comes straight back
                r.copy_(s)
            return
        staging = self._staging
        # An owner that was garbage-collected without wait() (an exception unwound its ring) no longer holds
        # the staging: our work queues behind its on the side stream anyway.
        if staging.owner is not None and staging.owner() is not None:
            raise RuntimeError(f"{fn}: another CopyEngineExchange with tag={self.tag} on this group is in flight "
                               f"(they share one staging buffer); wait() for it first or use a different tag")
        send_at, send_bytes = layout(send)
        recv_at, recv_bytes = layout(recv)
        staging.ensure(max(send_bytes, recv_bytes))
        current = cuda.current_stream(self.device)
        side = staging.stream
        side.wait_stream(current)
        with cuda.stream(side):
            staging.gate_fill()                     # the previous exchange's reader is done with our staging
            staging.seq += 1
            for t, at in zip(send, send_at):
                view(staging.buffer, at, t).copy_(t)
            staging.announce_filled(self._reader, self._source, self.timeout_ms)
            source = staging.remote[self._source]
            for t, at in zip(recv, recv_at):
                t.copy_(view(source, at, t))
            staging.done.record(side)
            staging.announce_read(self._source, self.timeout_ms)
            staging.last_reader = self._reader
        staging.owner = weakref.ref(self)
        self._pending = (list(send), list(recv), current)

    def wait(self) -> None:
        """Order the current stream (and the one ``start`` ran on) after the transfer; a no-op when idle."""
        if self._pending is None:
            return
        _, _, started_on = self._pending
        current = cuda.current_stream(self.device)
        current.wait_event(self._staging.done)
        if started_on != current:
            started_on.wait_event(self._staging.done)
        self._pending = None          # the references kept send/recv alive until both streams are ordered
        self._staging.owner = None

    @property
    def in_flight(self) -> bool:
        return self._pending is not None


# ---------------------------------------------------------------------------------------------------------
# choosing a transport

def _choice(caller: str, name: str, given: Optional[str], choices, option: str) -> str:
    """``given`` if not None, else the option ``option`` (``ring_kernels.options``, validated there); ``given``
    must be one of ``choices`` (a ``RingInputError`` naming the argument otherwise)."""
    if given is not None:
        if given not in choices:
            raise RingInputError(f"{caller}: {name}={given!r} is not one of {choices}; pass one of them or None "
                                 f"(the option {option}, environment {ENVIRONMENT[option]})",
                                 argument=name, value=given)
        return given
    return getattr(get_options(), option)


def signal_choice(signal: Optional[str]) -> str:
    return _choice("CopyEngineExchange", "signal", signal, SIGNALS, "copy_engine_signal")


def transport_choice(transport: Optional[str]) -> str:
    return _choice("make_exchange", "transport", transport, TRANSPORTS, "transport")


def _group_on_cuda(group: Optional[dist.ProcessGroup]) -> bool:
    """Whether the group's exchanges run on CUDA: an initialised group with an NCCL backend and a GPU here."""
    if not (dist.is_available() and dist.is_initialized()) or not torch.cuda.is_available():
        return False
    return "nccl" in str(dist.get_backend(group)).lower()


def ring_exchange(group, tag: int, reverse: bool) -> RingExchange:
    return RingExchange(group, tag=tag, reverse=reverse)


def make_exchange(group: Optional[dist.ProcessGroup] = None, *, tag: int = 0, reverse: bool = False,
                  transport: Optional[str] = None):
    """A ring exchange for ``group``: ``RingExchange`` (NCCL/gloo P2P) or ``CopyEngineExchange``.

    ``transport``: "nccl", "copy_engine", or None for the option ``transport`` (``ring_kernels.options``;
    default "nccl"; another value: ValueError). "copy_engine" where it cannot run on a CUDA group raises
    ``CopyEngineUnavailableError`` (a RuntimeError) with the reason. On a group that is not on CUDA (gloo,
    CPU tensors, torch.distributed not initialised) or of one rank, the result is always ``RingExchange``,
    whatever was asked: copy engines are a GPU mechanism, and a CPU run of a configuration written for GPUs
    must still run.
    The first "copy_engine" call on a group is collective (see ``copy_engine_unavailable_reason``).
    """
    choice = transport_choice(transport)
    if choice == "nccl" or not _group_on_cuda(group) or group_rank_and_size(group)[1] == 1:
        return ring_exchange(group, tag, reverse)     # a ring of one only copies: nothing to move between GPUs
    reason = copy_engine_unavailable_reason(group, torch.device("cuda", torch.cuda.current_device()))
    if reason:
        raise CopyEngineUnavailableError(
            f"make_exchange: the copy_engine transport was requested but cannot run: {reason}. Set "
            f"the option transport='nccl' ({TRANSPORT_ENV}=nccl), or pass transport='nccl'", reason=reason)
    return CopyEngineExchange(group, tag=tag, reverse=reverse)
