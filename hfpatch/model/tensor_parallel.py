"""Tensor parallelism, read off a model: whether transformers split its layers' weights over a device mesh when it
loaded the model (``from_pretrained(..., tp_plan="auto")``, ``tp_size=``, ``device_mesh=``, or
``distributed_config=DistributedConfig(tp_size=...)``; under torchrun 4.50 - 4.53 also turn ``device_map="auto"``
into ``tp_plan="auto"``).

Context parallelism over such a model is not verified exact: the column-split projections hand each rank's attention
only this rank's heads, and the ring exchanges keys and values between the ranks of the CP group; a CP group that is
not orthogonal to the TP group would exchange keys and values of different heads, and hfpatch has not verified the
composition of the two groups (nor the row-split projections' all-reduce over a sharded sequence).
``hfpatch.model.audit`` therefore refuses such a model by name (kind ``"tensor-parallel"``);
``tensor_parallelism(model)`` says what marks it.

How each release marks it (read in the wheels of 4.46.3 - 4.57.6 (every minor), 5.0.0, 5.1.0, 5.2.0, 5.3.0, 5.9.0,
5.17.0, 5.18.0, 5.19.0 and 5.24.0; loaded with ``tp_plan="auto"`` on 2 gloo ranks in 4.47.1, 4.51.3, 4.53.3, 4.57.6,
5.0.0, 5.19.0 and 5.24.0):

- before 4.47: no tensor parallelism (no ``tp_plan``); nothing here ever finds one;
- 4.47 - 4.49: ``model.tensor_parallel(mesh)`` runs torch's ``parallelize_module`` over the base model's plan; nothing
  is recorded on the model; each split layer has torch's ``_distribute_module_applied = True`` and DTensor weights
  sharded (``Shard``) over the mesh of the world;
- 4.50 - 4.51: the weights are split as they load; nothing is recorded on the model; every module a weight was loaded
  into has ``_is_hooked = True``, the column- and row-split weights are DTensors sharded over the mesh (an all-local
  plan, deepseek_v3's in 4.51, leaves plain tensors);
- 4.52 - 4.53: the model records ``_device_mesh`` (the mesh of the world) and ``_tp_size``: the ``tp_size`` argument,
  None when only ``tp_plan`` was given; the modules as in 4.50;
- 4.54 - 5.9: ``distribute_model`` records ``_tp_size`` (the mesh's size) and ``_device_mesh``, for an expert-parallel
  load too (``enable_expert_parallel``), and marks every module ``_is_hooked``;
- 5.17 on: every distributed load records ``_device_mesh`` and ``_tp_size`` (``DistributedConfig.tp_size``; the
  ``tp_plan`` and ``tp_size`` arguments become one): 1 for FSDP2 alone (``fsdp_size``) or pipeline parallelism alone;
  an empty ``tp_plan`` (``{}``, which 5.24's ``enable_expert_parallel`` without ``ep_size`` sets) splits nothing.
  Expert parallelism with ``tp_size > 1`` splits the attention by tensor parallelism too (5.19 needs
  ``ep_size == tp_size``).

(5.10 - 5.16 were not read.) Every rule below is checked on every release, none is chosen by version:

1. a transformers model in the tree (its class has ``_tp_size``: 4.52 on) records a degree above 1 (``_tp_size``, or
   where that is None the size of ``_device_mesh``) and the plan applied over its mesh
   (``hfpatch.model.parallel_load.applied_plan``) names a tensor-parallel style (any but expert parallelism's);
   a model that records a degree (1 included) or a mesh is judged by this rule alone;
2. where no model records either (4.47 - 4.51): a module with ``_is_hooked`` (transformers' mark) or with
   ``_distribute_module_applied`` and a DTensor weight sharded over a mesh (torch's); not where every DTensor weight of
   those modules is on a mesh of one rank (a one-rank load marks the same modules).

A plan the model class declares (``base_model_tp_plan``, most classes) is no mark: it is applied only by a load over
a mesh. FSDP2 (``fully_shard``) shards weights into DTensors too, on modules neither mark. A config's
``distributed_config`` is not read: it stays on the config, and goes with it to any model built from it, while the
model's own attributes are those of its own load.
"""
from __future__ import annotations

from typing import Optional

import torch

from hfpatch.model.expert_parallel import EXPERT_PARALLEL_STYLES
from hfpatch.model.parallel_load import applied_plan, mesh_size, module_path, plan_styles

__all__ = ["tensor_parallelism"]


def tensor_parallelism(model: torch.nn.Module) -> Optional[str]:
    """None when transformers did not split ``model``'s weights by tensor parallelism; otherwise what says it did,
    as a phrase for an error message ("model._tp_size=2", ...). Reads the model only; the same on every rank."""
    recorded = False
    for name, module in model.named_modules():
        if not hasattr(type(module), "_tp_size"):
            continue
        degree = _recorded_degree(module)
        if degree is None:
            continue
        recorded = True
        found = _split_by_plan(module, name, degree)
        if found is not None:
            return found
    return None if recorded else _module_mark(model)


def _recorded_degree(model: torch.nn.Module) -> Optional[tuple[str, int]]:
    """(what records it, the degree) of a transformers model's load, or None where its load recorded neither."""
    degree = getattr(model, "_tp_size", None)
    if isinstance(degree, int) and not isinstance(degree, bool):
        return f"_tp_size={degree}", degree
    ranks = mesh_size(getattr(model, "_device_mesh", None))
    if ranks is None:
        return None
    return f"_device_mesh of {ranks} ranks with _tp_size=None", ranks


def _split_by_plan(model: torch.nn.Module, name: str, degree: tuple[str, int]) -> Optional[str]:
    what, ranks = degree
    plan = applied_plan(model)
    if ranks <= 1 or plan is None:
        return None
    styles = sorted(plan_styles(plan) - EXPERT_PARALLEL_STYLES)
    if not styles:
        return None   # nothing split by tensor parallelism: an empty plan, or experts by expert alone
    shown = ", ".join(styles[:3]) + (", ..." if len(styles) > 3 else "")
    return f"{module_path(name)}.{what}, plan styles {shown}"


def _module_mark(model: torch.nn.Module) -> Optional[str]:
    """Rule 2 of the module docstring: a module transformers or torch marked as split (one with a sharded DTensor
    weight first), unless the marked modules' sharded DTensor weights all sit on a one-rank mesh."""
    marked, sizes = [], []
    for name, module in model.named_modules():
        hooked = getattr(module, "_is_hooked", False) is True
        distributed = getattr(module, "_distribute_module_applied", False) is True
        if not (hooked or distributed):
            continue
        meshes = [mesh_size(getattr(p, "device_mesh", None)) for p in module.parameters(recurse=False) if _sharded(p)]
        if not hooked and not meshes:
            continue   # torch's mark on a module whose weights are not sharded: no tensor-parallel split
        sizes += [size for size in meshes if size is not None]
        mark = "_is_hooked" if hooked else "_distribute_module_applied"
        marked.append((not meshes, f"its module {name or '<model>'} ({type(module).__name__}) split over a device "
                                   f"mesh, marked {mark}"))
    if not marked or (sizes and max(sizes) <= 1):
        return None
    return min(marked, key=lambda found: found[0])[1]   # the first with a sharded weight, else the first


def _sharded(param: torch.Tensor) -> bool:
    """A DTensor (read by its attributes, so that no ``torch.distributed`` import is needed) with a ``Shard``
    placement."""
    placements = getattr(param, "placements", None) or ()
    return any(callable(getattr(p, "is_shard", None)) and p.is_shard() for p in placements)
