"""Host work of one varlen ring call, measured on CPU: the ops it dispatches, the ones that would synchronise
the host with the GPU on CUDA, the collectives it issues, and its wall time with stub kernels.

Why: a varlen call on 2xH200 is host-bound (~1.2 ms forward against ~0.4 ms of kernel time per rank: benchmarks/results/README.md),
so every added host op, and above all every host<->device synchronisation, shows up 1:1 in its GPU time. This
script sees those on a CPU machine, with the CUDA-only fast paths driven the way the tests drive them (a stand-in
for ``torch_cuda_varlen``'s kernel returned by ``varlen_kernel_for``), so a regression is caught in CI or on a
laptop, and two source trees can be compared (A/B):

    python benchmarks/host_path.py                       # this tree: counts and host time per call
    python benchmarks/host_path.py --trees /tmp/old .     # A/B, interleaved runs, one line per case and tree

What is counted (``HostOpCounter``), per call of the steady state (the same cu_seqlens object as the calls
before it, as every attention layer of a training step passes):
- ``ops``: aten ops the library dispatches outside the kernels (a proxy for host work);
- ``syncs``: ops that synchronise on CUDA when their input lives on the device -- ``_local_scalar_dense``
  (``int(t)``, ``bool(t)``, ``.item()``), ``.tolist()``, ``nonzero``, ``masked_select``, ``equal``,
  ``is_nonzero``, ``unique``, boolean-mask ``index``/``index_put_``, ``repeat_interleave`` without
  ``output_size``, and device->host copies (``.to("cpu")``/``.cpu()``);
- ``h2d``: host tensors moved to the device (``.to(device)``), by kind: "blocking" (torch synchronises the
  stream after the copy), "non_blocking_pageable" (staged by the driver, which may wait), "non_blocking_pinned";
- ``collectives``: torch.distributed calls, by name, and how many of them were blocking (``async_op`` not set).
"Device" tensors are tracked by provenance: the call's inputs and everything computed from them, and buffers
written by a device op or a collective; tensors made on the host (``torch.tensor``, planning arithmetic) are host
tensors. A factory tensor (``torch.empty(..., device=...)``) read on the host before any device op wrote it
would be missed -- no code here does that; so would device ops on a tensor after its own ``.cpu()`` (on a CPU
run the copy is the same object, and it counts as a host tensor from then on). The "cpu" spelling of a
device->host copy is matched literally (``.to("cpu")``, ``.cpu()``): on a CPU run ``q.device`` is "cpu" too and
cannot tell.

Times: wall time per call with stub kernels (zeros of the right shapes), gloo world of ``--world`` processes,
one query and one K/V head of dim 8 (the tensor work the stubs leave -- merges, copies, gloo transfers -- stays
small; the host planning depends on the documents and the ranks, not on the heads);
median and best of ``--calls`` calls after 3 warm-up calls. On CUDA the kernels run asynchronously, so this is
the host's share of a call; the stub kernels' own ops are excluded from the counts but not from the times.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakTensorKeyDictionary

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(_HERE)

aten = torch.ops.aten
_SYNC_OPS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
             aten.equal.default, aten.is_nonzero.default, aten._unique2.default, aten.unique_consecutive.default,
             aten.unique_dim.default}
# isend/irecv are not wrapped: P2POp checks their identity; batch_isend_irecv counts its ops ("p2p_ops").
_COLLECTIVES = ("batch_isend_irecv", "send", "recv", "all_gather", "all_gather_into_tensor",
                "reduce_scatter_tensor", "reduce_scatter", "all_reduce", "broadcast", "barrier", "all_gather_object",
                "all_to_all_single")
VARIANTS = ("llama3", "ring_varlen", "zigzag_varlen")


def _tensors(tree):
    """The tensors in nested tuples/lists/dicts of op arguments or results (a light ``tree_flatten``)."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        tree = tree.values()
    elif not isinstance(tree, (tuple, list)):
        return []
    return [t for item in tree for t in _tensors(item)]


class HostOpCounter(TorchDispatchMode):
    """Counts what the code run inside it dispatches (see the module docstring). ``device(*tensors)`` seeds the
    device-resident set; ``paused()`` excludes a stretch (a stub kernel) from the counts, not from tracking."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Nothing here is compiled: without this, torch wraps __torch_dispatch__ in a dynamo-disable whose first
        # call imports torch._dynamo (seconds; the test that uses this counter must stay fast).
        return False

    def __init__(self, llama3_module=None):
        super().__init__()
        self.ops: Counter = Counter()
        self.syncs: Counter = Counter()
        self.h2d: Counter = Counter()
        self.collectives: Counter = Counter()
        self.blocking: Counter = Counter()
        self._device = WeakTensorKeyDictionary()      # device-resident tensors (by object, not address)
        self._paused = 0
        self._llama3 = llama3_module
        self._saved: List = []

    # ------------------------------------------------------------------ provenance
    def device(self, *tensors) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._device[t] = True

    def host(self, t) -> None:
        if isinstance(t, torch.Tensor) and t in self._device:
            del self._device[t]

    def on_device(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t in self._device

    @contextlib.contextmanager
    def paused(self):
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def reset(self) -> None:
        for c in (self.ops, self.syncs, self.h2d, self.collectives, self.blocking):
            c.clear()

    def summary(self) -> Dict[str, object]:
        return {"ops": sum(self.ops.values()), "syncs": dict(self.syncs), "h2d": dict(self.h2d),
                "collectives": dict(self.collectives), "blocking_collectives": dict(self.blocking)}

    # ------------------------------------------------------------------ dispatch
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._paused:                              # inside a kernel: what it returns lives on the device
            out = func(*args, **kwargs)
            self.device(*_tensors(out))
            return out
        on_dev = any(self.on_device(t) for t in _tensors((args, kwargs)))
        self.ops[str(func.overloadpacket.__name__)] += 1
        if on_dev and self._syncs(func, args, kwargs):
            self.syncs[str(func.overloadpacket.__name__)] += 1
        out = func(*args, **kwargs)
        if on_dev:
            self.device(*_tensors(out))
            if func._schema.is_mutable:
                for arg, value in zip(func._schema.arguments, args):
                    if arg.alias_info is not None and arg.alias_info.is_write:
                        self.device(value)
        return out

    @staticmethod
    def _syncs(func, args, kwargs) -> bool:
        if func in _SYNC_OPS:
            return True
        if func is aten.repeat_interleave.Tensor:
            return kwargs.get("output_size") is None
        if func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default):
            indices = args[1] if len(args) > 1 else ()
            return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)
        return False

    # ------------------------------------------------------------------ python-level hooks
    def __enter__(self):
        counter = self
        to, cpu, tolist = torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.tolist

        def hooked_to(t, *args, **kwargs):
            target = kwargs.get("device")
            for a in args:
                if isinstance(a, (str, torch.device)):
                    target = a
            result = to(t, *args, **kwargs)
            if target is not None and not counter._paused:
                if counter.on_device(t) and isinstance(target, str) and target.startswith("cpu"):
                    counter.syncs["to_cpu"] += 1
                    counter.host(result)              # the host copy (on a CPU run: the same object)
                elif not counter.on_device(t) and not (isinstance(target, str) and target.startswith("cpu")):
                    pinned = t.is_pinned() if t.device.type == "cpu" else False
                    # torch syncs the stream after a copy that is not non_blocking; from pageable memory a
                    # non_blocking copy is staged by the driver (it may wait); only pinned + non_blocking is free.
                    kind = "blocking" if not kwargs.get("non_blocking") else \
                        ("non_blocking_pinned" if pinned else "non_blocking_pageable")
                    counter.h2d[kind] += 1
                    counter.device(result)
            return result

        def hooked_cpu(t, *args, **kwargs):
            if counter.on_device(t) and not counter._paused:
                counter.syncs["cpu"] += 1
            result = cpu(t, *args, **kwargs)
            counter.host(result)                      # the host copy (on a CPU run: the same object)
            return result

        def hooked_tolist(t):
            if counter.on_device(t) and not counter._paused:
                counter.syncs["tolist"] += 1
            return tolist(t)

        self._saved = [(torch.Tensor, "to", to), (torch.Tensor, "cpu", cpu), (torch.Tensor, "tolist", tolist)]
        torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.tolist = hooked_to, hooked_cpu, hooked_tolist
        for name in _COLLECTIVES:
            self._hook_collective(dist, name, name)
        if self._llama3 is not None:
            self._hook_collective(self._llama3, "all_to_all_single", "all_to_all_single")
        return super().__enter__()

    def _hook_collective(self, module, name: str, label: str) -> None:
        original = getattr(module, name, None)
        if original is None:
            return
        counter = self

        def hooked(*args, **kwargs):
            if not counter._paused:
                counter.collectives[label] += 1
                if label == "batch_isend_irecv":
                    counter.collectives["p2p_ops"] += len(args[0])
                elif not kwargs.get("async_op", False):
                    counter.blocking[label] += 1
            result = original(*args, **kwargs)
            flat = tree_flatten((args, kwargs))[0]
            for item in flat:                          # P2P ops carry their tensors inside P2POp objects
                tensor = getattr(item, "tensor", item)
                counter.device(tensor)
            return result

        self._saved.append((module, name, original))
        setattr(module, name, hooked)

    def __exit__(self, *exc):
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved = []
        return super().__exit__(*exc)


# ------------------------------------------------------------------------------------------ stub kernels


class StubBlocks:
    """A block backend whose kernels return zeros of the right shapes (the counter pauses inside it)."""

    name = "stub_blocks"

    def __init__(self, counter: Optional[HostOpCounter] = None):
        self.counter, self.calls = counter, 0

    def _quiet(self):
        return self.counter.paused() if self.counter is not None else contextlib.nullcontext()

    def unsupported_reason(self, **query):
        return None

    def forward(self, q, k, v, *, scale, mask, softcap=0.0):
        self.calls += 1
        with self._quiet():
            b, s, h, _ = q.shape
            out, lse = torch.zeros_like(q), torch.zeros(b, h, s, dtype=torch.float32, device=q.device)
            return out + 0 * q.sum(), lse + 0 * k.sum()     # outputs depend on the inputs (provenance)

    def backward(self, dout, q, k, v, out, lse, *, scale, mask, softcap=0.0):
        self.calls += 1
        with self._quiet():
            return dout.mul(0).add_(q.mul(0)), k.mul(0), v.mul(0)


class StubVarlen(StubBlocks):
    """The varlen kernel (``torch_cuda_varlen`` contract: q (Tq, H, D) -> out (Tq, H, D), lse (H, Tq))."""

    name = "stub_varlen"

    def forward(self, q, k, v, seg, *, scale):
        self.calls += 1
        with self._quiet():
            return q.mul(0), torch.zeros(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device) + 0 * k.sum()

    def backward(self, dout, q, k, v, out, lse, seg, *, scale):
        self.calls += 1
        with self._quiet():
            return dout.mul(0), k.mul(0), v.mul(0)


def install_stubs(counter: Optional[HostOpCounter], fast_path: bool):
    """Every varlen entry point of ``ring_kernels`` uses the stub block backend and, with ``fast_path``, the
    stub varlen kernel (as ``varlen_kernel_for`` returns on CUDA for backend "torch_flash"). Returns an undo."""
    import ring_kernels.llama3 as llama3
    import ring_kernels.varlen as varlen

    blocks, kernel = StubBlocks(counter), StubVarlen(counter)
    saved = [(m, n, getattr(m, n)) for m in (llama3, varlen) for n in ("get_backend", "varlen_kernel_for")]
    for module in (llama3, varlen):
        module.get_backend = lambda *a, **k: blocks
        module.varlen_kernel_for = (lambda *a, **k: kernel) if fast_path else (lambda *a, **k: None)

    def undo():
        for module, name, value in saved:
            setattr(module, name, value)
    return undo


# ------------------------------------------------------------------------------------------------- runs


def _functions():
    import ring_kernels as rk
    return {"llama3": rk.llama3_attn_varlen_func, "ring_varlen": rk.ring_attn_varlen_func,
            "zigzag_varlen": rk.zigzag_ring_attn_varlen_func}


def _documents(tokens: int, world: int) -> List[int]:
    sys.path.insert(0, _HERE)
    from _cases import global_document_mix, local_document_mix
    return global_document_mix(local_document_mix(tokens, world), world)


def _inputs(variant: str, docs: List[int], group, heads=(4, 2), head_dim=16, dtype=torch.bfloat16):
    from ring_kernels import shard
    cu = torch.zeros(len(docs) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(docs, dtype=torch.int64), 0).to(torch.int32)
    gen = torch.Generator().manual_seed(3)
    total = int(cu[-1])
    h, hk = heads
    tensors = [torch.randn(total, n, head_dim, generator=gen).to(dtype) for n in (h, hk, hk, h)]
    layout = "zigzag" if variant == "zigzag_varlen" else "contiguous"
    return cu, [shard(t, group, layout=layout, dim=0, cu_seqlens=cu).contiguous() for t in tensors]


def _call(fn, cu, tensors, group, causal: bool, mode: str):
    q, k, v, dout = tensors
    if mode == "fwd":
        with torch.no_grad():
            return fn(q, k, v, cu, group=group, causal=causal, backend="torch_flash")
    leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]
    out = fn(*leaves, cu, group=group, causal=causal, backend="torch_flash")
    return torch.autograd.grad(out, leaves, dout)


def cases():
    for variant in VARIANTS:
        for causal in ((True,) if variant == "zigzag_varlen" else (True, False)):
            for mode in ("fwd", "fwd_bwd"):
                yield variant, causal, mode


def _skip_rank_check() -> None:
    """ring_kernels' per-call cross-rank check off in this process (``tree`` may predate the options object)."""
    try:
        from ring_kernels import set_options
    except ImportError:                               # an older tree: the environment is its only switch
        os.environ["RING_KERNELS_SKIP_RANK_CHECK"] = "1"
    else:
        set_options(skip_rank_check=True)


def measure_rank(group, rank: int, world: int, tokens: int, calls: int, fast_path: bool = True,
                 heads=(1, 1), head_dim: int = 8) -> List[dict]:
    """Every case on this rank: the counts of one steady-state call, then the times of ``calls`` calls."""
    import ring_kernels.llama3 as llama3

    _skip_rank_check()                                  # as the benchmark times (--skip-rank-check)
    docs, fns, rows = _documents(tokens, world), _functions(), []
    for variant, causal, mode in cases():
        cu, tensors = _inputs(variant, docs, group, heads, head_dim)
        counter = HostOpCounter(llama3)
        undo = install_stubs(counter, fast_path)
        try:
            for _ in range(3):
                _call(fns[variant], cu, tensors, group, causal, mode)
            counter.device(cu, *tensors)
            with counter:
                _call(fns[variant], cu, tensors, group, causal, mode)
            counts = counter.summary()
            undo()
            undo = install_stubs(None, fast_path)
            times = []
            for _ in range(calls):
                start = time.perf_counter()
                _call(fns[variant], cu, tensors, group, causal, mode)
                times.append((time.perf_counter() - start) * 1e3)
        finally:
            undo()
        rows.append({"variant": variant, "causal": causal, "mode": mode, "rank": rank, **counts,
                     "median_ms": statistics.median(times), "best_ms": min(times)})
    return rows


def _worker(rank: int, world: int, init: str, tree: str, tokens: int, calls: int, out: str) -> None:
    sys.path.insert(0, tree)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        import ring_kernels
        assert os.path.realpath(os.path.dirname(os.path.dirname(ring_kernels.__file__))) == os.path.realpath(tree), \
            (ring_kernels.__file__, tree)
        rows = measure_rank(dist.group.WORLD, rank, world, tokens, calls)
        gathered = [None] * world
        dist.all_gather_object(gathered, rows)
        if rank == 0:
            with open(out, "w") as f:
                json.dump([r for part in gathered for r in part], f)
    finally:
        dist.destroy_process_group()


def run_tree(tree: str, world: int, tokens: int, calls: int) -> List[dict]:
    """One world of ``world`` gloo processes importing ``ring_kernels`` from ``tree``; rows of every rank."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        code = ("import sys; sys.path.insert(0, {here!r}); import host_path; "
                "import torch.multiprocessing as mp; "
                "mp.spawn(host_path._worker, args=({world}, 'file://{tmp}/store', {tree!r}, {tokens}, {calls}, "
                "{out!r}), nprocs={world})").format(here=_HERE, world=world, tmp=tmp, tree=os.path.abspath(tree),
                                                    tokens=tokens, calls=calls, out=out)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env["PYTHONPATH"] = os.path.abspath(tree)
        subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=tmp)
        with open(out) as f:
            return json.load(f)


def _key(row) -> tuple:
    return row["variant"], row["causal"], row["mode"]


def _fmt_counts(row) -> str:
    syncs = sum(row["syncs"].values())
    h2d = sum(row["h2d"].values())
    coll = ",".join(f"{k}x{v}" for k, v in sorted(row["collectives"].items())) or "-"
    return f"ops {row['ops']:4d} syncs {syncs:3d} h2d {h2d:3d} coll {coll}"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trees", nargs="+", default=[_REPO], help="source trees to compare (interleaved runs)")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--tokens", type=int, default=8192, help="tokens per rank (the benchmark's document mix)")
    p.add_argument("--calls", type=int, default=30, help="timed calls per case and run")
    p.add_argument("--rounds", type=int, default=1, help="runs per tree, interleaved A B A B ...")
    p.add_argument("--json", help="write every row here")
    args = p.parse_args(argv)
    results: Dict[str, List[List[dict]]] = {tree: [] for tree in args.trees}
    for _ in range(args.rounds):
        for tree in args.trees:
            results[tree].append(run_tree(tree, args.world, args.tokens, args.calls))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print(f"world {args.world}, {args.tokens} tokens/rank, {args.calls} calls x {args.rounds} round(s) per tree; "
          f"counts of one steady-state call on rank 0, times in ms (rank 0: median of round medians, best)")
    first = results[args.trees[0]][0]
    for row0 in (r for r in first if r["rank"] == 0):
        for tree in args.trees:
            rows = [r for run in results[tree] for r in run if r["rank"] == 0 and _key(r) == _key(row0)]
            med = statistics.median(r["median_ms"] for r in rows)
            best = min(r["best_ms"] for r in rows)
            print(f"{row0['variant']:14s} {'causal' if row0['causal'] else 'full':6s} {row0['mode']:8s} "
                  f"{os.path.basename(os.path.abspath(tree)):6s} {_fmt_counts(rows[0])}  {med:7.3f} {best:7.3f}"
                  f"  syncs={rows[0]['syncs']} h2d={rows[0]['h2d']}")


if __name__ == "__main__":
    main()
