"""Gemma-3 with images is refused by name, and why is measured here.

Gemma-3's text model attends **bidirectionally inside each image span** (``token_type_ids`` 1 on the image's
placeholders: every placeholder sees the whole image) within causal attention. The ring kernels compute causal (or
full, or windowed) attention, never a causal mask with bidirectional blocks, and transformers itself gives the
model no flash path for it (``_supports_flash_attn = False``: flash attention would drop that mask), so
``apply(model=)`` refuses the model by name before any image reaches it. The measurement: on a tiny Gemma-3 the
logits with the model's own mask differ from the same forward with a purely causal mask (what a causal CP kernel
computes) by several percent of the largest logit, from the image's first placeholder on; the tokens before it are
equal. Causal attention is therefore not an approximation hfpatch could accept.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import hfpatch
from _dist import run_world
from hfpatch.errors import HfpatchError
from ring_kernels.tolerances import relative_error, tolerance

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Gemma3ForConditionalGeneration"):
    pytest.skip("this release has no Gemma-3", allow_module_level=True)

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
    model = _gemma3()
    with pytest.raises(HfpatchError) as info:
        hfpatch.apply(dist.group.WORLD, model=model)
    assert hfpatch.active_patch() is None
    return type(info.value).__name__, str(info.value)


def test_apply_refuses_gemma3_by_name():
    name, message = run_world(2, _refused)[0]
    assert "Gemma3ForConditionalGeneration" in message and "flash" in message.lower(), message
    print(name, message[:300])
