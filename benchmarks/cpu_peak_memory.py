"""Peak memory of one ring forward + backward on CPU, in units of the local k + v, next to single-process attention.

The GPU benchmark (``ring_bench.py``) measures peak memory with CUDA's allocator statistics; this script gives the
same kind of number on a CPU machine, where code changes to the engine's buffers can be checked without a GPU:
the torch profiler's allocator events (every allocation and free, in order) summed into a running total whose
maximum is the peak above what was alive before the call. It is not the GPU number (another backend, another
allocator), but a buffer the engine stops holding shows up in it one for one.

Run: ``torchrun --nproc-per-node 2 benchmarks/cpu_peak_memory.py [--tokens 2048] [--out FILE]`` (gloo, bf16,
16 query heads, 4 K/V heads, head dim 64, torch_cpu backend). Prints one line per case on rank 0 (and writes them
to ``--out``): the single-process row is ``scaled_dot_product_attention`` forward + backward on one rank's shard.
The forward and backward peaks are apart because on CPU the forward's peak is the eager LSE merge's fp32
temporaries (on CUDA a fused Triton kernel), which would hide every change to the backward's buffers.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)

import ring_kernels as rk  # noqa: E402

__all__ = ["peak_bytes", "main"]

CASES = (("zigzag", True), ("ring", False), ("ring", True), ("stripe", True))
_FUNCS = {"zigzag": rk.zigzag_ring_attn_func, "ring": rk.ring_attn_func, "stripe": rk.stripe_attn_func}


def peak_bytes(forward, backward) -> tuple:
    """(forward peak, backward peak): the running allocated total's maximum during ``forward()`` and during
    ``backward(forward())`` (bytes, this process), both above the total at the forward's start, so the backward's
    includes what the forward left alive for it. One unprofiled call first: one-time allocations do not count."""
    backward(forward())
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function("forward"):
            out = forward()
        with record_function("backward"):
            backward(out)
            del out
    events = list(prof.profiler.kineto_results.events())
    split = next(e.start_ns() for e in events if e.name() == "backward")
    memory = sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns())
    total, peaks = 0, [0, 0]
    for e in memory:
        total += e.nbytes()
        phase = int(e.start_ns() >= split)
        peaks[phase] = max(peaks[phase], total)
    return tuple(peaks)


def main(argv=None) -> list:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    p.add_argument("--out", default=None, help="also write the lines to this file (rank 0)")
    args = p.parse_args(argv)
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(rank)
    s, h, hk, d = args.tokens, 16, 4, 64
    q, k, v, dout = (torch.randn(1, s, n, d, generator=gen).bfloat16() for n in (h, hk, hk, h))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    unit = 2 * k.numel() * k.element_size()

    def single(causal):
        def forward():
            return torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal, enable_gqa=True)
        return forward, lambda out: out.backward(dout.transpose(1, 2))

    def ring(variant, causal):
        return (lambda: _FUNCS[variant](q, k, v, causal=causal, backend="torch_cpu"),
                lambda out: out.backward(dout))

    lines = [f"# {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}  torch "
             f"{torch.__version__}  python {platform.python_version()}  {world} gloo ranks  bf16  {s} tokens/rank  "
             f"heads {h}/{hk}  head dim {d}  U = local k + v = {unit / 2**20:.2f} MiB",
             "# peak above the forward's start, max over ranks, in U: forward | backward (what the forward left "
             "alive included)"]
    rows = [("single (one shard, SDPA), causal", single(True)),
            ("single (one shard, SDPA), non-causal", single(False))]
    rows += [(f"{variant} / torch_cpu, {'causal' if causal else 'non-causal'}", ring(variant, causal))
             for variant, causal in CASES]
    for name, (forward, backward) in rows:
        peak = torch.tensor(peak_bytes(forward, backward), dtype=torch.float64)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        lines.append(f"{name}: forward {peak[0].item() / unit:.2f} U | backward {peak[1].item() / unit:.2f} U")
    if rank == 0:
        print("\n".join(lines), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                f.write("\n".join(lines) + "\n")
    if created:
        dist.destroy_process_group()
    return lines


if __name__ == "__main__":
    main()
