"""Single GPU: our Triton block backend against cuDNN and torch's flash attention, forward and forward+backward.

    python benchmarks/triton_vs_cudnn.py --out benchmarks/results/triton_vs_cudnn.json

Shapes (defaults): bf16, batch 1, 32 query heads with 32 (MHA) or 8 (GQA) K/V heads, head dim 128,
8192 and 32768 tokens, causal and non-causal. Every backend reads the same (B, S, H, D) tensors through
(B, H, S, D) views; cuDNN and flash get K/V repeated to 32 heads for GQA (same FLOPs; built outside the
timed region), ours reads the 8 K/V heads in place.

- triton:  ``TritonBackend.forward`` (out + LSE); fwd+bwd adds ``TritonBackend.backward`` from that out/LSE.
- cudnn:   ``aten._scaled_dot_product_cudnn_attention(..., compute_log_sumexp=True)``; fwd+bwd through
           ``F.scaled_dot_product_attention`` pinned to ``SDPBackend.CUDNN_ATTENTION`` and ``autograd.grad``.
- flash:   ``aten._scaled_dot_product_flash_attention``; fwd+bwd through SDPA pinned to FLASH_ATTENTION.

FLOPs: forward 4*B*H*S*S*D (halved when causal), backward 2.5x forward (5 matmuls against 2). Times are
CUDA-event medians. The first triton call of each shape autotunes (its seconds are reported separately).
Each shape is also checked: triton's out/LSE against cuDNN's (max abs difference, reported).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))                  # benchmarks/ helpers
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository

from _stamp import stamp  # noqa: E402
from _timing import time_callable  # noqa: E402


def _flops(b: int, h: int, s: int, d: int, causal: bool, mode: str) -> float:
    fwd = 4.0 * b * h * s * s * d * (0.5 if causal else 1.0)
    return fwd if mode == "fwd" else 3.5 * fwd


def _make_runners(q, k, v, dout, causal: bool, scale: float):
    """{backend: {mode: callable}} on the same tensors (q/dout (B,S,H,D), k/v (B,S,Hk,D))."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ring_kernels.backends.base import BlockMask
    from ring_kernels.backends.triton_attn import TritonBackend

    be, mask = TritonBackend(), BlockMask(causal=causal)
    group = q.shape[2] // k.shape[2]
    k_rep = k.repeat_interleave(group, dim=2) if group > 1 else k
    v_rep = v.repeat_interleave(group, dim=2) if group > 1 else v
    qt, kt, vt, dot = (x.transpose(1, 2) for x in (q, k_rep, v_rep, dout))       # (B, H, S, D) views

    def triton_fwd():
        return be.forward(q, k, v, scale=scale, mask=mask)

    def triton_fwdbwd():
        out, lse = be.forward(q, k, v, scale=scale, mask=mask)
        return be.backward(dout, q, k, v, out, lse, scale=scale, mask=mask)

    def cudnn_fwd():
        return torch.ops.aten._scaled_dot_product_cudnn_attention(
            qt, kt, vt, None, True, 0.0, causal, False, scale=scale)

    def flash_fwd():
        return torch.ops.aten._scaled_dot_product_flash_attention(qt, kt, vt, 0.0, causal, False, scale=scale)

    leaves = [x.detach().requires_grad_() for x in (qt, kt, vt)]

    def sdpa_fwdbwd(backend):
        def run():
            with sdpa_kernel([backend]):
                out = F.scaled_dot_product_attention(*leaves, is_causal=causal, scale=scale)
            return torch.autograd.grad(out, leaves, dot)
        return run

    return {
        "triton": {"fwd": triton_fwd, "fwdbwd": triton_fwdbwd},
        "cudnn": {"fwd": cudnn_fwd, "fwdbwd": sdpa_fwdbwd(SDPBackend.CUDNN_ATTENTION)},
        "flash": {"fwd": flash_fwd, "fwdbwd": sdpa_fwdbwd(SDPBackend.FLASH_ATTENTION)},
    }


def _check_against_cudnn(runners) -> dict:
    """Max abs differences of triton's out and LSE against cuDNN's on this shape (a sanity gate)."""
    out, lse = runners["triton"]["fwd"]()
    ref = runners["cudnn"]["fwd"]()
    ref_out, ref_lse = ref[0].transpose(1, 2), ref[1].reshape(lse.shape)
    return {"max_abs_diff_out": (out.float() - ref_out.float()).abs().max().item(),
            "max_abs_diff_lse": (lse - ref_lse.float()).abs().max().item()}


def _best_configs() -> dict:
    from ring_kernels.backends import triton_attn as ta

    found = {}
    for name, tuner in (("fwd", ta.attn_fwd_tuned), ("dkdv", ta.attn_bwd_dkdv_tuned), ("dq", ta.attn_bwd_dq_tuned)):
        best = getattr(tuner, "best_config", None)
        found[name] = None if best is None else str(best)
    return found


def _bench_shape(args, s: int, hk: int, causal: bool, device) -> list:
    b, h, d = 1, args.heads, args.head_dim
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    q, dout = (torch.randn(b, s, h, d, generator=gen, device=device, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(b, s, hk, d, generator=gen, device=device, dtype=dtype) for _ in range(2))
    runners = _make_runners(q, k, v, dout, causal, 1.0 / math.sqrt(d))
    shape = {"batch": b, "seqlen": s, "heads": h, "kv_heads": hk, "head_dim": d, "causal": causal,
             "dtype": args.dtype}
    t0 = time.perf_counter()
    runners["triton"]["fwdbwd"]()                      # compiles and autotunes the three kernels
    torch.cuda.synchronize(device)
    first_call_s = time.perf_counter() - t0
    rows = []
    try:
        check = _check_against_cudnn(runners)
    except Exception as exc:  # noqa: BLE001 - cuDNN missing for this shape: say so, still time the others
        check = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    for mode in args.modes:
        row = {**shape, "mode": mode, "check_vs_cudnn": check, "triton_first_call_s": first_call_s}
        for name in ("triton", "cudnn", "flash"):
            try:
                t = time_callable(runners[name][mode], device=device, warmup=args.warmup, iters=args.iters)
                row[name] = {"ms": t.median_ms, "tflops": _flops(b, h, s, d, causal, mode) / t.median_ms / 1e9,
                             "timing": t.as_dict()}
            except Exception as exc:  # noqa: BLE001 - a backend that cannot run this shape is reported, not fatal
                row[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        if "ms" in row["triton"] and "ms" in row.get("cudnn", {}):
            row["triton_vs_cudnn"] = row["cudnn"]["ms"] / row["triton"]["ms"]
        row["triton_configs"] = _best_configs()
        rows.append(row)
        _print_row(row)
    del q, k, v, dout, runners
    torch.cuda.empty_cache()
    return rows


def _fmt(entry: dict) -> str:
    return f"{entry['ms']:8.3f} ms {entry['tflops']:6.1f}" if "ms" in entry else f"{'error':>18}"


def _print_row(row: dict) -> None:
    ratio = row.get("triton_vs_cudnn")
    print(f"S={row['seqlen']:6d} Hk={row['kv_heads']:2d} {'causal' if row['causal'] else 'full  '} "
          f"{row['mode']:6s} | triton {_fmt(row['triton'])} | cudnn {_fmt(row['cudnn'])} | "
          f"flash {_fmt(row['flash'])} | triton/cudnn {'%.1f%%' % (100 * ratio) if ratio else 'n/a'}",
          flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="path of the JSON results file to write")
    p.add_argument("--seqlens", default="8192,32768")
    p.add_argument("--kv-heads", default="32,8", help="comma list: 32 = MHA, 8 = GQA (Llama-3-8B)")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--causal", default="1,0", help="comma list of 1/0")
    p.add_argument("--modes", default="fwd,fwdbwd")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    args = p.parse_args(argv)
    args.modes = args.modes.split(",")
    if not torch.cuda.is_available():
        raise SystemExit("triton_vs_cudnn: needs a CUDA device (this machine has none)")
    device = torch.device("cuda", torch.cuda.current_device())
    rows = []
    for s in (int(x) for x in args.seqlens.split(",")):
        for hk in (int(x) for x in args.kv_heads.split(",")):
            for causal in (x == "1" for x in args.causal.split(",")):
                rows.extend(_bench_shape(args, s, hk, causal, device))
    ratios = [r["triton_vs_cudnn"] for r in rows if "triton_vs_cudnn" in r]
    summary = {"min_ratio_vs_cudnn": min(ratios) if ratios else None,
               "geomean_ratio_vs_cudnn": math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else None,
               "target_ratio": 0.60}
    print(f"triton / cuDNN throughput: min {summary['min_ratio_vs_cudnn']}, "
          f"geomean {summary['geomean_ratio_vs_cudnn']} (target >= 0.60)")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"stamp": stamp(device, 1), "args": vars(args), "summary": summary, "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
