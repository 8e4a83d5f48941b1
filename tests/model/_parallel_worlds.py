"""What the worlds of tests/model/test_expert_parallel.py and test_tensor_parallel.py share: the checks that a model
is refused by name wherever a user brings it, the stand-in trainer ``hfpatch.integrations.enable`` reads, and whether
``enable`` runs in this env at all."""
from __future__ import annotations

import types
from typing import Callable

import pytest
import torch.distributed as dist

import hfpatch
from hfpatch.errors import UnsupportedModel
from hfpatch.integrations import requirements

__all__ = ["assert_refused_everywhere", "enable_runs_here", "stand_in_trainer"]


def assert_refused_everywhere(plain, model, assert_named: Callable, subject: str, world: int,
                              with_enable: bool) -> str:
    """On this rank: ``plain`` is accepted (no verification), and ``model`` is refused by name by ``Patch.add_model``
    to that live patch (which keeps ``plain`` alone), by ``apply`` (which leaves nothing installed) and, where
    ``with_enable``, by ``hfpatch.integrations.enable``; ``on_unsupported="fallback"`` runs it without CP, its reason
    naming ``subject``. ``assert_named(error)`` checks each refusal's message. Returns the message."""
    with hfpatch.apply(dist.group.WORLD, model=plain, verify=False) as patch:
        assert patch.active and [m.model for m in patch.models] == [plain]
        with pytest.raises(UnsupportedModel) as info:
            patch.add_model(model)
        assert_named(info.value)
        assert [m.model for m in patch.models] == [plain], "a refused add_model left the model on the ring"
    with pytest.raises(UnsupportedModel) as info:
        hfpatch.apply(dist.group.WORLD, model=model)
    assert_named(info.value)
    assert hfpatch.active_patch() is None, "a refused apply left a patch installed"
    fallback = hfpatch.apply(dist.group.WORLD, model=model, on_unsupported="fallback")
    assert not fallback.active and subject in fallback.reason, fallback.reason
    fallback.remove()
    if with_enable:
        with pytest.raises(UnsupportedModel) as info:
            hfpatch.integrations.enable(stand_in_trainer(model, world))
        assert_named(info.value)
        assert hfpatch.active_patch() is None
    return str(info.value)


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
