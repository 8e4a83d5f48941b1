"""hfpatch's own per-call overhead on CPU: a patched ``_flash_attention_forward`` call against calling the ring
kernel directly with the arguments hfpatch passes it (issue 8, item 5; target <= 2 us added per call).

Run: ``python benchmarks/patched_call_overhead.py [--number N] [--repeat R] [--out FILE]``. Not a test (timings
vary with the machine and its load); ``tests/test_call_overhead.py`` runs it at tiny counts so it cannot rot.

What is compared, in one process and one run (a gloo world of one rank, in-process store):

1. The installed release, through the real patched function, called the way transformers' integration
   (``integrations/flash_attention.py``) calls it: 4 positional arguments, then ``query_length``, ``is_causal``,
   ``dropout=0.0``, ``softmax_scale``, ``sliding_window=None``, ``softcap=None`` and the rest that release passes,
   from a function whose local ``module`` is the attention module (where hfpatch finds the calling layer).
   Steps: ``batch`` (position ids 0..S-1, B=1) and ``packed`` (position ids restarting: three documents).
   Kernels: the real ring kernel, and a trivial function that returns its first argument, swapped into
   ``ring_kernels`` for BOTH paths, so that "added" is hfpatch's Python overhead, not kernel noise.
   The direct path calls the very function hfpatch resolved with the very arguments it passed (recorded from a
   patched call first); on the packed step those are HF's (1, T, H, D) tensors themselves (the varlen kernels
   take the packed row as is) and the step's global ``cu_seqlens``.
2. Where the installed release's added time goes ("stage" rows, batch and packed steps, trivial kernel): the
   patched call with its fast path cut short after each stage -- ``_staged_fast_call`` is a copy of
   ``Dispatcher.fast_call`` and of ``semantics.fast_ring_attention``'s common case, returning the query at the
   given stage -- so each row's "added" is the cumulative cost up to that stage and the difference between two
   rows the cost of one stage. The last stage is the real fast path (the kernel call included).
3. Every registry entry (each signature generation), with a wrapper rendered for it and the same dispatcher
   path (not installed: only one release is importable): the wrapper alone (handler returns at once, against
   calling the handler with a prebuilt call dict), and the whole patched call with the trivial kernel.

Timing: CPU time of this process (``time.process_time``), best of ``repeat`` runs of ``number`` calls, the direct
and patched runs interleaved so that both see the same load. B=1, S=64, H=4, D=16, fp32.
"""
from __future__ import annotations

import argparse
import datetime
import inspect
import os
import platform
import sys
import time
import timeit
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist

__all__ = ["main", "measure"]

KERNEL_NAMES = ("ring_attn_func", "zigzag_ring_attn_func", "stripe_attn_func", "ring_attn_varlen_func",
                "zigzag_ring_attn_varlen_func", "llama3_attn_varlen_func")
SHAPE = dict(batch=1, seq=64, heads=4, head_dim=16)
PACKED_DOCS = (24, 8, 32)  # a packed row: position ids restart at each document
_REAL_KERNEL_RUN_S = 0.2  # a timed run of the real kernel (~1 ms a call on CPU) stops at about this many seconds


# --------------------------------------------------------------------------------------------- set-up


@contextmanager
def _world_of_one() -> Iterator[dist.ProcessGroup]:
    """The default process group: an in-process gloo group of one rank unless one exists already."""
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        if created:
            dist.destroy_process_group()


@contextmanager
def _installed(group) -> Iterator:
    """hfpatch installed over ``group`` the way ``hfpatch.apply`` installs it. ``apply`` itself returns an
    inactive Patch on a group of one rank (there is nothing to split), so this runs what ``apply`` runs after
    that check: match the live signature, install at every binding site, the numeric probe (``api._install``)."""
    from hfpatch import api

    match, version, _ = api._match_live_signature("raise")
    patch = api._install(group, "auto", True, None, match, version, "ring")
    try:
        yield patch
    finally:
        patch.remove()


@contextmanager
def _kernels(replacement: Optional[Callable[[str], Callable]]) -> Iterator[None]:
    """``ring_kernels``' public functions replaced by ``replacement(name)`` (None: left as they are)."""
    import ring_kernels

    saved = {name: getattr(ring_kernels, name) for name in KERNEL_NAMES}
    try:
        if replacement is not None:
            for name in KERNEL_NAMES:
                setattr(ring_kernels, name, replacement(name))
        yield
    finally:
        for name, fn in saved.items():
            setattr(ring_kernels, name, fn)


def _trivial(q, *args, **kwargs):
    """The stand-in kernel: returns its first argument (no work, the cheapest function that takes the call)."""
    return q


def _inputs(step: str):
    """q, k, v (B, S, H, D) fp32 and the position ids (B, S) of a ``batch`` or ``packed`` step."""
    g = torch.Generator().manual_seed(0)
    shape = (SHAPE["batch"], SHAPE["seq"], SHAPE["heads"], SHAPE["head_dim"])
    q, k, v = (torch.randn(shape, generator=g) for _ in range(3))
    if step == "packed":
        position_ids = torch.cat([torch.arange(n) for n in PACKED_DOCS]).unsqueeze(0)
    else:
        position_ids = torch.arange(SHAPE["seq"]).unsqueeze(0)
    return q, k, v, position_ids


def _hf_call(module, q, k, v, position_ids) -> tuple:
    """(args, kwargs) of transformers' integration call ``flash_attention_forward(module, q, k, v, mask, ...)``."""
    kwargs = dict(dropout=0.0, scaling=q.shape[-1] ** -0.5, sliding_window=None, softcap=None, is_causal=True,
                  position_ids=position_ids)
    return (module, q, k, v, None), kwargs


class _AttentionModule(torch.nn.Module):
    """What transformers' integration holds as ``module``: an attention layer with a ``layer_idx``."""

    def __init__(self) -> None:
        super().__init__()
        self.layer_idx = 0


def _hf_kwargs(sig: inspect.Signature, q: torch.Tensor, position_ids: torch.Tensor) -> dict:
    """The keyword arguments transformers' integration passes, limited to what ``sig`` accepts (5.23 passes
    them all; an older release's signature has fewer, and no ``**kwargs`` before 4.48)."""
    head_dim = q.shape[-1]
    wanted = dict(query_length=q.shape[1], is_causal=True, dropout=0.0, softmax_scale=head_dim ** -0.5,
                  sliding_window=None, softcap=None, use_top_left_mask=False, target_dtype=None,
                  attn_implementation="flash_attention_2", layer_idx=0, s_aux=None, position_ids=position_ids)
    params = sig.parameters
    open_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    return {name: value for name, value in wanted.items() if name in params or open_kwargs}


# Both paths are called through a function shaped like transformers 5.23's integrations/flash_attention.py
# ``flash_attention_forward``: the same parameters and locals (hfpatch reads the calling module from this frame,
# and the cost of that grows with the frame's locals), none of its tensor work (the transposes would be the same
# in both paths). Only the line that calls the attention differs.


_INTEGRATION_KEYWORDS = ("query_length", "is_causal", "dropout", "softmax_scale", "sliding_window", "softcap",
                         "use_top_left_mask", "target_dtype", "attn_implementation", "layer_idx", "s_aux")


def _integration_like(fa: Callable, query_length: int) -> Callable:
    """A caller of the patched function ``fa`` exactly as the 5.23 integration calls ``_flash_attention_forward``.
    Where the installed release's signature does not take all of those keywords (before 5.x; the tox matrix runs
    this benchmark's test on every release), the caller passes the ones it takes, as that release's code does."""
    params = inspect.signature(fa).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    # 5.x takes every one of them (the ones it does not name land in its **kwargs): the exact 5.23 call.
    if not all(name in params or takes_any for name in _INTEGRATION_KEYWORDS):
        return _older_integration_like(fa, query_length, params, takes_any)

    def flash_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                                sliding_window=None, softcap=None, is_causal=None, s_aux=None, cache=None, **kwargs):
        seq_len = query_length
        head_dim = v_head_dim = None
        target_dtype = None
        attn_output = fa(
            query, key, value, attention_mask, query_length=seq_len, is_causal=is_causal, dropout=dropout,
            softmax_scale=scaling, sliding_window=sliding_window, softcap=softcap, use_top_left_mask=False,
            target_dtype=target_dtype, attn_implementation="flash_attention_2", layer_idx=module.layer_idx,
            s_aux=s_aux, **kwargs,
        )
        return attn_output, head_dim, v_head_dim

    return flash_attention_forward


def _older_integration_like(fa: Callable, query_length: int, params, takes_any: bool) -> Callable:
    def flash_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                                sliding_window=None, softcap=None, is_causal=None, s_aux=None, cache=None, **kwargs):
        offered = dict(query_length=query_length, is_causal=is_causal, dropout=dropout, softmax_scale=scaling,
                       sliding_window=sliding_window, softcap=softcap, use_top_left_mask=False, target_dtype=None,
                       attn_implementation="flash_attention_2", layer_idx=module.layer_idx, s_aux=s_aux, **kwargs)
        taken = {name: value for name, value in offered.items() if name in params or takes_any}
        return fa(query, key, value, attention_mask, **taken), None, None

    return flash_attention_forward


def _direct_like(kernel: Callable, args: tuple, kernel_kwargs: dict, query_length: int) -> Callable:
    """The baseline, shaped like ``_integration_like``: calls ``kernel`` with the arguments hfpatch passed it."""

    def flash_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                                sliding_window=None, softcap=None, is_causal=None, s_aux=None, cache=None, **kwargs):
        seq_len = query_length
        head_dim = v_head_dim = None
        target_dtype = None
        attn_output = kernel(*args, **kernel_kwargs)
        return attn_output, head_dim, v_head_dim

    return flash_attention_forward


def _generic_caller(module: torch.nn.Module, fa: Callable, q, k, v, kwargs: dict):
    """For the registry entries (older releases passed other keywords): ``fa(q, k, v, None, **kwargs)`` from a
    frame whose local ``module`` is the attention module."""
    return fa(q, k, v, None, **kwargs)


def _empty_body(wrapper: Callable) -> Callable:
    """A function with exactly ``wrapper``'s (the live) signature and an empty body: what binding the caller's
    arguments costs, which any replacement of ``_flash_attention_forward`` -- and the original -- pays."""
    from hfpatch import codegen

    source = codegen.wrapper_source(wrapper)
    marker = "    # generated by hfpatch.codegen"  # the first line of the body: everything before it is the header
    if marker not in source:
        raise RuntimeError(f"hfpatch.codegen's wrapper source changed (no {marker!r}); update _empty_body")
    namespace = dict(wrapper.__globals__)
    exec(compile(source[: source.index(marker)] + "    return None\n", "<empty body>", "exec"), namespace)  # noqa: S102
    return namespace[wrapper.__name__]


# -------------------------------------------------------------------------------------------- timing


def _best_pair(direct: Callable[[], object], patched: Callable[[], object], number: int,
               repeat: int) -> tuple[float, float]:
    """Best-of-``repeat`` CPU seconds per call of each, runs interleaved (direct, patched, direct, ...)."""
    timers = [timeit.Timer(fn, timer=time.process_time) for fn in (direct, patched)]
    best = [float("inf"), float("inf")]
    for _ in range(repeat):
        for i, timer in enumerate(timers):
            best[i] = min(best[i], timer.timeit(number) / number)
    return best[0], best[1]


def _calls_within(fn: Callable[[], object], number: int, seconds: float) -> int:
    """At most ``number`` calls, fewer when ``number`` calls of ``fn`` would take longer than ``seconds``."""
    fn()  # warm-up (first-call allocations, backend selection)
    per_call = timeit.Timer(fn, timer=time.process_time).timeit(3) / 3
    return max(1, min(number, int(seconds / max(per_call, 1e-9))))


def _row(entry: str, step: str, path: str, direct_s: float, patched_s: float) -> dict:
    return dict(entry=entry, step=step, path=path, direct_us=direct_s * 1e6, patched_us=patched_s * 1e6,
                added_us=(patched_s - direct_s) * 1e6, ratio=patched_s / direct_s)


def _record_kernel_call(call_once: Callable[[], object]):
    """(kernel name, args, kwargs) that one patched call (``call_once``) passes to ``ring_kernels``."""
    seen = []

    def recorder(name):
        def kernel(*args, **kw):
            seen.append((name, args, kw))
            return _trivial(*args)
        return kernel

    with _kernels(recorder):
        call_once()
    assert len(seen) == 1, f"one patched call should make one kernel call, made {seen}"
    return seen[0]


def _installed_rows(entry_id: str, fa: Callable, number: int, repeat: int) -> list[dict]:
    """Direct vs patched for the installed release: batch and packed steps, real and trivial kernels; then the
    floor: binding the live signature (an empty body)."""
    import ring_kernels

    rows = []
    module = _AttentionModule()
    for step in ("batch", "packed"):
        q, k, v, position_ids = _inputs(step)
        hf_args, hf_kwargs = _hf_call(module, q, k, v, position_ids)
        patched_caller = _integration_like(fa, q.shape[1])
        name, args, kernel_kwargs = _record_kernel_call(lambda: patched_caller(*hf_args, **hf_kwargs))
        real = getattr(ring_kernels, name)
        # The patched call computes what the kernel computes (packed: the (T, H, D) result as one row).
        want = real(*args, **kernel_kwargs)
        got = patched_caller(*hf_args, **hf_kwargs)[0]
        if not torch.equal(got.reshape(want.shape), want):
            raise AssertionError(f"{step}: the patched call differs from {name} called directly")
        for label, kernel in ((name, real), ("trivial", _trivial)):
            direct_caller = _direct_like(kernel, args, kernel_kwargs, q.shape[1])
            with _kernels(None if kernel is real else (lambda _name: _trivial)):
                direct = lambda: direct_caller(*hf_args, **hf_kwargs)  # noqa: E731
                calls = number if kernel is _trivial else _calls_within(direct, number, _REAL_KERNEL_RUN_S)
                t_direct, t_patched = _best_pair(direct, lambda: patched_caller(*hf_args, **hf_kwargs), calls, repeat)
            rows.append(_row(entry_id, step, f"kernel={label}", t_direct, t_patched))
    q, k, v, position_ids = _inputs("batch")
    hf_args, hf_kwargs = _hf_call(module, q, k, v, position_ids)
    nothing = _direct_like(lambda: None, (), {}, q.shape[1])
    empty = _integration_like(_empty_body(fa), q.shape[1])
    t_direct, t_patched = _best_pair(lambda: nothing(*hf_args, **hf_kwargs), lambda: empty(*hf_args, **hf_kwargs),
                                     number, repeat)
    rows.append(_row(entry_id, "batch", "floor: live signature, empty body", t_direct, t_patched))
    return rows


# The stages of the fast path, in order: the label of the row, and what the call has done when it stops there.
STAGES = (
    "stage 1: wrapper binds the live signature, calls fast_call",
    "stage 2: + compile check, removal, switch",
    "stage 3: + calling module (frame.f_locals)",
    "stage 4: + layer key, counting",
    "stage 5: + refusal tests (q.shape, k.shape)",
    "stage 6: + step memo",
    "stage 7: + plan lookup",
    "stage 8: + rank-check scope (ContextVar)",
    "stage 9: + kernel call (the real fast path)",
)


def _staged_fast_call(dispatcher, stop: int) -> Callable:
    """``dispatcher.fast_call`` (and ``semantics.fast_ring_attention``'s common case, stages 5-8) returning the
    query after stage ``stop`` (1-based, see ``STAGES``); ``stop == len(STAGES)`` is the real ``fast_call``.
    A copy for timing only: it assumes the common call (no refusal, a cached plan), which the caller checks."""
    import ring_kernels
    from hfpatch import dispatch, switch

    if stop == len(STAGES):
        return dispatcher.fast_call
    # Bound as the real closure binds them (cells, not attribute reads), so that each stage costs what it does there.
    ctx, local, holders, kernels = dispatcher.ctx, switch._local, dispatch._holders, vars(ring_kernels)
    is_compiling, graph_task_id, calling_module = dispatch._is_compiling, dispatch._graph_task_id, dispatch._calling_module
    thread_counts, getframe, module_type, rank_checked = dispatcher._counts, sys._getframe, torch.nn.Module, \
        ring_kernels.RANK_CHECKED

    def fast_call(q, k, v, mask, causal, dropout, scale, window, softcap, position_ids, extra):
        if stop == 1:
            return q
        if is_compiling() or dispatcher.removed:
            return None
        stack = local.stack
        if (stack[-1] if stack else switch._default_mode) != "ring" or stop == 2:
            return q
        frame = getframe(2)
        code = frame.f_code
        entry = holders.get(id(code))
        module = None
        if entry is not None and entry[0] is code and entry[1]:
            f_locals = frame.f_locals
            for name in entry[1]:
                candidate = f_locals.get(name)
                if isinstance(candidate, module_type):
                    module = candidate
                    break
        if module is None:
            module = calling_module(3)
        if stop == 3:
            return q
        layer_idx = extra.get("layer_idx") if extra else None
        if layer_idx is None and module is not None:
            layer_idx = getattr(module, "layer_idx", None)
        slot = (layer_idx, None if module is None else id(module)) if type(layer_idx) is int else \
            dispatch._slot(layer_idx, module)
        if graph_task_id() != -1:
            counts = thread_counts.recomputed
        else:
            counts = thread_counts.ring
            dispatcher._forward[slot] = "ring"
        counts[slot] = counts.get(slot, 0) + 1
        if stop == 4:
            return q
        q_shape = q.shape
        if (mask is not None or dropout or k.shape[1] != q_shape[1] or (window is not None and type(window) is not int)
                or (extra and (extra.get("s_aux") is not None or extra.get("cache") is not None
                               or extra.get("cache_seqlens") is not None))) or stop == 5:
            return q
        memo = ctx._fast_step if ctx.step is None else None
        if (memo is None or memo[0] is not position_ids or memo[2] != q_shape[0] or memo[3] != q_shape[1]
                or (position_ids is not None and memo[1] != position_ids._version)) or stop == 6:
            return q
        step = memo[4]
        plan = ctx._plans.get((causal, scale, window, softcap)) if ctx._plan_step is step else None
        kernel = kernels[plan.kernel]  # noqa: F841 -- timed: the real fast path looks its kernel up here
        if stop == 7:
            return q
        token = rank_checked.set(step.rank_checked)
        try:
            return q
        finally:
            rank_checked.reset(token)

    return fast_call


def _stage_rows(entry_id: str, fa: Callable, dispatcher, number: int, repeat: int) -> list[dict]:
    """The "stage" rows (see the module docstring): batch and packed steps, trivial kernel, each stage timed
    against the same direct call, all interleaved in one loop."""
    module = _AttentionModule()
    rows = []
    real = fa.__globals__["_hfpatch_fast"]
    if real is not dispatcher.fast_call:
        raise RuntimeError("the installed wrapper does not call this dispatcher's fast_call; update _stage_rows")
    for step in ("batch", "packed"):
        q, k, v, position_ids = _inputs(step)
        hf_args, hf_kwargs = _hf_call(module, q, k, v, position_ids)
        patched_caller = _integration_like(fa, q.shape[1])
        name, args, kernel_kwargs = _record_kernel_call(lambda: patched_caller(*hf_args, **hf_kwargs))
        if dispatcher.ctx._fast_step is None:
            raise RuntimeError("the stages assume a derived step memoised by the fast path")
        direct_caller = _direct_like(_trivial, args, kernel_kwargs, q.shape[1])
        staged = [_staged_fast_call(dispatcher, stop) for stop in range(1, len(STAGES) + 1)]

        def run(fast):
            def call():
                fa.__globals__["_hfpatch_fast"] = fast
                try:
                    return patched_caller(*hf_args, **hf_kwargs)
                finally:
                    fa.__globals__["_hfpatch_fast"] = real
            return call

        calls = [lambda: direct_caller(*hf_args, **hf_kwargs)] + [run(fast) for fast in staged]
        with _kernels(lambda _name: _trivial):
            for call in calls:
                call()
            best = _best_of(calls, number, repeat)
        rows += [_row(entry_id, step, label, best[0], t) for label, t in zip(STAGES, best[1:])]
    return rows


def _best_of(fns: list, number: int, repeat: int) -> list[float]:
    """Best-of-``repeat`` CPU seconds per call of each of ``fns``, runs interleaved."""
    timers = [timeit.Timer(fn, timer=time.process_time) for fn in fns]
    best = [float("inf")] * len(fns)
    for _ in range(repeat):
        for i, timer in enumerate(timers):
            best[i] = min(best[i], timer.timeit(number) / number)
    return best


def _entry_rows(entry, ctx, number: int, repeat: int) -> list[dict]:
    """One registry entry: the rendered wrapper alone, and the whole patched call with the trivial kernel."""
    from hfpatch import codegen
    from hfpatch.dispatch import Dispatcher
    from hfpatch.signatures.registry import match

    sig = entry.signature()
    found = match(sig)
    module = _AttentionModule()
    q, k, v, position_ids = _inputs("batch")
    kwargs = _hf_kwargs(sig, q, position_ids)

    captured = {}

    def capture(call, extra):
        captured.update(call=call, extra=extra)
        return q

    _generic_caller(module, codegen.render(found, capture), q, k, v, kwargs)
    call, extra = captured["call"], captured["extra"]

    def handler(call, extra):
        return q

    wrapper_only = codegen.render(found, handler)
    # The baseline replaces the wrapper by a function that calls the handler with the call dict built ahead.
    direct, patched = _best_pair(lambda: _generic_caller(module, lambda *a: handler(call, extra), q, k, v, {}),
                                 lambda: _generic_caller(module, wrapper_only, q, k, v, kwargs), number, repeat)
    rows = [_row(entry.id, "batch", "rendered: wrapper only", direct, patched)]
    dispatcher = Dispatcher(original=_trivial, match=found, ctx=ctx)
    whole = codegen.render(found, dispatcher)
    with _kernels(lambda _name: _trivial):
        name, args, kernel_kwargs = _record_kernel_call(lambda: _generic_caller(module, whole, q, k, v, kwargs))
        # _trivial(q, k, v, None, **kernel_kwargs): the same caller frame, the kernel's own arguments.
        assert name == "ring_attn_func" and args == (q, k, v), (name, args)
        direct, patched = _best_pair(lambda: _generic_caller(module, _trivial, q, k, v, kernel_kwargs),
                                     lambda: _generic_caller(module, whole, q, k, v, kwargs), number, repeat)
    rows.append(_row(entry.id, "batch", "rendered: kernel=trivial", direct, patched))
    return rows


def measure(*, number: int = 20_000, repeat: int = 7, entries: str = "all") -> dict:
    """Every row of the comparison (see the module docstring) and a stamp. ``entries``: "all" or "installed"."""
    import transformers.modeling_flash_attention_utils as mfau

    from hfpatch.signatures.registry import load_registry

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the real kernels' intra-op threads would add scheduling noise on a shared machine
    try:
        with _world_of_one() as group, _installed(group) as patch:
            rows = _installed_rows(patch.signature_id, mfau._flash_attention_forward, number, repeat)
            rows += _stage_rows(patch.signature_id, mfau._flash_attention_forward, patch._dispatcher, number, repeat)
            if entries == "all":
                for entry in load_registry():
                    rows += _entry_rows(entry, patch.ctx, number, repeat)
    finally:
        torch.set_num_threads(threads)
    return dict(stamp=_stamp(number, repeat), rows=rows)


def _stamp(number: int, repeat: int) -> dict:
    import importlib.metadata

    return dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                python=platform.python_version(), torch=torch.__version__,
                transformers=importlib.metadata.version("transformers"), machine=platform.machine(),
                cpus=os.cpu_count(), load_average=tuple(round(x, 2) for x in os.getloadavg()),
                number=number, repeat=repeat, shape=dict(SHAPE), packed_docs=PACKED_DOCS)


def render(result: dict) -> str:
    """The result as a plain-text table with its stamp."""
    st = result["stamp"]
    lines = [
        "hfpatch per-call overhead on CPU (benchmarks/patched_call_overhead.py)",
        f"date {st['date']}  python {st['python']}  torch {st['torch']}  transformers {st['transformers']}  "
        f"{st['machine']} x{st['cpus']}  load average {st['load_average']}",
        f"best of {st['repeat']} x {st['number']} calls, CPU time (process_time); B={st['shape']['batch']} "
        f"S={st['shape']['seq']} H={st['shape']['heads']} D={st['shape']['head_dim']} fp32; packed documents "
        f"{st['packed_docs']}",
        "",
        f"{'entry':<12} {'step':<7} {'path':<58} {'direct us':>10} {'patched us':>11} {'added us':>9} {'ratio':>7}",
    ]
    for r in result["rows"]:
        lines.append(f"{r['entry']:<12} {r['step']:<7} {r['path']:<58} {r['direct_us']:>10.2f} "
                     f"{r['patched_us']:>11.2f} {r['added_us']:>9.2f} {r['ratio']:>7.2f}")
    return "\n".join(lines) + "\n"


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--number", type=int, default=20_000, help="calls per timed run")
    parser.add_argument("--repeat", type=int, default=7, help="timed runs per path (best is kept)")
    parser.add_argument("--entries", choices=("all", "installed"), default="all")
    parser.add_argument("--out", help="also write the table to this file")
    args = parser.parse_args(argv)
    if args.number < 1 or args.repeat < 1:
        parser.error(f"--number={args.number} and --repeat={args.repeat} must be >= 1")
    text = render(measure(number=args.number, repeat=args.repeat, entries=args.entries))
    print(text, end="")
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
