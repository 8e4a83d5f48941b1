"""hfpatch's own time per patched ``_flash_attention_forward`` call on CPU, side by side with calling the ring kernel
directly, in one run (target: <= 2 us added per call).

Run: ``python benchmarks/patched_call_overhead.py [--number N] [--repeat R] [--layers L] [--out FILE]``. Not a test
(timings vary with the machine and its load); ``tests/attention/test_call_overhead.py`` runs it at tiny counts so
that it cannot rot, and guards the budget with a ratio measured the same way.

What is timed -- the real path, through public seams only:

- hfpatch is installed the way ``hfpatch.apply`` installs it (``apply`` itself returns an inactive Patch on a group
  of one rank, so this runs its install step, ``api._install``, over an in-process gloo world of one rank).
- A model of ``L`` attention layers (``_Model``; each an ``nn.Module`` with a ``layer_idx``) whose forward calls,
  for each layer, a function shaped like transformers 5.23's ``integrations/flash_attention.flash_attention_forward``
  (same parameters and locals) that calls ``_flash_attention_forward`` exactly as that release does. One forward is
  ``L`` patched calls; the time per call is the forward's time / ``L``.
- The baseline is the same model whose integration function calls the kernel hfpatch resolved, with the arguments
  hfpatch passed it (recorded from a patched call first) -- on the packed step HF's (1, T, H, D) tensors and the
  step's global ``cu_seqlens``.
- Paths: ``model=`` (the model tracked by ``Patch.track``, as ``apply(model=)`` does: the layer is known from its
  bound call site) and ``stack`` (an untracked model: the layer is found on the stack); steps ``batch`` (position
  ids 0..S-1) and ``packed`` (three documents); kernels: the real one, and a trivial function returning its first
  argument swapped into hfpatch's kernel table (``hfpatch.attention.plan.KERNELS``) for BOTH sides, so that
  "added" is hfpatch's Python, not kernel noise.
- ``floor``: a function with the live signature and an empty body, against calling nothing: what binding the
  caller's arguments costs (any replacement of ``_flash_attention_forward``, and the original, pays it).

Timing: CPU time of this process (``time.process_time``) of ``number`` forwards, ``repeat`` times, the direct and
patched runs interleaved so that both see the same load; min and median per call. B=1, S=64, H=4, D=16, fp32.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist

__all__ = ["main", "measure", "render"]

KERNEL_NAMES = ("ring_attn_func", "zigzag_ring_attn_func", "stripe_attn_func", "ring_attn_varlen_func",
                "zigzag_ring_attn_varlen_func", "llama3_attn_varlen_func")
SHAPE = dict(batch=1, seq=64, heads=4, head_dim=16)
PACKED_DOCS = (24, 8, 32)  # a packed row: position ids restart at each document
_REAL_KERNEL_RUN_S = 0.05  # a timed run of real kernels (~0.1-0.3 ms a call on CPU) stops at about this many seconds


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
    """hfpatch installed over ``group`` by ``apply``'s install step (match the live signature, install at every
    binding site, the numeric probe)."""
    from hfpatch import api

    match, version, _ = api._match_live_signature("raise")
    patch = api._install(group, "auto", True, None, match, version, "ring")
    try:
        yield patch
    finally:
        patch.remove()


@contextmanager
def _kernels(replacement: Optional[Callable[[str], Callable]]) -> Iterator[None]:
    """The kernels of hfpatch's kernel table (``hfpatch.attention.plan.KERNELS``) replaced by ``replacement(name)``
    (None: left as they are)."""
    from hfpatch.attention.plan import KERNELS

    saved = {name: KERNELS[name] for name in KERNEL_NAMES}
    try:
        if replacement is not None:
            for name in KERNEL_NAMES:
                KERNELS[name] = replacement(name)
        yield
    finally:
        KERNELS.update(saved)


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


# The integration function of transformers 5.23 (integrations/flash_attention.py), minus its tensor work (the same
# in both paths): its parameters, its locals, and its call. Older releases take fewer keywords: the call passes those
# the installed signature takes, as that release's code does.
_INTEGRATION_KEYWORDS = ("query_length", "is_causal", "dropout", "softmax_scale", "sliding_window", "softcap",
                         "use_top_left_mask", "target_dtype", "attn_implementation", "layer_idx", "s_aux")


def _integration_like(fa: Callable) -> Callable:
    import inspect

    params = inspect.signature(fa).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    if all(name in params or takes_any for name in _INTEGRATION_KEYWORDS):
        def flash_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                                    sliding_window=None, softcap=None, is_causal=None, s_aux=None, **kwargs):
            seq_len = query.shape[1]
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

    def older_flash_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                                      sliding_window=None, softcap=None, is_causal=None, s_aux=None, **kwargs):
        offered = dict(query_length=query.shape[1], is_causal=is_causal, dropout=dropout, softmax_scale=scaling,
                       sliding_window=sliding_window, softcap=softcap, use_top_left_mask=False, target_dtype=None,
                       attn_implementation="flash_attention_2", layer_idx=module.layer_idx, s_aux=s_aux, **kwargs)
        taken = {name: value for name, value in offered.items() if name in params or takes_any}
        return fa(query, key, value, attention_mask, **taken), None, None

    return older_flash_attention_forward


def _direct_like(kernel: Callable, args: tuple, kernel_kwargs: dict) -> Callable:
    """The baseline, shaped like ``_integration_like``: calls ``kernel`` with the arguments hfpatch passed it."""

    def flash_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                                sliding_window=None, softcap=None, is_causal=None, s_aux=None, **kwargs):
        seq_len = query.shape[1]
        head_dim = v_head_dim = None
        target_dtype = None
        attn_output = kernel(*args, **kernel_kwargs)
        return attn_output, head_dim, v_head_dim

    return flash_attention_forward


class _Attention(torch.nn.Module):
    """An attention layer as transformers' integration sees it: a module with a ``layer_idx``."""

    def __init__(self, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx


class _Model(torch.nn.Module):
    """``layers`` attention layers; its forward calls ``attention(layer, q, k, v, None, **kwargs)`` once per layer."""

    def __init__(self, layers: int, attention: Callable) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_Attention(i) for i in range(layers))
        self.attention = attention

    def forward(self, q, k, v, position_ids):
        out = None
        attention = self.attention
        for layer in self.layers:
            out = attention(layer, q, k, v, None, dropout=0.0, scaling=q.shape[-1] ** -0.5, sliding_window=None,
                            softcap=None, is_causal=True, position_ids=position_ids)[0]
        return out


def _empty_body(wrapper: Callable) -> Callable:
    """A function with exactly ``wrapper``'s (the live) signature and an empty body."""
    from hfpatch.attention import codegen

    source = codegen.wrapper_source(wrapper)
    marker = "    # generated by hfpatch.attention.codegen"  # the first line of the body: everything before it is the header
    if marker not in source:
        raise RuntimeError(f"hfpatch.attention.codegen's wrapper source changed (no {marker!r}); update _empty_body")
    namespace = dict(wrapper.__globals__)
    exec(compile(source[: source.index(marker)] + "    return None\n", "<empty body>", "exec"), namespace)  # noqa: S102
    return namespace[wrapper.__name__]


# -------------------------------------------------------------------------------------------- timing


def _times(fns: list, number: int, repeat: int) -> list[list[float]]:
    """CPU seconds per call of each of ``fns``: ``repeat`` samples of ``number`` calls each, runs interleaved."""
    samples: list[list[float]] = [[] for _ in fns]
    clock = time.process_time
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            start = clock()
            for _ in range(number):
                fn()
            samples[i].append((clock() - start) / number)
    return samples


def _row(path: str, step: str, kernel: str, direct: list[float], patched: list[float], calls: int) -> dict:
    """Per-call microseconds (``calls`` attention calls per timed function call): min and median of each side,
    and hfpatch's added time (patched - direct) at both."""
    dmin, dmed = min(direct) / calls * 1e6, statistics.median(direct) / calls * 1e6
    pmin, pmed = min(patched) / calls * 1e6, statistics.median(patched) / calls * 1e6
    return dict(path=path, step=step, kernel=kernel, direct_min_us=dmin, direct_median_us=dmed, patched_min_us=pmin,
                patched_median_us=pmed, added_min_us=pmin - dmin, added_median_us=pmed - dmed, ratio=pmin / dmin)


def _record_kernel_call(call_once: Callable[[], object]):
    """(kernel name, args, kwargs) of the one kernel call ``call_once`` (one patched call) makes."""
    seen = []

    def recorder(name):
        def kernel(*args, **kw):
            seen.append((name, args, kw))
            return _trivial(*args)
        return kernel

    with _kernels(recorder):
        call_once()
    if len(seen) != 1:
        raise AssertionError(f"one patched call should make one kernel call, made {len(seen)}")
    return seen[0]


def _rows(patch, fa: Callable, number: int, repeat: int, layers: int) -> list[dict]:
    """Every "model=" and "stack" row, batch and packed, real and trivial kernel; then the floor."""
    import ring_kernels

    rows = []
    integration = _integration_like(fa)
    tracked, untracked = _Model(layers, integration), _Model(layers, integration)
    patch.track(tracked)  # what apply(model=) does for its model
    for step in ("batch", "packed"):
        q, k, v, position_ids = _inputs(step)
        probe = _Model(1, integration)
        name, args, kernel_kwargs = _record_kernel_call(lambda: probe(q, k, v, position_ids))
        real = getattr(ring_kernels, name)
        want = real(*args, **kernel_kwargs)
        got = tracked(q, k, v, position_ids)
        if not torch.equal(got.reshape(want.shape), want):
            raise AssertionError(f"{step}: the patched call differs from {name} called directly")
        for label, kernel in ((name, real), ("trivial", _trivial)):
            direct = _Model(layers, _direct_like(kernel, args, kernel_kwargs))
            with _kernels(None if kernel is real else (lambda _name: _trivial)):
                fns = [lambda: direct(q, k, v, position_ids), lambda: tracked(q, k, v, position_ids),
                       lambda: untracked(q, k, v, position_ids)]
                for fn in fns:
                    fn()  # warm-up: the first call of each site builds its plan
                runs = number
                if kernel is real:
                    start = time.process_time()
                    fns[0]()
                    runs = max(1, min(number, int(_REAL_KERNEL_RUN_S / max(time.process_time() - start, 1e-9))))
                t_direct, t_tracked, t_stack = _times(fns, runs, repeat)
            rows.append(_row("model=", step, label, t_direct, t_tracked, layers))
            rows.append(_row("stack", step, label, t_direct, t_stack, layers))
    q, k, v, position_ids = _inputs("batch")
    nothing = _Model(layers, _direct_like(lambda: None, (), {}))
    empty = _Model(layers, _integration_like(_empty_body(fa)))
    t_direct, t_empty = _times([lambda: nothing(q, k, v, position_ids), lambda: empty(q, k, v, position_ids)],
                               number, repeat)
    rows.append(_row("floor", "batch", "live signature, empty body", t_direct, t_empty, layers))
    return rows


def measure(*, number: int = 2000, repeat: int = 15, layers: int = 16) -> dict:
    """Every row (see the module docstring) and a stamp."""
    import transformers.modeling_flash_attention_utils as mfau

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the real kernels' intra-op threads would add scheduling noise on a shared machine
    load_before = os.getloadavg()
    try:
        with _world_of_one() as group, _installed(group) as patch:
            rows = _rows(patch, mfau._flash_attention_forward, number, repeat, layers)
            signature_id = patch.signature_id
    finally:
        torch.set_num_threads(threads)
    return dict(stamp=_stamp(number, repeat, layers, signature_id, load_before), rows=rows)


def _stamp(number: int, repeat: int, layers: int, signature_id: str, load_before) -> dict:
    import importlib.metadata

    return dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                python=platform.python_version(), torch=torch.__version__,
                transformers=importlib.metadata.version("transformers"), signature=signature_id,
                machine=platform.machine(), cpus=os.cpu_count(),
                load_before=tuple(round(x, 2) for x in load_before),
                load_after=tuple(round(x, 2) for x in os.getloadavg()),
                number=number, repeat=repeat, layers=layers, shape=dict(SHAPE), packed_docs=PACKED_DOCS)


def render(result: dict) -> str:
    """The result as a plain-text table with its stamp."""
    st = result["stamp"]
    lines = [
        "hfpatch per-call overhead on CPU (benchmarks/patched_call_overhead.py)",
        f"date {st['date']}  python {st['python']}  torch {st['torch']}  transformers {st['transformers']} "
        f"({st['signature']})  {st['machine']} x{st['cpus']}  load average before {st['load_before']} "
        f"after {st['load_after']}",
        f"{st['repeat']} samples x {st['number']} forwards of {st['layers']} attention calls, CPU time per call "
        f"(process_time), min and median; B={st['shape']['batch']} S={st['shape']['seq']} H={st['shape']['heads']} "
        f"D={st['shape']['head_dim']} fp32; packed documents {st['packed_docs']}",
        "",
        f"{'path':<7} {'step':<7} {'kernel':<27} {'direct us':>16} {'patched us':>16} {'added us':>16} {'ratio':>6}",
        f"{'':<43} {'min':>7} {'median':>8} {'min':>7} {'median':>8} {'min':>7} {'median':>8}",
    ]
    for r in result["rows"]:
        lines.append(f"{r['path']:<7} {r['step']:<7} {r['kernel']:<27} {r['direct_min_us']:>7.2f} "
                     f"{r['direct_median_us']:>8.2f} {r['patched_min_us']:>7.2f} {r['patched_median_us']:>8.2f} "
                     f"{r['added_min_us']:>7.2f} {r['added_median_us']:>8.2f} {r['ratio']:>6.2f}")
    return "\n".join(lines) + "\n"


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--number", type=int, default=2000, help="forwards per timed sample")
    parser.add_argument("--repeat", type=int, default=15, help="timed samples per path")
    parser.add_argument("--layers", type=int, default=16, help="attention calls per forward")
    parser.add_argument("--out", help="also write the table to this file")
    args = parser.parse_args(argv)
    if args.number < 1 or args.repeat < 1 or args.layers < 1:
        parser.error(f"--number={args.number}, --repeat={args.repeat} and --layers={args.layers} must be >= 1")
    text = render(measure(number=args.number, repeat=args.repeat, layers=args.layers))
    print(text, end="")
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
