"""Where a ring step spends its GPU time: a torch.profiler breakdown of one variant x backend, next to the
same block calls made alone on one GPU.

    torchrun --nproc-per-node 2 benchmarks/profile_ring.py --variant zigzag --backend torch_cudnn --causal
    torchrun --nproc-per-node 2 benchmarks/profile_ring.py --variant ring --backend torch_cudnn

Prints (rank 0): the step time (CUDA events, max over ranks), the GPU time per kernel family summed over the
profiled iterations and divided by their count, and how much of the step the attention kernels themselves
account for. ``--trace DIR`` also writes a Chrome trace per rank. Shapes: batch 1, Llama-3-8B attention
(32 query heads, 8 K/V heads, head dim 128) unless ``--heads/--kv-heads/--head-dim`` say otherwise.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

import torch
import torch.distributed as dist

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]

from _runners import ring_function  # noqa: E402
from _timing import time_callable  # noqa: E402

# Kernel families by substring of the CUDA kernel name (first match wins); the rest is "other".
_FAMILIES = (
    ("attention (cudnn)", ("cudnn", "sm90_flash", "flash_fprop", "flash_bprop", "fmha")),
    ("attention (flash)", ("flash_fwd", "flash_bwd", "pytorch_flash")),
    ("attention (efficient)", ("fmha_cutlass", "attention_kernel", "AttentionKernel", "AttentionBackward")),
    ("attention (triton)", ("_attn_fwd", "_attn_bwd", "_fwd_kernel", "_bwd_kernel")),
    ("merge (triton)", ("_merge_rows",)),
    ("nccl", ("nccl",)),
    ("copy / cast", ("copy", "Copy", "cast", "convert")),
    ("fill", ("fill", "Fill", "zero")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "reduce", "Reduce")),
)


def _family(name: str) -> str:
    for family, keys in _FAMILIES:
        if any(key in name for key in keys):
            return family
    return "other"


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", default="zigzag", choices=("ring", "zigzag", "stripe"))
    p.add_argument("--backend", default="torch_cudnn")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--tokens", type=int, default=8192, help="tokens per GPU")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--fwd-only", action="store_true")
    p.add_argument("--trace", default=None, help="directory for one Chrome trace per rank")
    p.add_argument("--top", type=int, default=12, help="kernels listed individually")
    return p.parse_args(argv)


def _step(fn, q, k, v, dout, fwd_only: bool):
    def run():
        if fwd_only:
            with torch.no_grad():
                return fn(q, k, v)
        out = fn(q, k, v)
        return torch.autograd.grad(out, (q, k, v), dout)
    return run


def main(argv=None) -> int:
    args = _args(argv)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    if "RING_KERNELS_SKIP_RANK_CHECK" not in os.environ:      # profiled without the per-call check unless asked
        from ring_kernels import set_options
        set_options(skip_rank_check=True)
    gen = torch.Generator(device=device).manual_seed(1234 + rank)

    def randn(heads):
        return torch.randn(1, args.tokens, heads, args.head_dim, generator=gen, device=device,
                           dtype=torch.bfloat16, requires_grad=True)

    q, k, v = randn(args.heads), randn(args.kv_heads), randn(args.kv_heads)
    dout = torch.randn_like(q).detach()
    ring = ring_function(args.variant)

    def fn(q_, k_, v_):
        return ring(q_, k_, v_, causal=args.causal, backend=args.backend)

    step = _step(fn, q, k, v, dout, args.fwd_only)
    timing = time_callable(step, device=device, warmup=5, iters=args.iters)

    activities = [torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.iters):
            step()
        torch.cuda.synchronize(device)
    if args.trace:
        os.makedirs(args.trace, exist_ok=True)
        prof.export_chrome_trace(os.path.join(args.trace, f"trace_{args.variant}_{args.backend}_rank{rank}.json"))

    per_kernel = collections.Counter()
    calls = collections.Counter()
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[evt.name] += evt.device_time / args.iters / 1000.0     # ms per step
            calls[evt.name] += 1
    families = collections.Counter()
    for name, ms in per_kernel.items():
        families[_family(name)] += ms
    gpu_busy = sum(per_kernel.values()) - families["nccl"]

    # Each rank reports; rank 0 prints in rank order.
    lines = [f"--- rank {rank}: {args.variant} x {args.backend}, causal={args.causal}, {args.tokens} tokens/GPU, "
             f"{'fwd' if args.fwd_only else 'fwd+bwd'}: step {timing.median_ms:.3f} ms (max over ranks, median)",
             f"    GPU kernel time per step excluding NCCL: {gpu_busy:.3f} ms; by family:"]
    for family, ms in families.most_common():
        lines.append(f"      {family:24s} {ms:8.3f} ms  ({100 * ms / timing.median_ms:5.1f}% of the step)")
    lines.append(f"    top {args.top} kernels (ms per step, launches per step):")
    for name, ms in per_kernel.most_common(args.top):
        lines.append(f"      {ms:8.3f} ms  x{calls[name] / args.iters:4.1f}  {name[:110]}")
    gathered = [None] * world
    dist.all_gather_object(gathered, "\n".join(lines))
    if rank == 0:
        print("\n".join(gathered), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
