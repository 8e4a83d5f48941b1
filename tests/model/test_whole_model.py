"""Whole-model correctness under ``hfpatch.apply(model=)``: what is refused before training (``model_audit``), the
whole-model probe (``model_probe``), and ``model(..., labels=...)`` (``hfpatch.model.labels``), on real HF model classes
(tiny, random weights, fp32) over 2 gloo ranks.

Every refusal test checks the named error's fields (module path, class, kind) and that nothing is left installed.
The labels tests compare the CP loss and the gradients summed over the ranks with the non-CP run of the same model
on the whole batch (ring_kernels.tolerances' fp32 "cp" entries for the loss and every gradient, as the e2e tests).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import hfpatch
from _dist import run_world
from hfpatch.cli.demo_models import build_model
from hfpatch.errors import ModelDivergence, UnsupportedArgument, UnsupportedModel, VerificationError
from hfpatch.undo import is_wrapper
from hfpatch.inputs import IGNORE_INDEX, shift_labels
from hfpatch.model import heads as model_heads
from hfpatch.model import probe as model_probe
from hfpatch.model import router_loss
from hfpatch.model.audit import audit
from hfpatch.release.sweep.catalog import flash_causal_lm_classes
from hfpatch.release.sweep.run import check_class
from ring_kernels.tolerances import assert_close, tolerance

LOSS = tolerance("cp", torch.float32, "loss")
GRAD = tolerance("cp", torch.float32, "grad")
SEQ = 32


def _lfm2(**overrides):
    import transformers

    config = transformers.Lfm2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2,
                                     layer_types=["conv", "full_attention"], **overrides)
    torch.manual_seed(0)
    model = transformers.Lfm2ForCausalLM(config)
    _unknown_to_the_mixer_registry(model.model.layers[0].conv)
    return model


def _unknown_to_the_mixer_registry(module):
    """Stand-in for a mixer whose code hfpatch's mixer registry has not read (another release's forward): the
    same class name and computation, a forward of its own, so the audit refuses it by name."""
    base = type(module)

    def forward(self, *args, **kwargs):
        return base.forward(self, *args, **kwargs)

    module.__class__ = type(base.__name__, (base,), {"forward": forward, "__module__": base.__module__})


def _bart():
    """A Bart decoder whose position module hfpatch does not recognise: a user's subclass of Bart's (same name,
    defined here), which hfpatch.model.positions does not feed, so its positions stay from the input's length."""
    import transformers

    config = transformers.BartConfig(vocab_size=128, d_model=64, decoder_layers=2, encoder_layers=2,
                                     decoder_attention_heads=4, encoder_attention_heads=4, decoder_ffn_dim=64,
                                     encoder_ffn_dim=64, dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(0)
    model = transformers.BartForCausalLM(config)
    positions = model.model.decoder.embed_positions
    positions.__class__ = type("BartLearnedPositionalEmbedding", (type(positions),), {})
    return model


class _TokenCumsum(torch.nn.Module):
    """An MLP wrapper that also mixes tokens (a running sum along the sequence): no rule of model_audit knows it,
    so only the whole-model probe can catch it."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x) + 0.1 * x.cumsum(dim=1)


def _nothing_installed():
    import transformers.modeling_flash_attention_utils as mfau

    assert hfpatch.active_patch() is None
    assert not is_wrapper(mfau._flash_attention_forward)


# ------------------------------------------------------------------------------------ audit (one process)


def test_audit_finds_nothing_in_a_plain_decoder():
    assert audit(build_model("llama")) == []
    assert audit(build_model("mixtral")) == []


def _needs_lfm2():
    import transformers

    if not hasattr(transformers, "Lfm2Config"):
        pytest.skip("Lfm2 (a short-conv hybrid) exists from transformers 4.54")


def test_audit_names_every_mixer_layer_and_its_class():
    _needs_lfm2()
    model = _lfm2()
    findings = audit(model)
    assert [(f.path, f.module_class, f.kind) for f in findings] == [
        ("model.layers.0.conv", "Lfm2ShortConv", "sequence-mixer")]
    assert "zero state" in findings[0].reason and "on_unsupported='fallback'" in findings[0].fix


def test_audit_finds_an_unnamed_convolution_structurally():
    """A Conv1d in a module whose class name no pattern knows is still a finding, at the convolution's path."""
    model = build_model("llama")
    model.model.layers[0].token_conv = torch.nn.Conv1d(64, 64, 4, groups=64, padding=3)
    findings = audit(model)
    assert [(f.path, f.module_class, f.kind) for f in findings] == [
        ("model.layers.0.token_conv", "Conv1d", "sequence-mixer")]


def test_audit_positions_from_the_input_length():
    findings = audit(_bart())
    assert [(f.path, f.kind) for f in findings] == [("model.decoder.embed_positions", "positions")]
    assert findings[0].module_class == "BartLearnedPositionalEmbedding"
    assert "takes no position_ids" in findings[0].reason


def test_audit_router_aux_loss(monkeypatch):
    """A load-balancing loss hfpatch has read is made the group's (no finding); one it has not is refused."""
    model = build_model("mixtral", output_router_logits=True)
    assert audit(model) == []
    monkeypatch.setattr(router_loss, "READ", {})
    router_loss.recognise_class.cache_clear()
    try:
        findings = audit(model)
    finally:
        router_loss.recognise_class.cache_clear()
    assert [f.kind for f in findings] == ["router-aux-loss"]
    assert "not a load-balancing loss hfpatch has read" in findings[0].reason


def test_verify_argument_is_validated():
    with pytest.raises(TypeError, match="'fast'"):
        hfpatch.apply(None, verify="full")


# ------------------------------------------------------------------------------------ 2 ranks


def _refusals(rank, world):
    import transformers

    group = dist.group.WORLD
    has_lfm2 = hasattr(transformers, "Lfm2Config")
    if has_lfm2:
        with pytest.raises(UnsupportedModel) as info:
            hfpatch.apply(group, model=_lfm2())
        assert (info.value.module_path, info.value.module_class, info.value.kind) == \
            ("model.layers.0.conv", "Lfm2ShortConv", "sequence-mixer")
        assert "model.layers.0.conv (Lfm2ShortConv)" in str(info.value) and "Fix:" in str(info.value)
        _nothing_installed()

    with pytest.raises(UnsupportedModel) as info:
        hfpatch.apply(group, model=_bart())
    assert info.value.kind == "positions" and info.value.module_path == "model.decoder.embed_positions"
    _nothing_installed()

    # the probe: a token-mixing module no rule knows, named by the probe
    model = build_model("llama")
    model.model.layers[1].mlp = _TokenCumsum(model.model.layers[1].mlp)
    with pytest.raises(ModelDivergence) as info:
        hfpatch.apply(group, model=model)
    assert info.value.module_path == "model.layers.1.mlp" and info.value.module_class == "_TokenCumsum"
    assert info.value.error > info.value.tolerance
    assert model.training, "the probe must restore the training flags"
    _nothing_installed()
    # verify='fast' skips the whole-model probe (and only it)
    patch = hfpatch.apply(group, model=model, verify="fast")
    assert patch.active
    patch.remove()

    # fallback: inactive with the reason; the shard_inputs labels still give the plain non-CP loss (the model's own
    # loss on the caller's labels, whatever its convention: Lfm2 shifts, Bart does not)
    model = _lfm2() if has_lfm2 else _bart()
    mixer = "Lfm2ShortConv" if has_lfm2 else "BartLearnedPositionalEmbedding"
    patch = hfpatch.apply(group, model=model, on_unsupported="fallback")
    assert not patch.active and mixer in patch.reason
    ids = torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(3))
    batch = patch.shard_inputs(ids, labels=ids)
    loss = model(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False).loss
    expected = model(input_ids=ids, labels=ids, use_cache=False).loss  # the non-CP loss, without hfpatch's hook
    patch.remove()
    assert_close(loss, expected, LOSS, "fallback loss")

    # a probe divergence with on_unsupported='fallback' falls back too
    model = build_model("llama")
    model.model.layers[0].mlp = _TokenCumsum(model.model.layers[0].mlp)
    patch = hfpatch.apply(group, model=model, on_unsupported="fallback")
    assert not patch.active and "model.layers.0.mlp" in patch.reason
    patch.remove()
    _nothing_installed()

    # an error of the probe's own code (seeded: drawing the probe's labels) is a named refusal, never a raw
    # AttributeError, and on_unsupported='fallback' honours it
    probe_labels = model_heads.probe_labels

    def broken(model, rows, generator):
        raise AttributeError("seeded error in the probe's own code")

    model_heads.probe_labels = broken
    try:
        with pytest.raises(VerificationError, match=r"whole-model probe: checking LlamaForCausalLM failed "
                                                    r"\(AttributeError: seeded error in the probe's own code\)"):
            hfpatch.apply(group, model=build_model("llama"))
        _nothing_installed()
        patch = hfpatch.apply(group, model=build_model("llama"), on_unsupported="fallback")
        assert not patch.active and "seeded error in the probe's own code" in patch.reason
        patch.remove()
    finally:
        model_heads.probe_labels = probe_labels
    _nothing_installed()


def _reference(model_name, ids, **forward):
    """Non-CP loss of ``model(ids, labels=ids)`` (HF's own loss) and the gradients, eager, whole batch."""
    model = build_model(model_name)
    loss = model(input_ids=ids, labels=ids, use_cache=False, **forward).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _summed_grads(model):
    grads = {}
    for name, p in model.named_parameters():
        g = (p.grad if p.grad is not None else torch.zeros_like(p)).clone()
        dist.all_reduce(g)
        grads[name] = g
    return grads


def _assert_equal(label, loss, grads, ref_loss, ref_grads):
    assert_close(loss, ref_loss, LOSS, f"{label}: CP loss {loss.item():.8f} vs non-CP {ref_loss.item():.8f}")
    for name, ref in ref_grads.items():
        assert_close(grads[name], ref, GRAD, f"{label}: gradient of {name}")


def _labels(rank, world):
    group = dist.group.WORLD
    ids = torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(7))
    for name in ("llama", "mixtral"):
        ref_loss, ref_grads = _reference(name, ids)
        model = build_model(name)
        with hfpatch.apply(group, model=model) as patch:
            batch = patch.shard_inputs(ids, labels=ids)
            out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"],
                        use_cache=False)
            assert type(out).__name__.startswith(("CausalLMOutput", "MoeCausalLMOutput")) and out.loss is out[0]
            out.loss.backward()
            _assert_equal(f"{name} labels=", out.loss.detach(), _summed_grads(model), ref_loss, ref_grads)

            # num_items_in_batch: the count over the whole batch, as the non-CP run (and HF's Trainer) counts it
            model.zero_grad(set_to_none=True)
            n_items = int((shift_labels(ids) != IGNORE_INDEX).sum()) + 5
            loss = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"],
                         num_items_in_batch=n_items, use_cache=False).loss
            want = ref_loss * (n_items - 5) / n_items
            assert_close(loss, want, LOSS, "num_items_in_batch loss")

            # transformers' own shift_labels= (already shifted by the caller), return_dict=False
            model.zero_grad(set_to_none=True)
            mine = batch["labels"].clone()  # an equal copy: not recognised as labels=, accepted as shift_labels=
            out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], shift_labels=mine,
                        use_cache=False, return_dict=False)
            out[0].backward()
            _assert_equal(f"{name} shift_labels=", out[0].detach(), _summed_grads(model), ref_loss, ref_grads)

            # anything else as labels= is refused by name, never shifted again silently
            with pytest.raises(UnsupportedArgument) as info:
                model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=mine, use_cache=False)
            assert info.value.parameter == "labels" and "shard_inputs" in info.value.fix
    # a model whose own loss is not the causal-LM cross-entropy (here: an extra term) has its labels refused under
    # CP, with the whole-model probe's reason; its forward without labels still runs the ring
    model = build_model("llama")

    def extra_term(module, args, output):
        if getattr(output, "loss", None) is not None:
            output["loss"] = output.loss + 1.0
        return output

    model.register_forward_hook(extra_term)
    with hfpatch.apply(group, model=model) as patch:
        assert patch.labels_refusal is not None and "own loss" in patch.labels_refusal
        batch = patch.shard_inputs(ids, labels=ids)
        with pytest.raises(UnsupportedArgument) as info:
            model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"],
                  use_cache=False)
        assert info.value.parameter == "labels" and "own loss" in info.value.reason
        model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)

    model = build_model("mixtral")
    with hfpatch.apply(group, model=model) as patch, pytest.MonkeyPatch.context() as mp:
        assert patch.labels_refusal is None
        batch = patch.shard_inputs(ids, labels=ids)
        # a load-balancing loss hfpatch has read is the group's (tests/model/test_router_loss.py); one it has
        # not, refused
        mp.setattr(router_loss, "READ", {})
        router_loss.recognise_class.cache_clear()
        try:
            with pytest.raises(UnsupportedArgument) as info:
                model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"],
                      output_router_logits=True, use_cache=False)
        finally:
            router_loss.recognise_class.cache_clear()
        assert info.value.parameter == "output_router_logits"


def _gpt2_fp32(rank, world):
    """GPT-2 projects with transformers' Conv1D (no nn.Linear): its fp32 flash path trains exactly under CP where
    transformers' integration has ``get_target_dtype`` (hfpatch guards the lookup), and is refused by name on the
    releases that look the dtype up inline (4.48 until then), where the flash path fails before any attention."""
    import importlib

    entries = [e for e in flash_causal_lm_classes() if e.class_name == "GPT2LMHeadModel"]
    if not entries:
        return None
    try:
        integration = importlib.import_module("transformers.integrations.flash_attention")
    except ImportError:
        integration = None
    inline_lookup = integration is not None and not hasattr(integration, "get_target_dtype")
    verdict = check_class(entries[0], dist.group.WORLD)
    if inline_lookup:
        assert verdict.verdict == "refused" and "UnsupportedArgument: model" in verdict.detail, verdict
    else:
        assert verdict.verdict == "exact", verdict
    return verdict.verdict


def _probe_over_a_group_without_cpu_transport(rank, world):
    """A model still on the CPU with a CP group that cannot exchange CPU tensors (NCCL; stood in for here by
    declaring the gloo group so): the probe runs over a gloo group of the same ranks made for it, destroyed after,
    and the patch keeps the CP group."""
    made = []
    new_group = dist.new_group

    def recording_new_group(*args, **kwargs):
        made.append(kwargs.get("backend"))
        return new_group(*args, **kwargs)

    capable, model_probe.cpu_capable = model_probe.cpu_capable, lambda group: False
    dist.new_group = recording_new_group
    try:
        patch = hfpatch.apply(dist.group.WORLD, model=build_model("llama"))
    finally:
        model_probe.cpu_capable, dist.new_group = capable, new_group
    assert made == ["gloo"] and patch.probe is not None and patch.probe.worst < 1e-4
    assert patch.ctx.group is dist.group.WORLD
    patch.remove()
    assert capable(dist.group.WORLD)   # gloo exchanges CPU tensors


def _world(rank, world):
    _refusals(rank, world)
    _labels(rank, world)
    _probe_over_a_group_without_cpu_transport(rank, world)
    return _gpt2_fp32(rank, world)


def test_whole_model_2_ranks():
    run_world(2, _world)
