"""Multimodal models under ``apply(model=)``: the encoder of another modality (vision, audio) is not a token mixer
(``hfpatch.model.routing.modality_towers``), and image / video / audio inputs are refused by name while CP is
active (``hfpatch.model.inputs_guard``), on real HF classes.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import hfpatch
from _dist import run_world
from hfpatch.cli.demo_models import build_model
from hfpatch.errors import UnsupportedArgument
from hfpatch.model.audit import audit
from hfpatch.model.inputs_guard import install_inputs_guard
from hfpatch.model.routing import modality_towers
from hfpatch.release.sweep.catalog import flash_causal_lm_classes
from hfpatch.release.sweep.tiny import NotBuilt, build_tiny


def _llama_with_audio_tower():
    """A tiny Llama carrying a Whisper encoder (Conv1d stem, learned positions) as a tower of another modality: a
    PreTrainedModel of its own config class, as composite models hold their encoders."""
    import transformers
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    model = build_model("llama")
    config = transformers.WhisperConfig(d_model=32, encoder_layers=1, encoder_attention_heads=2,
                                        encoder_ffn_dim=32, num_mel_bins=8, max_source_positions=16)
    model.audio_tower = WhisperEncoder(config)
    return model


def test_a_tower_of_another_modality_is_not_a_token_mixer():
    model = _llama_with_audio_tower()
    assert modality_towers(model) == ["audio_tower"]
    assert audit(model) == []
    # the same convolution on the text path is still a finding
    model.model.layers[0].token_conv = torch.nn.Conv1d(64, 64, 4, groups=64, padding=3)
    assert [(f.path, f.kind) for f in audit(model)] == [("model.layers.0.token_conv", "sequence-mixer")]


@pytest.mark.parametrize("model_type", ["phi4_multimodal", "moss_transcribe_diarize", "gemma3"])
def test_released_multimodal_classes_audit_clean(model_type):
    """The released composites whose towers hold convolutions or position tables: nothing in the towers is a
    finding (their text stacks are what the model sweep proves exact)."""
    entry = next((e for e in flash_causal_lm_classes() if e.model_type == model_type), None)
    if entry is None:
        pytest.skip(f"{model_type} has no flash-capable causal LM on this transformers release")
    try:
        model = build_tiny(entry)
    except NotBuilt as exc:
        pytest.skip(f"not built on this release: {exc.reason}")
    assert modality_towers(model), "no tower found"
    assert audit(model) == []


def test_guard_refuses_modality_inputs_only_while_cp_is_active():
    class Echo(torch.nn.Module):
        def forward(self, input_ids=None, **kwargs):
            return input_ids

    ctx = SimpleNamespace(world_size=2)
    model = Echo()
    handles = install_inputs_guard(model, lambda: ctx)
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(UnsupportedArgument) as info:
        model(input_ids=ids, pixel_values=torch.zeros(1, 3, 8, 8))
    assert info.value.parameter == "pixel_values" and "placeholder" in info.value.reason and info.value.fix
    with pytest.raises(UnsupportedArgument) as info:
        model(input_ids=ids, input_features=torch.zeros(1, 8, 16))
    assert info.value.parameter == "input_features"
    assert model(input_ids=ids, pixel_values=None) is ids  # not given: nothing to refuse
    with hfpatch.switch("local"):  # the whole sequence, no CP: the model's own business
        assert model(input_ids=ids, pixel_values=torch.zeros(1, 3, 8, 8)) is ids
    ctx.world_size = 1
    assert model(input_ids=ids, pixel_values=torch.zeros(1, 3, 8, 8)) is ids
    handles.remove()
    ctx.world_size = 2
    assert model(input_ids=ids, pixel_values=torch.zeros(1, 3, 8, 8)) is ids


def _applied_model_refuses_images(rank, world):
    model = _llama_with_audio_tower()
    patch = hfpatch.apply(dist.group.WORLD, model=model)
    try:
        batch = patch.shard_inputs(torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(0)))
        with pytest.raises(UnsupportedArgument) as info:
            model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                  input_features=torch.zeros(1, 8, 32))
        assert info.value.parameter == "input_features"
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        assert logits.shape[1] == batch["input_ids"].shape[1]
    finally:
        patch.remove()
    return True


def test_apply_model_refuses_modality_inputs_2_ranks():
    assert run_world(2, _applied_model_refuses_images) == [True, True]
