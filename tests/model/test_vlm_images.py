"""Vision-language models with images under CP (``hfpatch.model.multimodal``): the loss and every parameter
gradient, vision tower included, equal the non-CP ones on every rank, with images that straddle a shard boundary.

Models: Qwen2-VL and Qwen2.5-VL (images of two sizes, 3-D multimodal rotary positions computed by the model over the
whole row) and Llava (a CLIP tower, two images of its one size), tiny, random weights, fp32, built from their
config classes.
Rows, of 32 tokens, so that every image straddles a rank boundary of the zigzag split on 2 and 4 ranks:
- ``batch``: two rows, one image each (4 and 6 placeholders for the Qwen models), no position ids: the model
  numbers the positions itself (Qwen2-VL's multimodal rotary positions over the whole row);
- ``packed``: one row of two documents (position ids restarting at 0), one image each, against each document run
  alone with its own image (from position 0, the model numbering its own positions); the model is given the
  whole row's position ids on every rank, the Qwen models in transformers' packed form (the text positions, then
  each document's multimodal rotary positions).
The loss is the model's own (``labels=`` the ones ``shard_inputs`` returned); the non-CP reference is a copy of the
model off the patch, given the whole row. Gradients are summed over the group (as data parallelism over dp x cp
sums them). Refused by name: image inputs before any step, ``inputs_embeds`` with images, and a family hfpatch
has not read (the inputs guard).

Tolerances: ``ring_kernels.tolerances`` "cp" float32 "loss"; the gradients "sweep" float32 "grad", whose floor
covers the vision tower's key biases (an exact gradient of 0); the worst "cp"-measured errors are printed.
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


def _llava():
    config = transformers.LlavaConfig(
        vision_config=transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                                    num_attention_heads=2, image_size=8, patch_size=4),
        text_config=transformers.LlamaConfig(**TEXT), image_token_index=IMAGE, image_seq_length=4,
        vision_feature_select_strategy="default", vision_feature_layer=-1)
    return transformers.LlavaForConditionalGeneration(config)


def _qwen_images(g, counts):
    grids = torch.tensor([[1, 4, n] for n in counts])   # (t, h, w) in patches: h * w / merge**2 = n placeholders
    patches = int(grids.prod(-1).sum())
    return {"pixel_values": torch.randn(patches, 3 * 2 * 2 * 2, generator=g), "image_grid_thw": grids}


def _llava_images(g, counts):
    assert all(n == 4 for n in counts), "Llava's CLIP tower gives every image the same 4 placeholders"
    return {"pixel_values": torch.randn(len(counts), 3, 8, 8, generator=g)}


# name -> (builder, placeholders of its two images, the image inputs for given placeholder counts)
MODELS = {
    "qwen2_vl": (_qwen2_vl, (4, 6), _qwen_images),
    "qwen2_5_vl": (_qwen2_5_vl, (4, 6), _qwen_images),
    "llava": (_llava, (4, 4), _llava_images),
}


def _row(g, length: int, image_at: int, placeholders: int, qwen: bool) -> torch.Tensor:
    """A row of text tokens with one image's placeholders starting at ``image_at`` (wrapped in the vision start
    and end tokens for the Qwen models)."""
    row = torch.randint(0, IMAGE, (length,), generator=g)
    row[image_at:image_at + placeholders] = IMAGE
    if qwen:
        row[image_at - 1], row[image_at + placeholders] = START, END
    return row


def _rows(name: str):
    """form -> (input_ids, position_ids or None, labels, image inputs, per-document slices and image inputs)."""
    _, counts, images = MODELS[name]
    qwen = name != "llava"
    g = torch.Generator().manual_seed(5)
    # batch: 6..9 and 21..26 straddle the zigzag rank boundaries at 8 (2 ranks) and 8 / 24 (4 ranks)
    batch = torch.stack([_row(g, SEQ, 6, counts[0], qwen), _row(g, SEQ, 21, counts[1], qwen)])
    # packed: documents of 14 and 18 tokens; the images at 6..9 and 14 + 7 = 21..26
    docs = [_row(g, 14, 6, counts[0], qwen), _row(g, 18, 7, counts[1], qwen)]
    packed = torch.cat(docs)[None]
    positions = torch.cat([torch.arange(14), torch.arange(18)])[None]
    labels = packed.masked_fill(positions == 0, -100)
    labels[0, 0] = packed[0, 0]
    batch_images = images(g, counts)
    g_doc = torch.Generator().manual_seed(6)
    doc_images = [images(g_doc, counts[:1]), images(g_doc, counts[1:])]
    packed_images = {k: torch.cat([d[k] for d in doc_images]) for k in doc_images[0]}
    return {"batch": (batch, None, batch, batch_images, None),
            "packed": (packed, positions, labels, packed_images, list(zip([(0, 14), (14, 32)], doc_images)))}


def _extra(name: str, ids: torch.Tensor) -> dict:
    """The Qwen models' token types (1 on image placeholders), where the release's model takes them (with
    ``image_grid_thw``)."""
    base = {"qwen2_vl": "Qwen2VLModel", "qwen2_5_vl": "Qwen2_5_VLModel"}.get(name)
    if base is None or "mm_token_type_ids" not in inspect.signature(getattr(transformers, base).forward).parameters:
        return {}
    return {"mm_token_type_ids": (ids == IMAGE).int()}


def _packed_positions(model, name, ids, positions, documents):
    """The position ids to pass with a packed row: Llava's restart per document (2-D); the Qwen models take
    transformers' packed form, (4, 1, S): the text positions, then each document's own multimodal rotary
    positions (the model's ``get_rope_index`` of the document alone)."""
    if name == "llava":
        return positions
    takes_types = "mm_token_type_ids" in inspect.signature(model.model.get_rope_index).parameters
    rope = []
    for (a, b), doc_images in documents:
        types = {"mm_token_type_ids": (ids[:, a:b] == IMAGE).int()} if takes_types else {}
        rope.append(model.model.get_rope_index(ids[:, a:b], image_grid_thw=doc_images["image_grid_thw"], **types)[0])
    return torch.cat([positions[None], torch.cat(rope, -1)], 0)


def _reference(model, name, ids, positions, labels, images, documents):
    """The non-CP loss: the batch through the model's own loss; a packed row as each document alone (its own
    attention and image), the mean cross-entropy over the row's labels."""
    if documents is None:
        return model(input_ids=ids, labels=labels, **images, **_extra(name, ids)).loss
    logits = []
    for (a, b), doc_images in documents:
        doc = ids[:, a:b]
        # a document alone from position 0: Llava numbers its tokens, the Qwen models their 3-D rotary positions
        logits.append(model(input_ids=doc, **doc_images, **_extra(name, doc)).logits)
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
            want = _reference(reference, name, ids, positions, labels, images, documents)
            want.backward()
            batch = patch.shard_inputs(ids, labels=labels, position_ids=positions)
            given = batch["position_ids"] if documents is None else \
                _packed_positions(model, name, ids, positions, documents)
            got = model(input_ids=batch["input_ids"], position_ids=given, labels=batch["labels"], **images,
                        **_extra(name, ids))
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
    return True


def _world(rank, world, names):
    worst = {"loss": 0.0, "grad": 0.0, "tower grad": 0.0}
    for name in names:
        _case(rank, world, name, worst)
    if world == 2:
        assert _refusals(rank, world)
    return worst


def test_the_read_families_are_recognised_and_others_are_not():
    for name, (build, _, _) in MODELS.items():
        found = multimodal.recognise(build())
        assert found is not None and found.family == name, name
    assert multimodal.recognise(transformers.LlamaForCausalLM(transformers.LlamaConfig(**TEXT))) is None


def test_images_match_non_cp_on_2_ranks():
    worst = run_world(2, _world, tuple(MODELS))
    print("worst relative differences, 2 ranks:", worst[0])


def test_images_match_non_cp_on_4_ranks():
    worst = run_world(4, _world, ("qwen2_vl",))
    print("worst relative differences, 4 ranks:", worst[0])

