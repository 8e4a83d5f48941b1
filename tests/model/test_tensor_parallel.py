"""CP x tensor parallelism is refused by name (``hfpatch.model.tensor_parallel``, the audit's "tensor-parallel"
finding): ``apply(model=)``, ``Patch.add_model`` and ``hfpatch.integrations.enable`` raise ``UnsupportedModel`` naming
tensor parallelism, what marks it and the fix, before anything is installed; ``on_unsupported="fallback"`` runs it
without CP and says why; a model whose class declares a tensor-parallel plan (Llama's) but was loaded without one is
not refused; an expert-parallel load that split the attention by tensor parallelism too is refused once, as
expert-parallel, naming both.

The world: a tiny Llama (random weights, no download) saved to ``tmp_path`` and loaded on 2 gloo ranks with
``from_pretrained(..., tp_plan="auto")``, a real tensor-parallel load, in every release that can make one here:
4.47 on, with accelerate installed (every release's ``from_pretrained`` gives a tensor-parallel load a device map or
low-CPU-memory loading, which need accelerate: the CI venv and tf5.0.0 have it, the other envs skip the world). From
5.17 the world also loads the model with FSDP2 alone (``DistributedConfig(fsdp_size=2)``), which records a device
mesh and ``_tp_size=1``: not refused.

Each release's marks (the module docstring of ``hfpatch.model.tensor_parallel``) are a table in one process, on the
tiny Llama with the attributes that release's load writes (stand-in meshes; stand-in DTensor weights: a parameter
with ``placements`` and ``device_mesh``), so that every env checks every release's rule.
"""
from __future__ import annotations

import types
import warnings

import pytest
import torch
import transformers
from packaging.version import Version
from torch.distributed.tensor import Replicate, Shard

from _dist import run_world
from _parallel_worlds import assert_refused_everywhere, enable_runs_here
from hfpatch.errors import UnsupportedModel
from hfpatch.integrations import requirements
from hfpatch.model.audit import audit
from hfpatch.model.tensor_parallel import tensor_parallelism

RELEASE = Version(Version(transformers.__version__).base_version)
HIDDEN = 32


def _config():
    return transformers.LlamaConfig(vocab_size=64, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=1,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def _tiny(records_its_load: bool = False):
    """The tiny Llama. ``records_its_load``: of a class that records its parallel load (``_tp_size``: 4.52 on), as
    the marks of those releases need, also in an env whose release is older."""
    torch.manual_seed(0)
    model_class = transformers.LlamaForCausalLM
    older = records_its_load and not hasattr(model_class, "_tp_size")
    if older:
        model_class = type(model_class.__name__, (model_class,), {"_tp_size": None})
    model = model_class(_config())
    if older and not isinstance(getattr(model, "_tp_plan", None), dict):
        model._tp_plan = dict(_LLAMA_PLAN)   # what such a release's Llama holds (4.43 - 4.46 hold none)
    return model


# Llama's tensor-parallel plan as 4.52 on hold it on the model
_LLAMA_PLAN = {**{f"model.layers.*.self_attn.{p}": "colwise" for p in ("q_proj", "k_proj", "v_proj")},
               "model.layers.*.self_attn.o_proj": "rowwise", "model.layers.*.mlp.gate_proj": "colwise",
               "model.layers.*.mlp.up_proj": "colwise", "model.layers.*.mlp.down_proj": "rowwise"}


def _declares_a_plan(config) -> bool:
    """Llama declares a tensor-parallel plan from 4.47 (the releases before have no tensor parallelism)."""
    return bool(getattr(config, "base_model_tp_plan", None)) or RELEASE < Version("4.47.0")


# ------------------------------------------------------------------------------------- the rule, one process

class _Mesh:
    """A stand-in ``DeviceMesh``: the rule asks only its size."""

    def __init__(self, ranks):
        self.ranks = ranks

    def size(self):
        return self.ranks


_EP_ONLY = {"model.layers.*.mlp.experts": "ep_dispatch_experts", "model.layers.*.mlp.experts.down_proj": "grouped_gemm"}
_SPLIT = ("q_proj", "k_proj", "v_proj", "o_proj")


def _linears(model):
    return [module for name, module in model.named_modules() if name.rsplit(".", 1)[-1] in _SPLIT]


def _set(model, hooked=False, distributed=False, dtensor=None, placement=Shard(0), **attributes):
    """The release's marks on ``model``: attributes of the model itself, and on its attention projections the
    module marks (``_is_hooked``, ``_distribute_module_applied``) and DTensor weights on a mesh of ``dtensor``
    ranks."""
    for name, value in attributes.items():
        setattr(model, name, value)
    for module in _linears(model):
        if hooked:
            module._is_hooked = True
        if distributed:
            module._distribute_module_applied = True
        if dtensor is not None:
            module.weight.placements = (placement,)
            module.weight.device_mesh = _Mesh(dtensor)


@pytest.mark.parametrize("releases, marks, found", [
    ("5.17 on", dict(_tp_size=2, _device_mesh=_Mesh(2), hooked=True, dtensor=2), "model._tp_size=2"),
    ("5.17 on: FSDP2 alone", dict(_tp_size=1, _device_mesh=_Mesh(2), dtensor=2), None),
    ("5.24: enable_expert_parallel alone", dict(_tp_size=2, _device_mesh=_Mesh(2), _tp_plan={}, hooked=True), None),
    ("4.54 - 5.9", dict(_tp_size=2, _device_mesh=_Mesh(2), hooked=True, dtensor=2), "model._tp_size=2"),
    ("4.54 - 4.55: an expert-parallel plan alone", dict(_tp_size=2, _device_mesh=_Mesh(2), _tp_plan=_EP_ONLY), None),
    ("4.52 - 4.53", dict(_device_mesh=_Mesh(2), hooked=True, dtensor=2), "model._device_mesh of 2 ranks"),
    ("4.52 - 4.53: one rank", dict(_device_mesh=_Mesh(1), hooked=True, dtensor=1), None),
    ("4.50 - 4.51", dict(hooked=True, dtensor=2), "marked _is_hooked"),
    ("4.51: an all-local plan", dict(hooked=True), "marked _is_hooked"),
    ("4.50 - 4.51: one rank", dict(hooked=True, dtensor=1), None),
    ("4.47 - 4.49", dict(distributed=True, dtensor=2), "marked _distribute_module_applied"),
    ("torch's mark, nothing sharded", dict(distributed=True, dtensor=2, placement=Replicate()), None),
    ("FSDP2 (fully_shard)", dict(dtensor=2), None),
    ("a declared plan, no load", {}, None),
])
def test_each_releases_mark_is_found(releases, marks, found):
    model = _tiny(records_its_load="_tp_size" in marks or "_device_mesh" in marks)
    assert _declares_a_plan(model.config), "Llama declares a tensor-parallel plan"
    _set(model, **marks)
    mark = tensor_parallelism(model)
    kinds = [f.kind for f in audit(model)]
    if found is None:
        assert mark is None, f"{releases}: {marks} is not tensor parallelism, found {mark!r}"
        assert "tensor-parallel" not in kinds
    else:
        assert mark is not None and found in mark, f"{releases}: {marks} gave {mark!r}"
        first = audit(model)[0]
        assert first.kind == "tensor-parallel" and found in first.reason, first


def test_a_nested_model_is_found():
    """The degree is recorded on the model ``from_pretrained`` returned, wherever the given module holds it."""
    outer = torch.nn.ModuleDict({"inner": _tiny(records_its_load=True)})
    _set(outer["inner"], _tp_size=2, _device_mesh=_Mesh(2))
    assert "model.inner._tp_size=2" in tensor_parallelism(outer)


def test_expert_parallelism_wins_and_the_message_names_both():
    """An expert-parallel load that split the attention too (5.19 on: ``ep_size == tp_size``; an expert-parallel plan
    with column-split attention, Llama 4's form, which 4.56 - 5.9 answer as ``model.tp_plan`` under EP)."""
    model = _tiny(records_its_load=True)
    model.config.distributed_config = types.SimpleNamespace(ep_size=2, tp_size=2, enable_expert_parallel=True)
    findings = audit(model)
    assert [f.kind for f in findings][:1] == ["expert-parallel"] and "tensor parallelism too" not in findings[0].reason
    model._ep_plan = {"model.layers.*.self_attn.q_proj": "colwise", "model.layers.*.mlp.experts": "grouped_gemm"}
    _set(model, _tp_size=2, _device_mesh=_Mesh(2), hooked=True)
    findings = audit(model)
    kinds = [f.kind for f in findings]
    assert kinds[0] == "expert-parallel" and "tensor-parallel" not in kinds, kinds
    assert "split its weights by tensor parallelism too (model._tp_size=2" in findings[0].reason
    assert "ep_size=1" in findings[0].fix and "no tp_plan, tp_size=1" in findings[0].fix


def test_a_model_loaded_without_tensor_parallelism_is_not_refused(tmp_path):
    _tiny().save_pretrained(tmp_path)
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    assert _declares_a_plan(model.config) and tensor_parallelism(model) is None
    assert not [f for f in audit(model) if f.kind in ("tensor-parallel", "expert-parallel")]


# ------------------------------------------------------------------------------------------ the world

def _tensor_parallel(directory, world):
    """This rank's Llama loaded with ``tp_plan="auto"`` (5.17 on warn that the argument moved into
    ``DistributedConfig``; it still loads)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model = transformers.LlamaForCausalLM.from_pretrained(directory, tp_plan="auto")
    weight = model.model.layers[0].self_attn.q_proj.weight
    local = weight.to_local() if hasattr(weight, "to_local") else weight
    assert local.shape[0] == HIDDEN // world, f"the load did not split q_proj: {tuple(local.shape)}"
    return model


def _fsdp_alone(directory, world):
    """From 5.17: FSDP2 by transformers' own load, a device mesh and ``_tp_size=1``; None before."""
    if RELEASE < Version("5.17.0"):
        return None
    from transformers.distributed.configuration_utils import DistributedConfig

    return transformers.LlamaForCausalLM.from_pretrained(directory, distributed_config=DistributedConfig(
        fsdp_size=world))


def _assert_named(error, mark):
    assert isinstance(error, UnsupportedModel) and error.kind == "tensor-parallel", error
    text = str(error)
    for part in ("loaded it with tensor parallelism", mark, "this rank's heads only", "not orthogonal to the TP group",
                 "Fix: load the model without tensor parallelism", "FSDP2", "on_unsupported='fallback'"):
        assert part in text, f"{part!r} not in: {text}"


def _world(rank, world, directory, with_enable):
    plain = transformers.LlamaForCausalLM.from_pretrained(directory)   # a declared plan: not refused
    model = _tensor_parallel(directory, world)
    mark = tensor_parallelism(model)
    assert mark is not None, "a tensor-parallel load left no mark"
    message = assert_refused_everywhere(plain, model, lambda error: _assert_named(error, mark), "tensor parallelism",
                                        world, with_enable)
    sharded = _fsdp_alone(directory, world)
    if sharded is not None:
        assert sharded._device_mesh is not None and sharded._tp_size == 1 and tensor_parallelism(sharded) is None
        assert not [f for f in audit(sharded) if f.kind in ("tensor-parallel", "expert-parallel")]
    return message


def test_tensor_parallelism_is_refused_by_name_on_2_ranks(tmp_path):
    if RELEASE < Version("4.47.0"):
        pytest.skip(f"transformers {transformers.__version__} has no tensor parallelism (tp_plan: 4.47 on)")
    if requirements.installed("accelerate") is None:
        pytest.skip("a tensor-parallel from_pretrained needs accelerate (a device map or low-CPU-memory loading), "
                    "which this env lacks; each release's marks are read by the tests above")
    _tiny().save_pretrained(tmp_path)
    messages = run_world(2, _world, str(tmp_path), enable_runs_here())
    print(f"transformers {transformers.__version__}: {messages[0]}")
