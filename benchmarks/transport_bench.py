"""How much of a ring step's K/V transfer is exposed next to a cuDNN attention kernel, per transport.

    torchrun --nproc-per-node 2 benchmarks/transport_bench.py [--iters 20] [--backend cudnn] [--json out.json]

Per transport ("nccl": ring_kernels.comm.RingExchange over batch_isend_irecv; "copy_engine/barrier" and
"copy_engine/stream_memop": ring_kernels.transport.CopyEngineExchange over torch symmetric memory, signalling
with torch's barrier kernel or with CUDA stream memory operations, which need no SM):
  (a) transfer: one ring exchange of K+V (2 x (1, 8192, 8, 128) bf16 = 32 MiB) alone;
  (b) attention: causal forward SDPA (B=1, H=32, S=8192, D=128, bf16) with the chosen backend, alone;
  (c) overlapped: the exchange started just before the same attention and waited just after it.
exposed = (c) - (b): the transfer time the compute stream does not hide (the ring step's loss).
Times are CUDA events on the current stream, medians over ``--iters`` iterations (after warm-up), slowest
rank. (b) is measured again for every transport, right before its (c), so (c) - (b) is not skewed by drift
(clocks, other jobs) between transports. Every transport first moves a known pattern and is checked. ~30 s.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

KV_SHAPE = (1, 8192, 8, 128)         # (batch, seqlen_local, nheads_k, headdim): the ring's K or V block
ATTN_SHAPE = (1, 32, 8192, 128)      # (batch, nheads, seqlen, headdim): SDPA's layout


def _sdpa_backend(name: str):
    from torch.nn.attention import SDPBackend
    return {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}[name]


def _median_ms(fn, iters: int, warmup: int, device) -> float:
    """Median over ``iters`` of fn's time between two CUDA events, after ``warmup`` calls; slowest rank."""
    samples = []
    for i in range(warmup + iters):
        dist.barrier()
        torch.cuda.synchronize(device)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize(device)
        if i >= warmup:
            samples.append(a.elapsed_time(b))
    t = torch.tensor([statistics.median(samples)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _check_transfer(ex, send, recv, rank, world) -> None:
    """One exchange with a known pattern: the benchmark times a transport only after it moved data right."""
    probe = [torch.full_like(s, float(rank + 1)) for s in send]
    ex.start(probe, recv)
    ex.wait()
    torch.cuda.synchronize()
    src = (rank - 1) % world
    for r in recv:
        if not torch.equal(r, torch.full_like(r, float(src + 1))):
            raise RuntimeError(f"transport_bench: rank {rank} received wrong data from rank {src}")


def run(args) -> dict:
    from ring_kernels.transport import CopyEngineExchange, copy_engine_unavailable_reason, make_exchange

    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=device).manual_seed(rank)
    q, k, v = (torch.randn(ATTN_SHAPE, device=device, generator=gen, dtype=torch.bfloat16) for _ in range(3))
    send = [torch.randn(KV_SHAPE, device=device, generator=gen, dtype=torch.bfloat16) for _ in range(2)]
    recv = [torch.empty_like(s) for s in send]
    backend = _sdpa_backend(args.backend)
    from torch.nn.attention import sdpa_kernel

    def attention():
        with sdpa_kernel([backend]):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)

    reason = copy_engine_unavailable_reason(None, device)
    makers = {"nccl": lambda: make_exchange(None, tag=0, transport="nccl")}
    if reason is None:
        for signal in args.signals:
            makers[f"copy_engine/{signal}"] = lambda signal=signal: CopyEngineExchange(None, tag=0, signal=signal)
    rows, errors, it, wu = {}, {}, args.iters, args.warmup
    for name, make in makers.items():
        try:
            ex = make()
        except (RuntimeError, ValueError) as exc:   # e.g. no stream memory operations in this driver
            errors[name] = f"{type(exc).__name__}: {exc}"
            continue
        _check_transfer(ex, send, recv, rank, world)

        def transfer():
            ex.start(send, recv)
            ex.wait()

        def overlapped():
            ex.start(send, recv)
            attention()
            ex.wait()

        row = {"transfer_ms": _median_ms(transfer, it, wu, device),
               "attention_ms": _median_ms(attention, it, wu, device),
               "overlapped_ms": _median_ms(overlapped, it, wu, device)}
        row["exposed_ms"] = row["overlapped_ms"] - row["attention_ms"]
        rows[name] = row
    nbytes = sum(s.numel() * s.element_size() for s in send)
    doc = {"world_size": world, "device": torch.cuda.get_device_name(device), "torch": torch.__version__,
           "cuda": torch.version.cuda, "sdpa_backend": args.backend, "exchange_bytes": nbytes,
           "attention_shape": list(ATTN_SHAPE), "iters": it, "warmup": wu, "results": rows,
           "copy_engine_unavailable_reason": reason, "errors": errors}
    try:
        from benchmarks._stamp import stamp
        doc["stamp"] = stamp(device, world)
    except Exception as exc:   # the stamp is context, not the measurement
        doc["stamp_error"] = f"{type(exc).__name__}: {exc}"
    return doc


def table(doc: dict) -> str:
    lines = [f"{doc['world_size']} x {doc['device']}, torch {doc['torch']} (CUDA {doc['cuda']}), "
             f"K+V exchange {doc['exchange_bytes'] / 2**20:.0f} MiB, causal {doc['sdpa_backend']} SDPA "
             f"B=1 H=32 S=8192 D=128 bf16; medians of {doc['iters']}, slowest rank",
             "", "| transport | (a) transfer alone | (b) attention alone | (c) attention + exchange | exposed (c)-(b) |",
             "|---|---|---|---|---|"]
    for name, r in doc["results"].items():
        lines.append(f"| {name} | {r['transfer_ms']:.3f} ms | {r['attention_ms']:.3f} ms | "
                     f"{r['overlapped_ms']:.3f} ms | {r['exposed_ms'] * 1000:.0f} us |")
    if doc["copy_engine_unavailable_reason"]:
        lines.append(f"\ncopy_engine not measured: {doc['copy_engine_unavailable_reason']}")
    for name, err in doc["errors"].items():
        lines.append(f"\n{name} not measured: {err}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--backend", choices=("cudnn", "flash", "efficient"), default="cudnn")
    p.add_argument("--signals", nargs="+", choices=("barrier", "stream_memop"), default=["barrier", "stream_memop"],
                   help="copy-engine signalling modes to measure (CopyEngineExchange's signal=)")
    p.add_argument("--json", help="also write the results here (rank 0)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("transport_bench: needs CUDA (one GPU per rank, launched with torchrun)", file=sys.stderr)
        return 2
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    try:
        doc = run(args)
        if dist.get_rank() == 0:
            print(table(doc), flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(doc, f, indent=2)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
