"""``hfpatch.apply(group, model=model)`` with its default verification (the whole-model probe) on a Llama-3-8B-shaped
model in bf16 over 2 and 4 GPUs (NCCL): the exact model is accepted, and the same model with a token-mixing module
(benchmarks/probe_margin.py's ``CausalEma``) planted in one layer is refused, naming that module.

    python -m pytest tests/gpu/test_probe_gpu.py -s        # spawns the NCCL ranks itself; skips without the GPUs

Each rank builds the model on its GPU from ``LlamaConfig`` (random weights, the same on every rank), as a user
would before wrapping it for training. ``-s`` shows each world's probe result (largest error, where, how many
tensors it compared, seconds).
"""
from __future__ import annotations

import sys
import time

import pytest
import torch
import torch.distributed as dist

import hfpatch
from _dist import run_world
from _paths import BENCHMARKS
from hfpatch.errors import ModelDivergence

_BENCH = str(BENCHMARKS)
if _BENCH not in sys.path:
    sys.path.insert(0, _BENCH)

from probe_margin import CausalEma  # noqa: E402  (a token-mixing module no rule knows)

pytestmark = [pytest.mark.gpu]

# Llama-3-8B: hidden 4096, 32 layers, 32 query / 8 key-value heads, MLP 14336, vocabulary 128256.
LLAMA_3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, rope_theta=500000.0,
                  use_cache=False)


def _llama_3_8b(device):
    import transformers

    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM._from_config(transformers.LlamaConfig(**LLAMA_3_8B),
                                                           dtype=torch.bfloat16)
    return model.train()


def _apply_to_8b(rank, world):
    device = torch.device("cuda", rank)
    model = _llama_3_8b(device)
    group = dist.group.WORLD
    start = time.perf_counter()
    patch = hfpatch.apply(group, model=model)              # verify=True: the whole-model probe
    seconds = time.perf_counter() - start
    assert patch.active and patch.probe is not None
    probe = patch.probe
    patch.remove()
    if rank == 0:
        print(f"\n{world} GPUs ({torch.cuda.get_device_name(device)}), Llama-3-8B bf16: accepted; probe worst "
              f"{probe.worst:.3g} at {probe.worst_at}, {probe.compared} tensors compared, {probe.tokens} tokens, "
              f"apply {seconds:.1f} s", flush=True)
    assert probe.worst < 0.05 and probe.compared > 32 * 10

    model.model.layers[20].mlp = CausalEma(model.model.layers[20].mlp)
    with pytest.raises(ModelDivergence) as info:
        hfpatch.apply(group, model=model)
    assert info.value.module_path == "model.layers.20.mlp" and info.value.module_class == "CausalEma"
    assert info.value.check == "output of model.layers.20.mlp"
    if rank == 0:
        print(f"{world} GPUs: with a running mean planted in layer 20: refused at {info.value.check} "
              f"(error {info.value.error:.3g} > {info.value.tolerance:g})", flush=True)


@pytest.mark.parametrize("world", [2, 4])
def test_apply_verifies_llama_3_8b_in_bf16(world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA devices, {torch.cuda.device_count()} visible")
    run_world(world, _apply_to_8b, backend="nccl", timeout=600.0)
