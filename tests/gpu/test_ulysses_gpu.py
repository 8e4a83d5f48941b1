"""Ulysses and USP on CUDA over NCCL with torch's cuDNN, flash and efficient backends (and 'auto'), against float64
attention on the unsharded inputs, forward and backward: the CPU suite's cases and runner
(tests/ring_kernels/test_ring_ulysses.py) moved to the GPU, where the all-to-alls are NCCL's and packed documents
take torch's flash varlen kernel.

    python -m pytest tests/gpu/test_ulysses_gpu.py          # spawns the NCCL ranks itself (2, then 4 GPUs)
"""
from __future__ import annotations

import pytest
import torch

from _dist import run_world
from test_ring_ulysses import build_grid, documents_for, make_case, run_case

pytestmark = [pytest.mark.gpu]


def _cases(world: int):
    replicated = (6, 3) if world == 2 else (4, 1)
    cases = []
    for backend, dtype in (("torch_cudnn", torch.bfloat16), ("torch_flash", torch.bfloat16),
                           ("torch_efficient", torch.float32), ("auto", torch.float16)):
        for layout in ("contiguous", "zigzag", "stripe"):
            for causal, (h, hk) in ((True, (8, 2)), (False, replicated)):
                cases.append(make_case(layout=layout, causal=causal, h=h, hk=hk, d=64, dtype=dtype, backend=backend,
                                   seqlen_local=130))
    cases += [
        make_case(layout="zigzag", window=(50, 0), sink=True, d=64, dtype=torch.bfloat16, backend="auto",
                  seqlen_local=96),
        make_case(layout="stripe", causal=False, window=(20, 30), d=64, dtype=torch.float32,
                  backend="torch_efficient", seqlen_local=64),
    ]
    docs = [d * 8 for d in documents_for(world)]
    for backend, dtype in (("torch_flash", torch.bfloat16), ("auto", torch.bfloat16),
                           ("torch_efficient", torch.float32)):
        for layout, causal in (("contiguous", True), ("zigzag", True), ("contiguous", False)):
            cases.append(make_case("ulysses_varlen", layout, causal, d=64, dtype=dtype, backend=backend,
                                   documents=docs))
    cases.append(make_case("ulysses_varlen", "zigzag", True, h=replicated[0], hk=replicated[1], d=64, sink=True,
                       dtype=torch.bfloat16, backend="torch_flash", documents=docs, packed_row=True))
    if world == 4:
        for ring_variant, causal in (("zigzag", True), ("ring", False), ("ring", True)):
            cases.append(make_case("usp", ring_variant=ring_variant, causal=causal, d=64, dtype=torch.bfloat16,
                               backend="torch_cudnn", seqlen_local=128))
        cases.append(make_case("usp_varlen", ring_variant="llama3", causal=True, d=64, dtype=torch.bfloat16,
                           backend="torch_flash", documents=[64, 96, 0, 32, 64], sink=True))
        cases.append(make_case("usp_varlen", ring_variant="zigzag", causal=True, h=4, hk=1, d=64, dtype=torch.bfloat16,
                           backend="auto", documents=[64, 96, 0, 32, 64]))
    for i, case in enumerate(cases):
        case["seed"] = 700 + i
    return cases


def _rank(rank: int, world: int) -> None:
    grid = build_grid(rank) if world == 4 else None
    device = torch.device("cuda", rank)
    for case in _cases(world):
        run_case(rank, world, case, grid, device=device)


@pytest.mark.parametrize("world", [2, 4])
def test_ulysses_on_cuda_nccl_matches_plain_attention(world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA devices")
    run_world(world, _rank, backend="nccl", timeout=300)
