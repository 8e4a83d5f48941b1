"""hfpatch.apply over a real 2-rank gloo group: a Llama built from its config runs every attention layer through
the ring (counted), remove() restores everything, a second apply/remove is refused, failures (2nd site, numeric
probe) leave nothing behind, an unsupported signature raises with a diff or falls back, the switch routes calls,
a DeviceMesh works. All cases share one world (start-up is the expensive part)."""
from __future__ import annotations

import importlib
import inspect
import logging
import os
import sys
import textwrap
import types

import pytest
import torch

import hfpatch
from _dist import run_world
from hfpatch import active_patch, version_gates
from hfpatch.cli import demo_models
from hfpatch.attention import patcher, plan
from hfpatch.errors import (AlreadyRemoved, PatchError, SignatureMismatch, UnsupportedArgument, UnsupportedRelease,
                            VerificationError)
from hfpatch.model.routing import route_model
from hfpatch.signatures import registry
from ring_kernels.tolerances import assert_close, tolerance

LOGITS = tolerance("cp", torch.float32, "out")
MFAU = "transformers.modeling_flash_attention_utils"
INTEG = "transformers.integrations.flash_attention"
NAME = "_flash_attention_forward"


# ------------------------------------------------------------------------------------------- helpers


def _tiny_llama(attn="eager"):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=128, attn_implementation=attn)
    torch.manual_seed(0)  # identical weights on every rank
    return LlamaForCausalLM(config).eval()


def _binding_modules():
    """The modules that bind the function on the installed release: the defining module, INTEG (4.48+), and the
    llama modeling module (a from-import in 4.43-4.47; ALL_ATTENTION_FUNCTIONS afterwards)."""
    modules = []
    for name in (MFAU, INTEG, "transformers.models.llama.modeling_llama"):
        try:
            module = importlib.import_module(name)
        except ImportError:  # INTEG before 4.48
            continue
        if NAME in module.__dict__:
            modules.append(module)
    return modules


def _bindings():
    return tuple(module.__dict__[NAME] for module in _binding_modules())


def _all_bound_to(fn):
    return all(value is fn for value in _bindings())


def _assert_untouched(original, model=None):
    assert _all_bound_to(original)
    assert not any(isinstance(f, patcher.RebindFinder) for f in sys.meta_path)
    assert active_patch() is None
    if model is not None:
        assert model.config._attn_implementation == "eager"


def _fake_original(real):
    """A stand-in for flash-attn's path with the real signature (flash-attn is not installed on CPU): plain
    attention on the local tensors only, counting its calls."""
    signature = inspect.signature(real)
    calls = []

    def _flash_attention_forward(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        q, k, v = (bound.arguments[n] for n in ("query_states", "key_states", "value_states"))
        calls.append(q.shape)
        groups = q.shape[2] // k.shape[2]
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(groups, 1),
            v.transpose(1, 2).repeat_interleave(groups, 1), is_causal=bound.arguments["is_causal"])
        return out.transpose(1, 2)

    _flash_attention_forward.__signature__ = signature
    return _flash_attention_forward, calls


def _set_bindings(fn):
    """Bind ``fn`` wherever the currently bound function is bound (every release's set of modules)."""
    current = _bindings()[0]
    for module in list(sys.modules.values()):
        if isinstance(module, types.ModuleType):
            for key, value in list(module.__dict__.items()):
                if value is current:
                    setattr(module, key, fn)


def _ring_forward(patch, model, ids):
    batch = patch.shard_inputs(ids)
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    return logits, batch["position_ids"][0]


# --------------------------------------------------------------------------------------------- cases


def _case_llama_every_layer(group, late_dir):
    original = _bindings()[0]
    model = _tiny_llama()
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits

    patch = hfpatch.apply(group, model=model)
    assert patch.active and patch.reason is None and hfpatch.active_patch() is patch
    assert patch.signature_id == registry.match(inspect.signature(original)).id
    assert patch.sites[:1] == [f"{MFAU}.{NAME}"]
    assert {f"{m.__name__}.{NAME}" for m in _binding_modules()} <= set(patch.sites)
    wrapper = _bindings()[0]
    assert wrapper is not original and wrapper.__wrapped__ is original and _all_bound_to(wrapper)
    assert "def _flash_attention_forward(" in patch.wrapper_source()
    assert model.config._attn_implementation == "flash_attention_2"
    assert patch.calls == {} and patch.mode_calls == {}  # the numeric probe is not counted

    with torch.no_grad():
        logits, positions = _ring_forward(patch, model, ids)
    assert_close(logits, expected[:, positions], LOGITS, "ring logits")
    assert patch.calls == {0: 1, 1: 1} and patch.layers_seen() == [0, 1]
    assert patch.unpatched_layers(model) == []
    with torch.no_grad():
        _ring_forward(patch, model, ids)
    assert patch.calls == {0: 2, 1: 2} and patch.layers_seen() == [0, 1]

    # reference mode: all-gathered plain attention, same numbers, counted as reference (not ring)
    with hfpatch.switch("reference"), torch.no_grad():
        ref_logits, _ = _ring_forward(patch, model, ids)
    assert_close(ref_logits, logits, LOGITS, "reference-mode logits")
    assert patch.mode_calls["reference"] == 2 and patch.calls == {0: 2, 1: 2}
    assert [u["name"] for u in patch.unpatched_layers(model)] == ["model.layers.0.self_attn",
                                                                  "model.layers.1.self_attn"]

    # A model left on sdpa never reaches the wrapper: Patch names its layers.
    other = _tiny_llama("sdpa")
    patch.track(other)
    with torch.no_grad():
        other(ids, use_cache=False)
    assert patch.layers_seen() == []
    assert patch.unpatched_layers(other) == [
        {"name": f"model.layers.{i}.self_attn", "class": type(other.model.layers[i].self_attn).__name__,
         "attn_implementation": "sdpa"}
        for i in range(2)
    ]

    # second apply while active: refused, naming the active patch
    with pytest.raises(PatchError, match=r"already applied.*remove\(\) first"):
        hfpatch.apply(group)

    # a module imported after apply gets the wrapper, and gets the original back on remove
    sys.path.insert(0, late_dir)
    try:
        late = importlib.import_module("hfpatch_late_binder")
    finally:
        sys.path.remove(late_dir)
    assert late._flash_attention_forward is wrapper and "hfpatch_late_binder._flash_attention_forward" in patch.sites

    patch.remove()
    _assert_untouched(original, model)
    assert late._flash_attention_forward is original
    assert patch.sites == []
    with pytest.raises(PatchError, match="already removed"):
        patch.remove()
    with pytest.raises(PatchError, match="removed"):
        patch.shard_inputs(ids)
    with torch.no_grad():
        torch.testing.assert_close(model(ids, use_cache=False).logits, expected)


def _case_class_table_model(group):
    """Falcon picks its attention class at construction from FALCON_ATTENTION_CLASSES (every release through
    5.23) and imports _flash_attention_forward only when flash-attn is installed: model= swaps the classes and
    injects the binding, and remove() undoes both."""
    from transformers import FalconConfig, FalconForCausalLM
    from transformers.models.falcon import modeling_falcon

    if "position_ids" not in inspect.signature(modeling_falcon.FalconRotaryEmbedding.forward).parameters:
        # 4.43-4.44 Falcon builds its rotary table from the LOCAL length (forward(x, seq_len)), so the global
        # position ids of a shard index past it: a limitation of that model under CP, not of the patch. The class
        # swap itself is covered there by the Llama case (Llama also picks its class from a table before 4.48).
        return
    config = FalconConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=128,
                          new_decoder_architecture=True, num_kv_heads=2, attn_implementation="eager")
    torch.manual_seed(0)
    model = FalconForCausalLM(config).eval()
    modeling = sys.modules[type(model).__module__]
    had_binding = NAME in modeling.__dict__
    classes = [type(layer.self_attention) for layer in model.transformer.h]
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits
    with hfpatch.apply(group, model=model) as patch:
        assert all("FlashAttention2" in type(layer.self_attention).__name__ for layer in model.transformer.h)
        with torch.no_grad():
            logits, positions = _ring_forward(patch, model, ids)
        assert_close(logits, expected[:, positions], LOGITS, "ring logits")
        assert patch.calls == {0: 1, 1: 1} and patch.unpatched_layers(model) == []
        assert any(site.startswith(modeling.__name__) for site in patch.sites)
    assert [type(layer.self_attention) for layer in model.transformer.h] == classes
    assert (NAME in modeling.__dict__) == had_binding
    if had_binding:
        assert modeling.__dict__[NAME] is _bindings()[0]
    assert model.config._attn_implementation == "eager"


def _case_context_manager(group):
    original = _bindings()[0]
    with pytest.raises(RuntimeError, match="inside the block"):
        with hfpatch.apply(group, verify=False) as patch:
            assert _bindings()[0] is not original
            raise RuntimeError("inside the block")
    _assert_untouched(original)
    assert patch.removed


def _case_failures_leave_nothing(group):
    original = _bindings()[0]
    model = _tiny_llama()

    # numeric probe: a ring that returns wrong numbers (on rank 1 only: every rank must still refuse)
    rank = torch.distributed.get_rank(group)
    with pytest.MonkeyPatch.context() as mp:
        for name, real in plan.KERNELS.items():
            mp.setitem(plan.KERNELS, name, lambda *a, real=real, **kw: real(*a, **kw) * (1.0 + rank))
        with pytest.raises(VerificationError, match="numeric probe"):
            hfpatch.apply(group, model=model)
    _assert_untouched(original, model)

    # a wrapper that raises inside the probe (e.g. a kernel error) is a VerificationError too
    def broken(*args, **kwargs):
        raise RuntimeError("kernel exploded")

    with pytest.MonkeyPatch.context() as mp:
        for name in plan.KERNELS:
            mp.setitem(plan.KERNELS, name, broken)
        with pytest.raises(VerificationError, match="kernel exploded"):
            hfpatch.apply(group)
    _assert_untouched(original)

    # a failure after the install on one rank only (its model has no flash path): all ranks refuse

    rank = torch.distributed.get_rank(group)
    odd_model = torch.nn.Linear(2, 2) if rank == 1 else model
    odd_model.config = model.config if rank == 0 else types.SimpleNamespace(to_dict=dict)
    with pytest.raises(UnsupportedArgument if rank == 1 else VerificationError):
        hfpatch.apply(group, model=odd_model)
    _assert_untouched(original, model)

    # failure while swapping the 2nd site, on every rank, then on rank 1 only (rank 0 had installed: it removes)
    real_set = patcher.Site.set
    for failing_ranks in ((0, 1), (1,)):
        count = []

        def failing_set(site, value):
            count.append(site.label)
            if len(count) == 2 and rank in failing_ranks:
                raise OSError("injected failure at the 2nd site")
            real_set(site, value)

        patcher.Site.set = failing_set
        try:
            expected = (PatchError, "2nd site") if rank in failing_ranks else (VerificationError, "another rank")
            with pytest.raises(expected[0], match=expected[1]):
                hfpatch.apply(group, model=model)
        finally:
            patcher.Site.set = real_set
        _assert_untouched(original, model)


def _case_switch_original_via_env(group):
    real = _bindings()[0]
    fake, fake_calls = _fake_original(real)
    _set_bindings(fake)
    os.environ["RING_ATTN_SWITCH"] = "0"
    model = _tiny_llama()
    ids = torch.randint(0, 128, (1, 32), generator=torch.Generator().manual_seed(2))
    try:
        patch = hfpatch.apply(group, model=model)  # the probe runs the ring whatever the switch says
        assert hfpatch.current_mode() == "original" and fake_calls == []
        patch._dispatcher.original_runs = lambda call: True  # the fake stands in for a flash path that runs here
        with torch.no_grad():
            local, _ = _ring_forward(patch, model, ids)
        assert len(fake_calls) == 2 and patch.mode_calls == {"original": 2} and patch.calls == {}
        assert patch.layers_seen() == [] and len(patch.unpatched_layers(model)) == 2
        with hfpatch.switch("1"), torch.no_grad():
            ring, _ = _ring_forward(patch, model, ids)
        assert len(fake_calls) == 2 and patch.calls == {0: 1, 1: 1}
        # the original on local shards is not CP attention: the ring result differs from it
        assert not torch.allclose(local, ring, atol=1e-3)
        patch.remove()
        assert hfpatch.current_mode() == "ring"  # the default from before apply is back
        assert _all_bound_to(fake)
    finally:
        del os.environ["RING_ATTN_SWITCH"]
        _set_bindings(real)


def _case_unsupported(group):
    from packaging.version import Version

    real = _bindings()[0]

    def _flash_attention_forward(query_states, key_states, value_states, attention_mask, is_causal, **kwargs):
        raise AssertionError("never called")

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("hfpatch")
    logger.addHandler(handler)
    _set_bindings(_flash_attention_forward)
    try:
        with pytest.raises(SignatureMismatch) as info:
            hfpatch.apply(group)
        assert info.value.diff and "query_length" in info.value.diff and info.value.expected
        assert _bindings()[0] is _flash_attention_forward
        patch = hfpatch.apply(group, on_unsupported="fallback")
        assert not patch.active and "unsupported" in patch.reason
        assert _all_bound_to(_flash_attention_forward)
        warnings = [r for r in records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "not active" in warnings[0].getMessage()
    finally:
        _set_bindings(real)
        logger.removeHandler(handler)

    # Only one rank cannot patch: every rank must end up doing the same thing (never a hang, never a mix).
    rank = torch.distributed.get_rank(group)
    if rank == 1:
        _set_bindings(_flash_attention_forward)
    try:
        with pytest.raises(SignatureMismatch if rank == 1 else PatchError, match="" if rank else "another rank"):
            hfpatch.apply(group)
        patch = hfpatch.apply(group, on_unsupported="fallback")
        assert not patch.active and ("unsupported" if rank == 1 else "another rank") in patch.reason
    finally:
        _set_bindings(real)
    _assert_untouched(real)

    real_version = version_gates.installed_transformers_version
    version_gates.installed_transformers_version = lambda: Version("4.42.4")
    try:
        with pytest.raises(UnsupportedRelease, match="4.42.4"):
            hfpatch.apply(group)
        assert not hfpatch.apply(group, on_unsupported="fallback").active
    finally:
        version_gates.installed_transformers_version = real_version
    _assert_untouched(real)


def _case_groups_and_kernels(rank, world_size):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    original = _bindings()[0]
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    with hfpatch.apply(mesh) as patch:
        assert patch.active and patch.ctx.world_size == world_size and patch.ctx.group is mesh.get_group()
    for kernel in ("zigzag", "ring:reference", "stripe", "llama3"):
        with hfpatch.apply(dist.group.WORLD, kernel=kernel) as patch:  # the numeric probe passes for each
            assert patch.ctx.variant == kernel.split(":")[0]
    singles = [dist.new_group([r]) for r in range(world_size)]  # every rank creates every group
    patch = hfpatch.apply(singles[rank])
    assert not patch.active and "single rank" in patch.reason
    _assert_untouched(original)


def _apply_cases(rank, world_size, late_dir):
    import torch.distributed as dist

    group = dist.group.WORLD
    _case_llama_every_layer(group, late_dir)
    _case_class_table_model(group)
    _case_context_manager(group)
    _case_failures_leave_nothing(group)
    _case_switch_original_via_env(group)
    _case_unsupported(group)
    _case_groups_and_kernels(rank, world_size)


def test_apply_on_two_ranks(tmp_path):
    (tmp_path / "hfpatch_late_binder.py").write_text(textwrap.dedent("""
        from transformers.modeling_flash_attention_utils import _flash_attention_forward
    """))
    run_world(2, _apply_cases, str(tmp_path), timeout=240)


# ------------------------------------------------------------------------ argument validation (no group)


def test_bad_arguments_are_refused_before_anything():
    with pytest.raises(ValueError, match="on_unsupported='ignore'"):
        hfpatch.apply(on_unsupported="ignore")
    with pytest.raises(ValueError, match="kernel='flash'"):
        hfpatch.apply(kernel="flash")
    with pytest.raises(TypeError, match=r"cp_group=int .*ProcessGroup.*DeviceMesh"):
        hfpatch.apply(3)
    with pytest.raises(TypeError, match="verify="):
        hfpatch.apply(verify="yes")
    with pytest.raises(TypeError, match="model="):
        hfpatch.apply(model="llama")


def test_bad_switch_environment_is_refused_at_apply(monkeypatch):
    monkeypatch.setenv("RING_ATTN_SWITCH", "on")
    with pytest.raises(ValueError, match="RING_ATTN_SWITCH='on'"):
        hfpatch.apply()


def test_model_without_a_flash_path_is_refused_unchanged():
    class Config:
        _attn_implementation_internal = "eager"

        def to_dict(self):
            return {}

    class NoFlashModel(torch.nn.Module):
        _supports_flash_attn = False

        def __init__(self):
            super().__init__()
            self.config = Config()
            self.proj = torch.nn.Linear(4, 4)

    model = NoFlashModel()
    with pytest.raises(UnsupportedArgument) as info:
        route_model(model, lambda *a, **k: None)
    assert info.value.parameter == "model" and "no flash-attention path" in str(info.value)
    assert model.config._attn_implementation_internal == "eager"
    with pytest.raises(TypeError, match="model=Linear"):
        route_model(torch.nn.Linear(2, 2), lambda *a, **k: None)


def test_a_suspended_routing_runs_the_models_own_attention_then_routes_again():
    """``ModelRouting.suspended()`` (generation with a padding mask under CP): inside, the model's own attention
    (the flash path's function is never called) with the padding mask honoured, the same numbers as the model that
    was never routed; outside, routed again; removed, it refuses."""
    calls = []
    model, unrouted = (demo_models.build_model("llama", attn_implementation="sdpa") for _ in range(2))
    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [3, 4, 5, 6, 7, 8]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    routing = route_model(model, lambda *a, **k: calls.append(1))
    try:
        assert model.config._attn_implementation == "flash_attention_2"
        with torch.no_grad(), routing.suspended():
            assert model.config._attn_implementation == "sdpa"
            ours = model(input_ids=ids, attention_mask=mask).logits
        assert model.config._attn_implementation == "flash_attention_2" and not calls
        with torch.no_grad():
            theirs = unrouted(input_ids=ids, attention_mask=mask).logits
        assert torch.equal(ours[mask.bool()], theirs[mask.bool()])
    finally:
        routing.remove()
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(AlreadyRemoved):
        with routing.suspended():
            pass


# ------------------------------------------------------------------------------- GPU: NCCL, bf16 probe


def _cuda_apply_rank(rank, world):
    """One NCCL rank (``run_world(..., backend="nccl")`` put it on cuda:rank): the bf16 probe and a ring forward
    of a bf16 Llama on the GPUs, every layer through the ring, logits equal to the model's own."""
    import torch.distributed as dist

    model = _tiny_llama().to(device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, 128, (2, 256), generator=torch.Generator().manual_seed(5)).cuda()
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits.float()
    with hfpatch.apply(dist.group.WORLD, model=model) as patch:  # the probe runs in bf16 on the GPUs
        with torch.no_grad():
            logits, positions = _ring_forward(patch, model, ids)
        assert patch.calls == {0: 1, 1: 1} and patch.unpatched_layers(model) == []
    assert_close(logits.float(), expected[:, positions], tolerance("cp", torch.bfloat16, "out"), "bf16 logits")
    assert model.config._attn_implementation == "eager"


@pytest.mark.gpu
@pytest.mark.timeout(240)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_apply_on_two_gpus_nccl_bf16():
    run_world(2, _cuda_apply_rank, backend="nccl", timeout=180)
