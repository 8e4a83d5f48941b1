"""Gemma-3 with images is refused by name, and why is measured here.

Gemma-3's text model attends **bidirectionally inside each image span** (``token_type_ids`` 1 on the image's
placeholders: every placeholder sees the whole image) within causal attention. The ring kernels compute causal (or
full, or windowed) attention, never a causal mask with bidirectional blocks, and transformers itself gives the
model no flash path for it from 5.24 (``_supports_flash_attn = False``: flash attention would drop that mask), so
``apply(model=)`` refuses the model by name there; on the releases before, where the text path is patched, the
inputs guard refuses its first image by name (Gemma-3 is not among ``hfpatch.model.multimodal``'s families).
The measurement: on a tiny Gemma-3 the logits with the model's own mask differ from the same forward with a
purely causal mask (what a causal CP kernel computes) by 0.25 of the largest logit, from the image's first
placeholder on; the tokens before it are equal. Causal attention is therefore not an approximation hfpatch could accept.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import hfpatch
from _dist import run_world
from hfpatch import version_gates
from hfpatch.errors import HfpatchError, UnsupportedArgument
from ring_kernels.tolerances import relative_error, tolerance

transformers = pytest.importorskip("transformers")
if version_gates.installed_transformers_version() < version_gates.TRANSFORMERS_IMAGES_UNDER_CP:
    pytest.skip(f"images under CP from transformers {version_gates.TRANSFORMERS_IMAGES_UNDER_CP} (before it every "
                "image is refused by the inputs guard: tests/model/test_multimodal.py)", allow_module_level=True)

IMAGE, BEGIN, END = 190, 191, 192


def _gemma3():
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                             num_attention_heads=2, image_size=16, patch_size=4)
    text = transformers.Gemma3TextConfig(vocab_size=200, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       image_token_index=IMAGE, boi_token_index=BEGIN, eoi_token_index=END)
    torch.manual_seed(0)
    return transformers.Gemma3ForConditionalGeneration(config).eval()


def _row():
    ids = torch.randint(0, IMAGE, (1, 24), generator=torch.Generator().manual_seed(1))
    ids[0, 5], ids[0, 6:10], ids[0, 10] = BEGIN, IMAGE, END
    return ids, torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(2))


def test_the_image_spans_bidirectional_mask_is_not_causal_attention():
    model = _gemma3()
    ids, pixels = _row()
    with torch.no_grad():
        own = model(input_ids=ids, pixel_values=pixels, token_type_ids=(ids == IMAGE).long()).logits
        causal = model(input_ids=ids, pixel_values=pixels).logits
    assert torch.equal(own[:, :6], causal[:, :6])                 # before the image: the same mask
    difference = relative_error(causal, own)
    print(f"Gemma-3 logits, causal attention against its own image-span mask: {difference:.3g} relative")
    assert difference > 100 * tolerance("cp", torch.float32, "out").bound


def _refused(rank, world):
    """Refused by name: by ``apply(model=)`` where the release gives the model no flash path (5.24), else, the text
    path patched, by the inputs guard at the first image (an image family hfpatch does not scatter)."""
    model = _gemma3()
    ids, pixels = _row()
    try:
        patch = hfpatch.apply(dist.group.WORLD, model=model)
    except HfpatchError as exc:
        assert hfpatch.active_patch() is None
        return "apply", str(exc)
    with patch:
        batch = patch.shard_inputs(ids)
        with pytest.raises(UnsupportedArgument) as info:
            model(input_ids=batch["input_ids"], pixel_values=pixels,
                  token_type_ids=(batch["input_ids"] == IMAGE).long())
    assert info.value.parameter == "pixel_values", info.value
    return "image call", str(info.value)


def test_gemma3_images_are_refused_by_name():
    where, message = run_world(2, _refused)[0]
    assert "Gemma3ForConditionalGeneration" in message, message
    assert "flash" in message.lower() if where == "apply" else "pixel_values" in message, message
    print(f"refused at the {where}: {message[:300]}")
