"""Expert parallelism, read off a model: whether transformers sharded its mixture-of-experts experts over a device
mesh when it loaded the model (``from_pretrained(..., distributed_config=DistributedConfig(...))``).

Context parallelism over such a model is not verified exact: expert parallelism sends each token to the rank that
holds its expert and brings the result back, over a mesh of ranks to which CP would hand different shards of the same
sequence; which tokens meet which experts, the routing statistics and the sharded experts' gradients would each have
to be proven exact over both. ``hfpatch.model.audit`` therefore refuses such a model by name (kind
``"expert-parallel"``); ``expert_parallelism(model)`` says what marks it.

How each release marks it (read in the wheels of 4.53.3, 4.54.1, 4.55.4, 4.56.2, 4.57.6, 5.0.0, 5.17.0, 5.18.0,
5.19.0 and 5.24.0; every rule below is checked on every release, none is chosen by version):

- before 4.54: no expert parallelism (no ``transformers.distributed``); nothing here ever finds one;
- 4.54 - 4.55: ``DistributedConfig(enable_expert_parallel=True)`` replaces the model's tensor-parallel plan
  (``model._tp_plan``) by its config's ``base_model_ep_plan`` (styles ``"ep_router"``, ``"grouped_gemm"``) and
  applies it over the mesh ``model._device_mesh``; the config does not keep the flag. gpt-oss's own
  tensor-parallel plan (4.55 - 4.57) uses those styles too: its experts are then sharded the same way, and found;
- 4.56 - 5.18: ``model.config.distributed_config`` is the ``DistributedConfig``, with ``enable_expert_parallel``;
- 5.19 on: ``DistributedConfig.ep_size > 1`` (``enable_expert_parallel`` is kept equal to ``ep_size > 1``); from 5.18
  every experts module the plan sharded has ``_is_expert_parallel = True``.

A config's ``distributed_config`` exists only in the process that loaded the model with one: no release writes it
to ``config.json`` (5.17 on leave it out; 5.0 fails to save a config that holds one), so a flag found there is the
load of this process. Tensor parallelism alone (``tp_plan``, ``tp_size``) is none of these marks: it is
``hfpatch.model.tensor_parallel``'s. Where a load has both (5.19 on split the attention by tensor parallelism when
``ep_size == tp_size``), the audit's one finding is this one, naming both.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import torch

from hfpatch.model.parallel_load import applied_plan, plan_styles

__all__ = ["EXPERT_PARALLEL_STYLES", "expert_parallelism"]

# The parallel styles of transformers' plans that shard a layer's experts by expert ("ep_router", "grouped_gemm" from
# 4.54, "ep_dispatch_experts" from 5.19): a plan applied over a mesh with one of them is expert parallelism.
# ("moe_tp_experts", read in 5.17 on, splits each expert's weights instead: tensor parallelism.)
EXPERT_PARALLEL_STYLES = frozenset({"ep_router", "grouped_gemm", "ep_dispatch_experts"})


def expert_parallelism(model: torch.nn.Module) -> Optional[str]:
    """None when transformers did not shard ``model``'s experts; otherwise what says it did, as a phrase for an error
    message ("config.distributed_config.ep_size=2", ...). Reads the model only; the same on every rank."""
    config = getattr(model, "config", None)
    found = _config_mark(getattr(config, "distributed_config", None))
    if found is not None:
        return found
    for name, module in model.named_modules():
        if getattr(module, "_is_expert_parallel", False) is True:
            return f"its experts module {name or '<model>'} ({type(module).__name__}) holds only its rank's experts"
    return _plan_mark(model)


def _config_mark(distributed: Any) -> Optional[str]:
    """The flag of a ``DistributedConfig`` (or its dict): ``ep_size`` where the release has it, else
    ``enable_expert_parallel``."""
    if distributed is None:
        return None
    read = distributed.get if isinstance(distributed, Mapping) else lambda key: getattr(distributed, key, None)
    ep_size = read("ep_size")
    if isinstance(ep_size, int) and not isinstance(ep_size, bool):
        return f"config.distributed_config.ep_size={ep_size}" if ep_size > 1 else None
    if read("enable_expert_parallel") is True:
        return "config.distributed_config.enable_expert_parallel=True"
    return None


def _plan_mark(model: torch.nn.Module) -> Optional[str]:
    """A plan with an expert-parallel style applied over a device mesh (``hfpatch.model.parallel_load``: 4.54 - 4.55
    put the expert-parallel plan in ``_tp_plan``; gpt-oss's own tensor-parallel plan has those styles in 4.55 -
    4.57)."""
    plan = applied_plan(model)   # a plan the model class declares is not applied without a mesh
    if plan is None:
        return None
    styles = sorted(EXPERT_PARALLEL_STYLES.intersection(plan_styles(plan)))
    if not styles:
        return None
    return f"its parallel plan, applied over a device mesh, shards experts by expert ({', '.join(styles)})"
