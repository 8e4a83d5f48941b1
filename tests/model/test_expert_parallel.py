"""CP x expert parallelism is refused by name (``hfpatch.model.expert_parallel``, the audit's "expert-parallel"
finding): ``apply(model=)``, ``Patch.add_model`` and ``hfpatch.integrations.enable`` raise ``UnsupportedModel``
naming expert parallelism, what marks it and the fix, before anything is installed; ``on_unsupported="fallback"``
runs it without CP and says why; the same model loaded without expert parallelism is not refused.

The model: a tiny Mixtral built from ``MixtralConfig`` (random weights, no download), on 2 gloo ranks. How it gets
expert parallelism depends on the release (``_marking``):

- 5.19 on: a real expert-parallel load, ``from_pretrained(..., distributed_config=DistributedConfig(ep_size=2,
  tp_size=2))`` on the gloo world (each rank holds 2 of the 4 experts of every layer, attention split by tensor
  parallelism: 5.19's expert parallelism needs ``ep_size == tp_size``);
- 4.56 - 5.18: emulated, because a real load needs an expert-parallel plan that these releases' Mixtral lacks (and
  5.0's own loader fails on the one model that has it, Llama 4): the attributes these releases' ``distribute_model``
  / ``maybe_distribute_model`` set, ``config.distributed_config = DistributedConfig(enable_expert_parallel=True)``,
  ``_device_mesh`` (a real CPU mesh of the world) and ``_tp_size``;
- 4.54 - 4.55: emulated the same way, with what those releases set instead of the config's flag: ``_tp_plan``
  replaced by an expert-parallel plan (the styles of their ``base_model_ep_plan``, on Mixtral's module names),
  ``_device_mesh`` and ``_tp_size``;
- before 4.54 there is no expert parallelism: only the model without it runs (not refused).

The rule itself, per release's marks, is a table in one process (stand-ins for each release's ``DistributedConfig``).
"""
from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist
import transformers
from torch.distributed.device_mesh import init_device_mesh
from packaging.version import Version

import hfpatch
from _dist import run_world
from _parallel_worlds import assert_refused_everywhere, enable_runs_here
from _release import skip_unless_ci_pin
from hfpatch.errors import UnsupportedModel
from hfpatch.model.audit import audit
from hfpatch.model.expert_parallel import expert_parallelism

RELEASE = Version(Version(transformers.__version__).base_version)
EXPERTS = 4


def _marking():
    """How this release's expert-parallel model is made for the world (the module docstring says why)."""
    if RELEASE >= Version("5.19.0"):   # DistributedConfig.ep_size
        return "load"
    if RELEASE >= Version("4.56.0"):   # distribute_model keeps the DistributedConfig on the config
        return "config"
    if RELEASE >= Version("4.54.0"):   # transformers.distributed.DistributedConfig(enable_expert_parallel)
        return "plan"
    return None


def _config():
    return transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, num_local_experts=EXPERTS,
                                      num_experts_per_tok=2, max_position_embeddings=64)


def _tiny():
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(_config())


def _experts(model):
    return next(module for name, module in model.named_modules() if name.endswith("experts"))


# ------------------------------------------------------------------------------------- the rule, one process

_EP_PLAN = {"model.layers.*.block_sparse_moe.gate": "ep_router",
            "model.layers.*.block_sparse_moe.experts": "grouped_gemm"}
_TP_PLAN = {"model.layers.*.self_attn.q_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise"}
_MESH = object()   # the rule only asks whether a mesh is there


def _set(model, **attributes):
    for name, value in attributes.items():
        if name == "distributed_config":
            model.config.distributed_config = value
        elif name == "experts":
            _experts(model)._is_expert_parallel = value
        else:
            setattr(model, name, value)


@pytest.mark.parametrize("releases, marks, found", [
    ("5.19 on", dict(distributed_config=types.SimpleNamespace(ep_size=2, enable_expert_parallel=True)), "ep_size=2"),
    ("5.19 on", dict(distributed_config=types.SimpleNamespace(ep_size=1, enable_expert_parallel=False)), None),
    ("5.19 on", dict(distributed_config={"ep_size": 4, "enable_expert_parallel": True}), "ep_size=4"),
    ("5.18 on", dict(experts=True), "holds only its rank's experts"),
    ("5.18 on", dict(experts=False), None),
    ("4.56 - 5.18", dict(distributed_config=types.SimpleNamespace(enable_expert_parallel=True)),
     "enable_expert_parallel=True"),
    ("4.56 - 5.18", dict(distributed_config=types.SimpleNamespace(enable_expert_parallel=False)), None),
    ("4.54 - 4.55", dict(_tp_plan=_EP_PLAN, _device_mesh=_MESH), "ep_router, grouped_gemm"),
    ("4.54 - 4.55", dict(_tp_plan=_EP_PLAN), None),                       # a plan not applied: no mesh
    ("every release", dict(_tp_plan=_TP_PLAN, _device_mesh=_MESH), None),   # tensor parallelism alone
])
def test_each_releases_mark_is_found(releases, marks, found):
    model = _tiny()
    _set(model, **marks)
    mark = expert_parallelism(model)
    if found is None:
        assert mark is None, f"{releases}: {marks} is not expert parallelism, found {mark!r}"
        assert not [f for f in audit(model) if f.kind == "expert-parallel"]
    else:
        assert mark is not None and found in mark, f"{releases}: {marks} gave {mark!r}"
        first = audit(model)[0]
        assert first.kind == "expert-parallel" and found in first.reason


def test_a_model_without_expert_parallelism_has_no_mark():
    model = _tiny()
    assert expert_parallelism(model) is None
    if _marking() is None:
        return
    from transformers.distributed.configuration_utils import DistributedConfig

    model.config.distributed_config = DistributedConfig()   # loaded with a distributed_config, EP left off
    assert expert_parallelism(model) is None


# ------------------------------------------------------------------------------------------ the world

def _expert_parallel(marking, directory, world):
    """This rank's expert-parallel Mixtral (the module docstring says how, per release)."""
    from transformers.distributed.configuration_utils import DistributedConfig

    if marking == "load":
        model = transformers.MixtralForCausalLM.from_pretrained(
            directory, distributed_config=DistributedConfig(ep_size=world, tp_size=world))
        assert _experts(model).num_experts == EXPERTS // world, "the load did not shard the experts"
        return model
    model = _tiny()
    model._device_mesh = init_device_mesh("cpu", (world,))
    model._tp_size = world
    if marking == "config":
        model.config.distributed_config = DistributedConfig(enable_expert_parallel=True)
    else:
        model._tp_plan = dict(_EP_PLAN)
    return model


def _assert_named(error, mark):
    assert isinstance(error, UnsupportedModel) and error.kind == "expert-parallel", error
    text = str(error)
    for part in ("loaded it with expert parallelism", mark, "has not verified that composition exact",
                 "Fix: load the model without expert parallelism", "on_unsupported='fallback'"):
        assert part in text, f"{part!r} not in: {text}"


def _world(rank, world, marking, directory, with_enable):
    plain = transformers.MixtralForCausalLM.from_pretrained(directory) if marking == "load" else _tiny()
    if marking is None:
        with hfpatch.apply(dist.group.WORLD, model=plain, verify=False) as patch:   # not refused
            assert patch.active and [m.model for m in patch.models] == [plain]
        return None
    model = _expert_parallel(marking, directory, world)
    mark = expert_parallelism(model)
    assert mark is not None, f"{marking}: no mark found"
    return assert_refused_everywhere(plain, model, lambda error: _assert_named(error, mark), "expert parallelism",
                                     world, with_enable)


def test_expert_parallelism_is_refused_by_name_on_2_ranks(tmp_path):
    skip_unless_ci_pin("the refusal's world (each release's marks are read by the tests above on every release; "
                       "apply, add_model and enable refuse through the same audit)")
    marking = _marking()
    if marking == "load":
        _tiny().save_pretrained(tmp_path)
    messages = run_world(2, _world, marking, str(tmp_path), enable_runs_here())
    print(f"transformers {transformers.__version__} ({marking or 'no expert parallelism'}): {messages[0]}")
