"""What the worlds of tests/model/test_expert_parallel.py and test_tensor_parallel.py share: the stand-in trainer
``hfpatch.integrations.enable`` reads, and whether ``enable`` runs in this env at all."""
from __future__ import annotations

import types

import torch.distributed as dist

from hfpatch.integrations import requirements

__all__ = ["enable_runs_here", "stand_in_trainer"]


def stand_in_trainer(model, world):
    """What ``enable`` reads of a trainer before it calls ``apply``: a CP-only ``ParallelismConfig``, its "cp" mesh
    (here the world's group), no prepared model, no loss it refuses."""
    accelerator = types.SimpleNamespace(
        _models=[], unwrap_model=lambda m: m, torch_device_mesh={"cp": dist.group.WORLD},
        parallelism_config=types.SimpleNamespace(cp_enabled=True, cp_size=world, tp_size=1, sp_size=1))
    return types.SimpleNamespace(accelerator=accelerator, model=model, label_smoother=None, compute_loss_func=None,
                                 aux_loss_enabled=False)


def enable_runs_here() -> bool:
    """The transformers and accelerate releases ``hfpatch.integrations`` supports are installed."""
    return all((found := requirements.installed(name)) is not None and found >= minimum
               for name, minimum in (("transformers", requirements.TRANSFORMERS_MIN),
                                     ("accelerate", requirements.ACCELERATE_MIN)))
