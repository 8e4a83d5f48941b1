"""Which submodules of a model are its attention layers: the modules whose calls should run the ring."""
from __future__ import annotations

import torch

__all__ = ["attention_modules"]


def attention_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The outermost submodules of ``model`` whose class name contains "Attention" (LlamaAttention,
    LlamaFlashAttention2, FalconAttention, ...), with their qualified names: the layers that should run the ring."""
    found: list[tuple[str, torch.nn.Module]] = []
    for name, module in model.named_modules():
        if "Attention" not in type(module).__name__:
            continue
        if any(name.startswith(outer + ".") for outer, _ in found):
            continue
        found.append((name, module))
    return found
