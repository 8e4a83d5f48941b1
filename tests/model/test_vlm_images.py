"""Vision-language models with images under CP (``hfpatch.model.multimodal``): the loss and every parameter
gradient, vision tower included, equal the non-CP ones on every rank, with images that straddle a shard boundary.

Models, tiny, random weights, fp32, built from their config classes (a family the installed release does not have
is left out):
- Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3.5: images of two sizes (4 and 6 placeholders), 3-D multimodal rotary
  positions computed by the model over the whole row; Qwen3-VL adds its DeepStack features to the first two
  decoder layers at the image tokens (``visual_pos_masks``), Qwen3.5's text model mixes with a gated delta rule
  (linear attention) in one layer of two;
- Llava: a CLIP tower, two images of its one size (4 placeholders each);
- Llava-NeXT: a CLIP tower run on anyres tiles, two images of different sizes (2 x 4 and 4 x 4 pixels: 3 and 5
  tiles, 4 and 7 placeholders with the newline features);
- Mistral3: a Pixtral tower on images of their own sizes (8 x 8 and 8 x 12 pixels: 4 and 6 placeholders after the
  patch merger).
Rows, of 32 tokens, so that every image straddles a rank boundary of the zigzag split on 2 and 4 ranks:
- ``batch``: two rows, one image each, no position ids: the model numbers the positions itself (the Qwen models'
  multimodal rotary positions over the whole row);
- ``packed``: one row of two documents (position ids restarting at 0), one image each, against each document run
  alone with its own image (from position 0, the model numbering its own positions); the model is given the
  whole row's position ids on every rank, the Qwen models in transformers' packed form (the text positions, then
  each document's multimodal rotary positions). Qwen3.5's packed reference is instead the model's own run of the
  whole row, given the same position ids: its linear-attention layers carry their state across the documents of a
  packed row (transformers' torch path does; ``hfpatch.mixers`` does the same under CP), so no run of the
  documents alone is what the model computes.
The loss is the model's own (``labels=`` the ones ``shard_inputs`` returned); the non-CP reference is a copy of the
model off the patch, given the whole row under ``hfpatch.switch("local")`` (Qwen3.5's delta-rule kernel is rebound
for the whole modeling module while the patch is live); both run without a cache (``use_cache=False``: the
recurrent layers refuse one under CP). Gradients are summed over the group (as data parallelism over dp x cp
sums them). Refused by name: image inputs before any step, ``inputs_embeds`` with images, video, Qwen3-VL's
DeepStack features without their mask and a list of tensors hfpatch has not read handed to its text model, a
family hfpatch has not read, and one the release has before the family's first release (the inputs guard: Qwen3-VL
before 5.3).

Tolerances: ``ring_kernels.tolerances`` "cp" float32 "loss"; the gradients "sweep" float32 "grad" (sequence
mixers add rounding: Qwen3.5's delta-rule decay parameters, dt_bias and A_log, measure 3.1e-5 on 2 ranks), whose
floor covers the vision tower's key biases (an exact gradient of 0); the worst "cp"-measured errors are printed per
model. ``visual_rows`` (the DeepStack rows a rank keeps) is checked against the text model's own reading of its
tokens.
"""
from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.distributed as dist

import hfpatch
from _dist import run_world
from hfpatch import version_gates
from hfpatch.errors import UnsupportedArgument
from hfpatch.inputs import shift_labels, token_loss_sum
from hfpatch.model import multimodal
from ring_kernels.tolerances import assert_close, relative_error, tolerance

transformers = pytest.importorskip("transformers")
if version_gates.installed_transformers_version() < version_gates.TRANSFORMERS_IMAGES_UNDER_CP:
    pytest.skip(f"images under CP from transformers {version_gates.TRANSFORMERS_IMAGES_UNDER_CP} (before it they "
                "are refused: tests/model/test_multimodal.py)", allow_module_level=True)

LOSS = tolerance("cp", torch.float32, "loss")
GRAD = tolerance("cp", torch.float32, "grad")
# a parameter whose exact gradient is 0 (a key bias: softmax ignores a shift shared by all keys) compares at the
# model's scale (the entry's floor x the largest gradient of the model)
GRAD_OF_ANY = tolerance("sweep", torch.float32, "grad")
SEQ = 32
VOCAB = 160
IMAGE, VIDEO, START, END = 150, 151, 152, 153   # the Qwen models' special tokens; Llava's image token is IMAGE
TEXT = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=96, vocab_size=VOCAB)
QWEN3_ROPE = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0, "mrope_interleaved": True}
QWEN3_VISION = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=2, spatial_merge_size=2,
                    temporal_patch_size=2, in_channels=3, out_hidden_size=64, num_position_embeddings=16)


def _qwen2_vl():
    config = transformers.Qwen2VLConfig(
        text_config=dict(TEXT, rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                                                "rope_theta": 10000.0}),
        vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=2,
                           spatial_merge_size=2, temporal_patch_size=2, in_channels=3),
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)
    return transformers.Qwen2VLForConditionalGeneration(config)


def _qwen2_5_vl():
    config = transformers.Qwen2_5_VLConfig(
        text_config=dict(TEXT, rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                                                "rope_theta": 10000.0}),
        vision_config=dict(depth=2, hidden_size=32, out_hidden_size=64, intermediate_size=48, num_heads=2,
                           patch_size=2, spatial_merge_size=2, temporal_patch_size=2, in_channels=3,
                           window_size=8, fullatt_block_indexes=[1]),
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)
    return transformers.Qwen2_5_VLForConditionalGeneration(config)


def _clip(image_size: int, patch_size: int):
    """A tiny CLIP tower of ``image_size`` pixels cut into ``patch_size`` patches (Llava's and Llava-NeXT's)."""
    return transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                         num_attention_heads=2, image_size=image_size, patch_size=patch_size)


def _llava():
    config = transformers.LlavaConfig(
        vision_config=_clip(8, 4),
        text_config=transformers.LlamaConfig(**TEXT), image_token_index=IMAGE, image_seq_length=4,
        vision_feature_select_strategy="default", vision_feature_layer=-1)
    return transformers.LlavaForConditionalGeneration(config)


def _qwen3_vl():
    config = transformers.Qwen3VLConfig(
        text_config=dict(TEXT, head_dim=16, rope_parameters=dict(QWEN3_ROPE)),
        vision_config=dict(QWEN3_VISION, deepstack_visual_indexes=[0, 1]),
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)
    return transformers.Qwen3VLForConditionalGeneration(config)


def _qwen3_5():
    config = transformers.Qwen3_5Config(
        text_config=dict(TEXT, head_dim=16, rope_parameters=dict(QWEN3_ROPE, partial_rotary_factor=1.0),
                         layer_types=["linear_attention", "full_attention"], linear_key_head_dim=16,
                         linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4),
        vision_config=QWEN3_VISION,
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)
    return transformers.Qwen3_5ForConditionalGeneration(config)


def _llava_next():
    config = transformers.LlavaNextConfig(
        vision_config=_clip(2, 2),
        text_config=transformers.LlamaConfig(**TEXT), image_token_index=IMAGE, image_seq_length=1,
        vision_feature_select_strategy="default", vision_feature_layer=-1,
        image_grid_pinpoints=[[2, 2], [2, 4], [4, 2], [4, 4]])
    return transformers.LlavaNextForConditionalGeneration(config)


def _mistral3():
    config = transformers.Mistral3Config(
        vision_config=transformers.PixtralVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                                       num_attention_heads=2, image_size=16, patch_size=2),
        text_config=transformers.MistralConfig(**TEXT), image_token_index=IMAGE, spatial_merge_size=2)
    return transformers.Mistral3ForConditionalGeneration(config)


def _qwen_images(g, counts):
    grids = torch.tensor([[1, 4, n] for n in counts])   # (t, h, w) in patches: h * w / merge**2 = n placeholders
    patches = int(grids.prod(-1).sum())
    return {"pixel_values": torch.randn(patches, 3 * 2 * 2 * 2, generator=g), "image_grid_thw": grids}


def _llava_images(g, counts):
    assert all(n == 4 for n in counts), "Llava's CLIP tower gives every image the same 4 placeholders"
    return {"pixel_values": torch.randn(len(counts), 3, 8, 8, generator=g)}


def _sized_images(sizes: dict, patches: int):
    """Image inputs of models that take ``image_sizes``: placeholders -> (height, width); ``pixel_values`` padded
    to the largest image (Llava-NeXT's: ``patches`` tiles of 2 x 2 pixels per image, Mistral3's: the pixels)."""
    def images(g, counts):
        image_sizes = torch.tensor([sizes[n] for n in counts])
        if patches:
            return {"pixel_values": torch.randn(len(counts), patches, 3, 2, 2, generator=g), "image_sizes": image_sizes}
        height, width = image_sizes.max(0).values.tolist()
        return {"pixel_values": torch.randn(len(counts), 3, height, width, generator=g), "image_sizes": image_sizes}
    return images


# name -> (builder, placeholders of its two images, the image inputs for given placeholder counts, the
# transformers class the release must have)
_ALL_MODELS = {
    "qwen2_vl": (_qwen2_vl, (4, 6), _qwen_images, "Qwen2VLModel"),
    "qwen2_5_vl": (_qwen2_5_vl, (4, 6), _qwen_images, "Qwen2_5_VLModel"),
    "qwen3_vl": (_qwen3_vl, (4, 6), _qwen_images, "Qwen3VLModel"),
    "qwen3_5": (_qwen3_5, (4, 6), _qwen_images, "Qwen3_5Model"),
    "llava": (_llava, (4, 4), _llava_images, "LlavaModel"),
    "llava_next": (_llava_next, (4, 7), _sized_images({4: (2, 4), 7: (4, 4)}, patches=5), "LlavaNextModel"),
    "mistral3": (_mistral3, (4, 6), _sized_images({4: (8, 8), 6: (8, 12)}, patches=0), "Mistral3Model"),
}
INSTALLED = version_gates.installed_transformers_version()
MODELS = {name: entry for name, entry in _ALL_MODELS.items()
          if hasattr(transformers, entry[3]) and INSTALLED >= multimodal.first_release(name)}
QWEN = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5")
# models with recurrent (linear-attention) layers, which run a packed row's documents as one sequence
STATE_ACROSS_DOCUMENTS = ("qwen3_5",)


def _row(g, length: int, image_at: int, placeholders: int, qwen: bool) -> torch.Tensor:
    """A row of text tokens with one image's placeholders starting at ``image_at`` (wrapped in the vision start
    and end tokens for the Qwen models)."""
    row = torch.randint(0, IMAGE, (length,), generator=g)
    row[image_at:image_at + placeholders] = IMAGE
    if qwen:
        row[image_at - 1], row[image_at + placeholders] = START, END
    return row


def _cat_padded(tensors: list) -> torch.Tensor:
    """``tensors`` concatenated on their first axis, each zero-padded at the end of every other axis to the largest
    (Mistral3's pixels of images of different sizes: its tower reads each image's own ``image_sizes``)."""
    shape = [max(t.shape[d] for t in tensors) for d in range(1, tensors[0].dim())]
    padded = []
    for t in tensors:
        pad = [p for d in reversed(range(1, t.dim())) for p in (0, shape[d - 1] - t.shape[d])]
        padded.append(torch.nn.functional.pad(t, pad))
    return torch.cat(padded)


def _rows(name: str):
    """form -> (input_ids, position_ids or None, labels, image inputs, per-document slices and image inputs)."""
    _, counts, images, _ = _ALL_MODELS[name]
    qwen = name in QWEN
    g = torch.Generator().manual_seed(5)
    # batch: 6..9 and 21..26 straddle the zigzag rank boundaries at 8 (2 ranks) and 8 / 24 (4 ranks)
    batch = torch.stack([_row(g, SEQ, 6, counts[0], qwen), _row(g, SEQ, 21, counts[1], qwen)])
    # packed: documents of 14 and 18 tokens; the images at 6..9 and from 14 + 7 = 21
    docs = [_row(g, 14, 6, counts[0], qwen), _row(g, 18, 7, counts[1], qwen)]
    packed = torch.cat(docs)[None]
    positions = torch.cat([torch.arange(14), torch.arange(18)])[None]
    labels = packed.masked_fill(positions == 0, -100)
    labels[0, 0] = packed[0, 0]
    batch_images = images(g, counts)
    g_doc = torch.Generator().manual_seed(6)
    doc_images = [images(g_doc, counts[:1]), images(g_doc, counts[1:])]
    packed_images = {k: _cat_padded([d[k] for d in doc_images]) for k in doc_images[0]}
    return {"batch": (batch, None, batch, batch_images, None),
            "packed": (packed, positions, labels, packed_images, list(zip([(0, 14), (14, 32)], doc_images)))}


def _extra(name: str, ids: torch.Tensor) -> dict:
    """The Qwen models' token types (1 on image placeholders), where the release's model takes them (with
    ``image_grid_thw``)."""
    base = _ALL_MODELS[name][3] if name in QWEN else None
    if base is None or "mm_token_type_ids" not in inspect.signature(getattr(transformers, base).forward).parameters:
        return {}
    return {"mm_token_type_ids": (ids == IMAGE).int()}


def _packed_positions(model, name, ids, positions, documents):
    """The position ids to pass with a packed row: the Llava models' and Mistral3's restart per document (2-D); the
    Qwen models take
    transformers' packed form, (4, 1, S): the text positions, then each document's own multimodal rotary
    positions (the model's ``get_rope_index`` of the document alone)."""
    if name not in QWEN:
        return positions
    takes_types = "mm_token_type_ids" in inspect.signature(model.model.get_rope_index).parameters
    rope = []
    for (a, b), doc_images in documents:
        types = {"mm_token_type_ids": (ids[:, a:b] == IMAGE).int()} if takes_types else {}
        rope.append(model.model.get_rope_index(ids[:, a:b], image_grid_thw=doc_images["image_grid_thw"], **types)[0])
    return torch.cat([positions[None], torch.cat(rope, -1)], 0)


def _reference(model, name, ids, positions, labels, images, documents):
    """The non-CP loss: the batch through the model's own loss; a packed row as each document alone (its own
    attention and image), the mean cross-entropy over the row's labels; the packed row of a model in
    ``STATE_ACROSS_DOCUMENTS`` whole, with its packed position ids."""
    if documents is None:
        return model(input_ids=ids, labels=labels, use_cache=False, **images, **_extra(name, ids)).loss
    if name in STATE_ACROSS_DOCUMENTS:
        whole = model(input_ids=ids, position_ids=_packed_positions(model, name, ids, positions, documents),
                      use_cache=False, **images, **_extra(name, ids))
        loss_sum, count = token_loss_sum(whole.logits, shift_labels(labels))
        return loss_sum / count
    logits = []
    for (a, b), doc_images in documents:
        doc = ids[:, a:b]
        # a document alone from position 0: Llava numbers its tokens, the Qwen models their 3-D rotary positions
        logits.append(model(input_ids=doc, use_cache=False, **doc_images, **_extra(name, doc)).logits)
    loss_sum, count = token_loss_sum(torch.cat(logits, 1), shift_labels(labels))
    return loss_sum / count


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _case(rank, world, name, worst):
    torch.manual_seed(0)
    reference = MODELS[name][0]()
    model = copy.deepcopy(reference)
    tower = [n for n, _ in model.named_parameters() if ".visual." in n or "vision_tower" in n]
    assert tower, f"{name}: no vision tower parameter found"
    with hfpatch.apply(dist.group.WORLD, model=model) as patch:
        for form, (ids, positions, labels, images, documents) in _rows(name).items():
            what = f"{name} {form} on rank {rank} of {world}"
            reference.zero_grad(set_to_none=True)
            model.zero_grad(set_to_none=True)
            with hfpatch.switch("local"):   # the mixers' kernels are rebound module-wide: the reference runs them whole
                want = _reference(reference, name, ids, positions, labels, images, documents)
            want.backward()
            batch = patch.shard_inputs(ids, labels=labels, position_ids=positions)
            given = batch["position_ids"] if documents is None else \
                _packed_positions(model, name, ids, positions, documents)
            got = model(input_ids=batch["input_ids"], position_ids=given, labels=batch["labels"], use_cache=False,
                        **images, **_extra(name, ids))
            got.loss.backward()
            assert got.logits.shape[1] == SEQ // world, what
            assert_close(got.loss.detach(), want.detach(), LOSS, f"{what}: loss")
            worst["loss"] = max(worst["loss"], relative_error(got.loss.detach(), want.detach()))
            ref_grads, grads = _grads(reference), _grads(model)
            assert ref_grads.keys() == grads.keys(), what
            assert any(n in grads for n in tower), f"{what}: the vision tower has no gradient"
            largest = max(float(g.abs().max()) for g in ref_grads.values())
            for param, grad in grads.items():
                dist.all_reduce(grad)
                assert_close(grad, ref_grads[param], GRAD_OF_ANY, f"{what}: gradient of {param}", largest=largest)
                if float(ref_grads[param].abs().max()) > GRAD_OF_ANY.floor * largest:  # not rounding noise
                    key = "tower grad" if param in tower else "grad"
                    worst[key] = max(worst[key], relative_error(grad, ref_grads[param]))


def _refusals(rank, world):
    model = _qwen2_vl()
    ids, _, labels, images, _ = _rows("qwen2_vl")["batch"]
    with hfpatch.apply(dist.group.WORLD, model=model) as patch:
        patch.ctx.set_step(None)
        with pytest.raises(UnsupportedArgument) as info:   # images before any step: no layout to shard in
            model(input_ids=ids[:, :SEQ // world], **images, **_extra("qwen2_vl", ids))
        assert info.value.parameter == "pixel_values" and "shard_inputs" in info.value.fix
        batch = patch.shard_inputs(ids, labels=labels)
        embeds = model.get_input_embeddings()(batch["input_ids"])
        with pytest.raises(UnsupportedArgument) as info:
            model(inputs_embeds=embeds, **images, **_extra("qwen2_vl", ids))
        assert info.value.parameter == "inputs_embeds"
        with pytest.raises(UnsupportedArgument) as info:   # neither the shard nor the whole row
            model(input_ids=batch["input_ids"], attention_mask=torch.ones(2, 5, dtype=torch.long), **images,
                  **_extra("qwen2_vl", ids))
        assert info.value.parameter == "attention_mask"
        with pytest.raises(UnsupportedArgument) as info:   # video: not tested, so refused
            model(input_ids=batch["input_ids"], pixel_values_videos=images["pixel_values"],
                  video_grid_thw=images["image_grid_thw"], **_extra("qwen2_vl", ids))
        assert info.value.parameter == "pixel_values_videos"
    return True


def _drop_the_mask(module, args, kwargs):
    return args, dict(kwargs, visual_pos_masks=None)


def _add_a_list(module, args, kwargs):
    return args, dict(kwargs, deepstack_video_extra=[kwargs["inputs_embeds"][0]])


def _deepstack_refusals(rank, world):
    """Qwen3-VL's text model handed DeepStack features without their mask, or a list of tensors hfpatch has not
    read (each put there by a hook that runs before hfpatch's): refused by name."""
    refused = []
    for hook in (_drop_the_mask, _add_a_list):
        model = _qwen3_vl()
        model.model.language_model.register_forward_pre_hook(hook, with_kwargs=True)
        ids, _, labels, images, _ = _rows("qwen3_vl")["batch"]
        with hfpatch.apply(dist.group.WORLD, model=model, verify="fast") as patch:   # the refusal only: no probe
            batch = patch.shard_inputs(ids, labels=labels)
            with pytest.raises(UnsupportedArgument) as info:
                model(input_ids=batch["input_ids"], use_cache=False, **images, **_extra("qwen3_vl", ids))
        refused.append(info.value.parameter)
    assert refused == ["deepstack_visual_embeds", "deepstack_video_extra"], refused
    return True


def _refused_before_its_release(rank, world, name):
    """A family the release has but hfpatch does not scatter images for there: the inputs guard refuses them."""
    model = _ALL_MODELS[name][0]()
    ids, _, labels, images, _ = _rows(name)["batch"]
    with hfpatch.apply(dist.group.WORLD, model=model, verify="fast") as patch:   # the refusal only: no probe
        batch = patch.shard_inputs(ids, labels=labels)
        with pytest.raises(UnsupportedArgument) as info:
            model(input_ids=batch["input_ids"], use_cache=False, **images, **_extra(name, ids))
    return info.value.parameter


def _world(rank, world, names):
    worst = {}
    for name in names:
        worst[name] = {"loss": 0.0, "grad": 0.0, "tower grad": 0.0}
        _case(rank, world, name, worst[name])
    if world == 2:
        assert _refusals(rank, world)
        assert "qwen3_vl" not in MODELS or _deepstack_refusals(rank, world)
    return worst


def _print_worst(world, worst):
    for name, errors in worst.items():
        print(f"worst relative differences, {name} on {world} ranks:",
              ", ".join(f"{key} {value:.2e}" for key, value in errors.items()))


def test_the_read_families_are_recognised_and_others_are_not():
    for name, (build, _, _, _) in MODELS.items():
        found = multimodal.recognise(build())
        assert found is not None and found.family == name, name
    assert multimodal.recognise(transformers.LlamaForCausalLM(transformers.LlamaConfig(**TEXT))) is None


def test_families_gated_to_a_later_release_are_refused_by_name():
    gated = [name for name, entry in _ALL_MODELS.items() if hasattr(transformers, entry[3]) and name not in MODELS]
    if not gated:
        pytest.skip("every family this release has is scattered")
    for name in gated:
        assert multimodal.recognise(_ALL_MODELS[name][0]()) is None, name
    assert run_world(2, _refused_before_its_release, gated[0]) == ["pixel_values"] * 2


def test_images_match_non_cp_on_2_ranks():
    _print_worst(2, run_world(2, _world, tuple(MODELS))[0])


def test_images_match_non_cp_on_4_ranks():
    _print_worst(4, run_world(4, _world, ("qwen2_vl",))[0])



def test_visual_rows_follow_the_text_models_reading_of_this_ranks_tokens():
    mask = torch.zeros(2, 8, dtype=torch.bool)
    mask[0, 1:4] = mask[1, 5:8] = True
    whole = torch.arange(16).view(2, 8)
    for index in (torch.tensor([0, 1, 6, 7]), torch.tensor([2, 3, 4, 5]), torch.tensor([7, 0, 3])):
        rows = multimodal.visual_rows(mask, index)
        assert torch.equal(whole[mask][rows], whole[:, index][mask[:, index]]), index
