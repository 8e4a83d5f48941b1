"""What a new sequence length costs cuDNN's attention, against torch's flash, on one CUDA device.

    python benchmarks/cudnn_shape_cost.py        # one GPU; prints ms per forward + backward call

Causal self-attention, 32 heads x 128, bf16, batch 1: four passes over the same 30 random lengths (512-1535
tokens), then 30 calls at one length (1024) that the passes may not have used. cuDNN builds an execution graph for
every new shape (kept in its cache for the process), so its first pass pays one build per length and the later
passes do not; flash has no per-shape build. ``ring_kernels.backends.torch_cuda_varlen`` takes its graph-build cost
from this (benchmarks/results/cudnn_shape_cost_1xH100_9502c84.log).
"""
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend as B
from torch.nn.attention import sdpa_kernel


def run(lengths, backend) -> float:
    """Milliseconds per forward + backward call, over ``lengths`` one after another."""
    t = time.perf_counter()
    for n in lengths:
        q = torch.randn(1, 32, n, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        with sdpa_kernel([backend]):
            o = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        o.sum().backward()
    torch.cuda.synchronize()
    return round((time.perf_counter() - t) / len(lengths) * 1e3, 3)


def main() -> None:
    torch.manual_seed(0)
    lengths = [int(x) for x in torch.randint(512, 1536, (30,))]
    for backend in (B.CUDNN_ATTENTION, B.FLASH_ATTENTION):
        print(backend, "passes over 30 distinct lengths, ms/call:", [run(lengths, backend) for _ in range(4)],
              "one length:", run([1024] * 30, backend))


if __name__ == "__main__":
    main()
