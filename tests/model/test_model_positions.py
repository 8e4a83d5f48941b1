"""Positions from the input's length under CP (``hfpatch.model.positions``): every decoder class of the installed
release whose position module numbers tokens by the input's length (the BART family, Whisper, MusicGen) trains
exactly under ``hfpatch.apply(model=)`` on 2 gloo ranks -- batch (zigzag, contiguous ring, stripe) and packed
(llama3, zigzag) -- and a position module hfpatch does not recognise stays refused by name.

Each class is built tiny from its own config class (``hfpatch.release.sweep.tiny.build_tiny``, fp32, random weights). The
CP step is ``patch.shard_inputs`` -> ``model(...).logits`` -> ``token_loss_sum`` -> ``patch.reduce_loss``; the
non-CP step the same model on the whole batch in switch mode "local", with HF's one-token shift. Exact means the
sweep's rule (``hfpatch.release.sweep.run``): loss within ``LOSS_RTOL`` relative, every parameter's summed gradient within
``GRAD_RTOL`` of its largest entry (plus ``GRAD_FLOOR`` of the model's largest gradient). The loss is taken from
the logits, not from ``model(labels=)``: these classes' own loss does not shift the labels on every release,
which ``hfpatch.model.labels`` refuses under CP by name -- a separate matter from positions.
"""
from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist

import hfpatch
from _dist import run_world
from hfpatch.errors import UnsupportedArgument, UnsupportedModel
from hfpatch.undo import is_wrapper
from hfpatch.inputs import shift_labels, token_loss_sum
from hfpatch.model.audit import audit
from hfpatch.model.positions import recognise
from hfpatch.release.sweep.catalog import flash_causal_lm_classes
from hfpatch.release.sweep.run import GRAD_FLOOR, GRAD_RTOL, LOSS_RTOL
from hfpatch.release.sweep.tiny import build_tiny

FAMILY = ("BartForCausalLM", "MBartForCausalLM", "PLBartForCausalLM", "BlenderbotForCausalLM",
          "BlenderbotSmallForCausalLM", "MarianForCausalLM", "PegasusForCausalLM", "WhisperForCausalLM",
          "MusicgenForCausalLM", "MusicgenMelodyForCausalLM")
SEQ = 32
PACKED_DOCS = (16, 24, 24)  # every document a multiple of 2 x world size (zigzag varlen)
# case -> (kernel, packed, pass the position ids of shard_inputs to the model). Every class runs CASES; the
# representatives of each way positions are fed (hfpatch.model.positions.FEEDS: Bart's learned table by
# position_ids on 4.53+ and by past_key_values_length before, MusicGen's buffer by past_key_values_length,
# Whisper's owner taking position_ids) run every layout in LAYOUT_CASES too.
CASES = {"batch-zigzag": ("auto", False, True), "packed-llama3": ("auto", True, True)}
LAYOUT_CASES = {"batch-zigzag-no-position-ids": ("auto", False, False), "batch-ring": ("ring", False, False),
                "batch-stripe": ("stripe", False, False), "packed-zigzag": ("zigzag", True, True)}
REPRESENTATIVES = ("BartForCausalLM", "MusicgenForCausalLM", "WhisperForCausalLM")
# WhisperDecoder takes position_ids as a parameter of its own: they never reach its attention, so a packed row is
# refused by name (without CP its documents would attend to each other).
REFUSED = {("WhisperForCausalLM", "packed-llama3"), ("WhisperForCausalLM", "packed-zigzag")}
ALL_CASES = {**CASES, **LAYOUT_CASES}


def _entries():
    return {e.class_name: e for e in flash_causal_lm_classes() if e.class_name in FAMILY and e.importable}


def _takes_position_ids(model) -> bool:
    parameters = inspect.signature(model.forward).parameters.values()
    return any(p.name == "position_ids" or p.kind is p.VAR_KEYWORD for p in parameters)


def _inputs(packed: bool):
    generator = torch.Generator().manual_seed(7)
    if not packed:
        return torch.randint(0, 128, (2, SEQ), generator=generator), None
    positions = torch.cat([torch.arange(n) for n in PACKED_DOCS])[None]
    return torch.randint(0, 128, (1, positions.shape[1]), generator=generator), positions


def _non_cp(model, ids, positions):
    model.zero_grad(set_to_none=True)
    extra = {} if positions is None else {"position_ids": positions}
    with hfpatch.switch("local"):
        loss_sum, count = token_loss_sum(model(input_ids=ids, use_cache=False, **extra).logits, shift_labels(ids))
        loss = loss_sum / count
        loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _cp(patch, model, ids, positions, pass_positions):
    model.zero_grad(set_to_none=True)
    batch = patch.shard_inputs(ids, labels=ids, position_ids=positions)
    extra = {"position_ids": batch["position_ids"]} if pass_positions else {}
    loss_sum, count = token_loss_sum(model(input_ids=batch["input_ids"], use_cache=False, **extra).logits,
                                     batch["labels"])
    loss = patch.reduce_loss(loss_sum, count)
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            grads[name] = p.grad.clone()
            dist.all_reduce(grads[name])
    return loss.item(), grads


def _errors(loss, grads, loss_ref, grads_ref):
    """(relative loss error, worst gradient error as a multiple of its bound): the sweep's rule."""
    largest = max(g.abs().max().item() for g in grads_ref.values())
    worst = 0.0
    assert set(grads) == set(grads_ref)
    for name, ref in grads_ref.items():
        bound = GRAD_RTOL * ref.abs().max().item() + GRAD_FLOOR * largest
        worst = max(worst, (grads[name] - ref).abs().max().item() / bound)
    return abs(loss - loss_ref) / abs(loss_ref), worst


def _case_skip(model, packed: bool, pass_positions: bool):
    if (packed or pass_positions) and not _takes_position_ids(model):
        return (f"{type(model).__name__}.forward takes no position_ids (nor **kwargs) on this release: "
                + ("packed documents cannot be expressed to it" if packed else "nothing to pass"))
    if packed and not _uses_position_ids(model):
        return (f"{type(model).__name__} drops the position_ids it is given on this release (its output does not "
                f"change with them): packed documents cannot be expressed to it")
    return None


def _uses_position_ids(model) -> bool:
    ids, positions = _inputs(True)
    with torch.no_grad(), hfpatch.switch("local"):
        return not torch.equal(model(input_ids=ids, use_cache=False).logits,
                               model(input_ids=ids, position_ids=positions, use_cache=False).logits)


def _cases_of(name):
    return {**CASES, **(LAYOUT_CASES if name in REPRESENTATIVES else {})}


def _family_world(rank, world):
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    group = dist.group.WORLD
    results = {"refusal": _refusal_checks()}
    for name, entry in sorted(_entries().items()):
        model = build_tiny(entry)
        references = {}
        by_kernel: dict = {}
        for case, (kernel, packed, pass_positions) in _cases_of(name).items():
            by_kernel.setdefault(kernel, []).append((case, packed, pass_positions))
        for number, (kernel, cases) in enumerate(by_kernel.items()):
            # The whole-model probe (verify=True) once per class; the comparisons below are the proof.
            patch = hfpatch.apply(group, model=model, kernel=kernel, verify=True if number == 0 else False)
            try:
                hooked = sum(len(m._forward_hooks) for m in model.modules())
                for case, packed, pass_positions in cases:
                    reason = _case_skip(model, packed, pass_positions)
                    if reason is not None:
                        results[(name, case)] = ("skip", reason)
                        continue
                    ids, positions = _inputs(packed)
                    key = (packed, pass_positions)
                    if key not in references:  # non-CP on the flash path the patch switched to, in mode "local"
                        references[key] = _non_cp(model, ids, positions if pass_positions else None)
                    try:
                        loss, grads = _cp(patch, model, ids, positions, pass_positions)
                    except UnsupportedArgument as exc:
                        results[(name, case)] = ("refused", str(exc))
                        continue
                    results[(name, case)] = ("ran", *_errors(loss, grads, *references[key]), hooked)
            finally:
                patch.remove()
        left = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
        assert left == 0, f"{name}: Patch.remove() left {left} hooks on the model"
    return results


@pytest.fixture(scope="module")
def family_results():
    return run_world(2, _family_world)[0]


@pytest.mark.parametrize("case", list(ALL_CASES))
@pytest.mark.parametrize("class_name", FAMILY)
def test_family_class_is_exact_under_cp(family_results, class_name, case):
    if case not in _cases_of(class_name):
        pytest.skip(f"the layouts beyond {sorted(CASES)} run on the representatives {REPRESENTATIVES}")
    if (class_name, case) not in family_results:
        pytest.skip(f"{class_name} has no flash-attention path (or does not exist) on this transformers release")
    result = family_results[(class_name, case)]
    if result[0] == "skip":
        pytest.skip(result[1])
    if (class_name, case) in REFUSED:
        assert result[0] == "refused" and "position_ids" in result[1] and "packed" in result[1], result
        return
    assert result[0] == "ran", result
    _, loss_error, grad_error, hooked = result
    assert hooked >= 1, "apply(model=) installed no position hook"
    assert loss_error <= LOSS_RTOL, f"loss off by {loss_error:.2e} relative"
    assert grad_error <= 1.0, f"a gradient is off by {grad_error:.3g} x its tolerance"


# ---------------------------------------------------------------------------------- recognition (one process)


def _bart():
    import transformers

    config = transformers.BartConfig(vocab_size=128, d_model=32, decoder_layers=1, encoder_layers=1,
                                     decoder_attention_heads=2, encoder_attention_heads=2, decoder_ffn_dim=32,
                                     encoder_ffn_dim=32, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.BartForCausalLM(config)


def _with_custom_positions(model, *, same_name: bool):
    """``model`` whose decoder position module is a subclass of its own class with a changed forward (an extra
    offset): hfpatch has not read this code, so it must refuse it."""
    base = type(model.model.decoder.embed_positions)

    def forward(self, input_ids, past_key_values_length=0, shift=1):
        return base.forward(self, input_ids, past_key_values_length + shift)

    custom = type(base.__name__ if same_name else "ShiftedPositionalEmbedding", (base,), {"forward": forward})
    model.model.decoder.embed_positions.__class__ = custom
    return model


def test_every_family_position_module_on_this_release_is_recognised():
    entries = _entries()
    if not entries:
        pytest.skip("no class of the family has a flash-attention path on this transformers release")
    for name, entry in entries.items():
        model = build_tiny(entry)
        found = [(path, recognise(model, m)) for path, m in model.named_modules() if path.endswith("embed_positions")]
        assert found and all(e is not None for _, e in found), (name, found)
        assert [f for f in audit(model) if f.kind == "positions"] == [], name


@pytest.mark.parametrize("same_name", [False, True])
def test_unrecognised_position_module_stays_refused(same_name):
    findings = audit(_with_custom_positions(_bart(), same_name=same_name))
    assert [(f.path, f.kind) for f in findings] == [("model.decoder.embed_positions", "positions")]
    assert "takes no position_ids" in findings[0].reason and "is not one of them" in findings[0].reason


def test_changed_forward_signature_is_not_recognised(monkeypatch):
    model = _bart()
    cls = type(model.model.decoder.embed_positions)

    def forward(self, input_ids, past_key_values_length=0, position_ids=None, offset=2):
        raise AssertionError("never called")

    monkeypatch.setattr(cls, "forward", forward)  # transformers' own class, a forward it never had
    findings = audit(model)
    assert [f.kind for f in findings] == ["positions"]
    assert "is not the one hfpatch recognises" in findings[0].reason and "offset=2" in findings[0].reason


def test_encoder_decoder_is_not_recognised():
    model = _bart()
    model.config.is_encoder_decoder = True
    assert recognise(model, model.model.decoder.embed_positions) is None


def _refusal_checks():
    """On every rank of the world: apply(model=) refuses an unrecognised position module by name, installs
    nothing, and falls back with that reason."""
    import transformers.modeling_flash_attention_utils as mfau

    model = _with_custom_positions(_bart(), same_name=False)
    with pytest.raises(UnsupportedModel) as info:
        hfpatch.apply(dist.group.WORLD, model=model)
    assert (info.value.kind, info.value.module_path, info.value.module_class) == \
        ("positions", "model.decoder.embed_positions", "ShiftedPositionalEmbedding")
    assert hfpatch.active_patch() is None
    assert not is_wrapper(mfau._flash_attention_forward)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    patch = hfpatch.apply(dist.group.WORLD, model=model, on_unsupported="fallback")
    assert not patch.active and "ShiftedPositionalEmbedding" in patch.reason
    patch.remove()
    return True


def test_unrecognised_position_module_is_refused_by_apply(family_results):
    assert family_results["refusal"] is True
