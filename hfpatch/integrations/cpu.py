"""The one CPU-only difference of the trainer integration: accelerate's device check of ``ParallelismConfig``.

accelerate (1.12-1.15) validates a ``ParallelismConfig`` when the ``Accelerator`` is built (inside
``Trainer.__init__``) and refuses it unless the processes run on accelerators (FSDP2, multi-GPU-like devices, or
DeepSpeed): a multi-process CPU run (``DistributedType.MULTI_CPU``, gloo) gets "ParallelismConfig is only
compatible DistributedType.FSDP (version 2) or DistributedType.Multi{Device} ...". Inside
``parallelism_config_on_cpu()`` that validation sees a MULTI_CPU accelerator as multi-device; nothing else
changes. What accelerate then does is its own: the device mesh (dp_shard x cp, on gloo), the same batch for every
rank of a CP group, and the model wrapped in DDP over every rank. On GPUs accelerate shards the model with FSDP2
over ``dp_shard_cp`` instead (it requires an FSDP2 plugin for ``cp_size > 1`` unless
``ACCELERATE_ALLOW_CP_STANDALONE=true``); both average the gradients over dp x cp, which is the reduction
``hfpatch.integrations`` computes its loss for. GPU runs never need this context.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

__all__ = ["parallelism_config_on_cpu"]


class _SeenAsMultiDevice:
    """The accelerator as the validation reads it: ``multi_device`` True, every other attribute its own."""

    multi_device = True

    def __init__(self, accelerator) -> None:
        self._accelerator = accelerator

    def __getattr__(self, name):
        return getattr(self._accelerator, name)


@contextlib.contextmanager
def parallelism_config_on_cpu() -> Iterator[None]:
    """Build the trainer inside it on a CPU-only machine (see the module docstring); restored on exit."""
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DistributedType

    original = ParallelismConfig.__dict__["_validate_accelerator"]

    def validate_on_cpu(self, accelerator):
        if accelerator.distributed_type == DistributedType.MULTI_CPU:
            accelerator = _SeenAsMultiDevice(accelerator)
        return original(self, accelerator)

    validate_on_cpu.__wrapped__ = original
    ParallelismConfig._validate_accelerator = validate_on_cpu
    try:
        yield
    finally:
        if ParallelismConfig.__dict__.get("_validate_accelerator") is validate_on_cpu:
            ParallelismConfig._validate_accelerator = original
