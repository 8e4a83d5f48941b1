"""Test helper: which fp32 tensors an operation allocates (the engine's rule: fp32 only where needed)."""
import torch

__all__ = ["fp32_factories"]


def fp32_factories():
    """A dispatch mode recording the fp32 tensors that factory ops allocate while it is active:
    ``.fp32`` = [(op name, shape, numel)]."""
    from torch.utils._python_dispatch import TorchDispatchMode

    factories = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
                 torch.ops.aten.zeros.default, torch.ops.aten.full.default, torch.ops.aten.empty_like.default,
                 torch.ops.aten.zeros_like.default, torch.ops.aten.new_empty.default, torch.ops.aten.new_zeros.default}

    class Allocations(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.fp32 = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in factories and out.dtype == torch.float32:
                self.fp32.append((str(func), tuple(out.shape), out.numel()))
            return out

    return Allocations()
