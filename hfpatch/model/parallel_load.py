"""What transformers' parallel loads leave on a model, as ``hfpatch.model.expert_parallel`` and
``hfpatch.model.tensor_parallel`` read it: the parallel plan applied over a device mesh, and the size of a mesh.

A model class declares a plan (its config's ``base_model_tp_plan``, most classes do; ``_tp_plan`` on the instance
from 4.47): a declared plan is applied only when the model is loaded over a device mesh, which the load records as
``_device_mesh`` (4.52 on). So a plan counts only where that mesh is there.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import torch

__all__ = ["applied_plan", "mesh_size", "module_path", "plan_styles"]


def applied_plan(module: torch.nn.Module) -> Optional[Mapping]:
    """The plan transformers applied to ``module`` over its ``_device_mesh``, or None (no mesh, or no plan).

    The plan is ``module.tp_plan`` where that is a mapping (4.56 - 5.9 answer the expert-parallel plan there while
    ``config.distributed_config.enable_expert_parallel`` is on, the plan they applied), else ``module._tp_plan``
    (4.54 - 4.55 replace it by the expert-parallel plan they apply)."""
    if getattr(module, "_device_mesh", None) is None:
        return None
    plan = getattr(module, "tp_plan", None)
    if not isinstance(plan, Mapping):
        plan = getattr(module, "_tp_plan", None)
    return plan if isinstance(plan, Mapping) else None


def plan_styles(plan: Mapping) -> frozenset:
    """The parallel styles a plan names (its values that are strings)."""
    return frozenset(style for style in plan.values() if isinstance(style, str))


def mesh_size(mesh: Any) -> Optional[int]:
    """The number of ranks of a ``DeviceMesh`` (anything with ``size()``), or None."""
    size = getattr(mesh, "size", None)
    if not callable(size):
        return None
    found = size()
    return found if isinstance(found, int) and not isinstance(found, bool) else None


def module_path(name: str) -> str:
    """``model`` for the model given (``""``), ``model.<name>`` for a submodule: how a mark names where it is."""
    return f"model.{name}" if name else "model"
