"""The whole-model probe with images (``hfpatch.model.probe_images``): ``apply(model=)`` on a vision-language
model whose images hfpatch scatters probes it with two images straddling shard boundaries, module by module, on
every rank; and two seeded bugs of a CP image path are rejected by name:

- **sharding before the feature scatter** (what hfpatch would do without ``hfpatch.model.multimodal``'s hooks and
  without the inputs guard): each rank's base model embeds its shard and scatters every image into the
  placeholders it holds, which are never all of them. The model's own feature count check fails on every rank, and
  the probe names the CP forward (``VerificationError``) instead of letting the first step fail or hang;
- **positions numbered on the shard** (the image scatter right, but the text model given the positions of a
  sharded row instead of the model's multimodal positions over the whole row): silent for the model, rejected by
  the probe's comparison (``ModelDivergence``) at the first module that reads them.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import hfpatch
from _dist import run_world
from hfpatch import modes
from hfpatch.errors import ModelDivergence, VerificationError
from hfpatch.model import attach, multimodal, probe_images
from hfpatch.undo import UndoStack
from test_vlm_images import MODELS

transformers = pytest.importorskip("transformers")


def _probe_with_images(rank, world, name):
    torch.manual_seed(0)
    model = MODELS[name][0]()
    with hfpatch.apply(dist.group.WORLD, model=model) as patch:
        result = patch.probe
    assert result.images == 2, f"{name}: the probe encoded {result.images} images"
    assert result.tokens % (2 * world) == 0 and result.tokens >= 8 * world
    return result.worst, result.compared, result.tokens


def test_every_family_with_images_has_probe_images():
    assert set(probe_images.IMAGE_FAMILIES) == set(multimodal.FAMILIES)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_probe_compares_every_module_with_images(name):
    results = run_world(2, _probe_with_images, name)
    assert len({r[1] for r in results}) == 1, f"{name}: ranks compared different numbers of tensors: {results}"
    worst, compared, tokens = results[0]
    print(f"{name}: probe with 2 images over {tokens} tokens, {compared} tensors compared, worst {worst:.2g}")


def _no_image_hooks(model, ctx_of):
    return None


def _no_guard(model, ctx_of):
    return UndoStack("no inputs guard (a seeded bug)")


def _sharded_before_the_scatter(rank, world, name):
    attach.multimodal.install = _no_image_hooks
    attach.install_inputs_guard = _no_guard
    model = MODELS[name][0]()
    with pytest.raises(VerificationError) as info:
        hfpatch.apply(dist.group.WORLD, model=model)
    assert getattr(info.value, "forward", None) == "CP", info.value
    assert "CP forward raised" in str(info.value) and "image" in str(info.value.__cause__).lower(), info.value
    return True


def test_sharding_before_the_scatter_is_rejected_by_name():
    assert all(run_world(2, _sharded_before_the_scatter, "llava"))
    assert all(run_world(2, _sharded_before_the_scatter, "qwen2_vl"))


def _shard_positions(module, args, kwargs):
    """A seeded bug: under CP the text model gets the positions a sharded row numbers (0..local length - 1 on
    every axis of the multimodal rotary positions), not the model's positions over the whole row."""
    if modes.current_mode() != "ring":
        return None
    embeds = kwargs["inputs_embeds"]
    positions = kwargs.get("position_ids")
    rows = positions.shape[0] if positions is not None and positions.dim() == 3 else 3
    local = torch.arange(embeds.shape[1]).view(1, 1, -1).expand(rows, embeds.shape[0], -1)
    return args, dict(kwargs, position_ids=local)


def _positions_on_the_shard(rank, world, name):
    model = MODELS[name][0]()
    found = multimodal.recognise(model)
    found.text.register_forward_pre_hook(_shard_positions, with_kwargs=True)   # before hfpatch's own hooks
    with pytest.raises(ModelDivergence) as info:
        hfpatch.apply(dist.group.WORLD, model=model)
    assert info.value.module_path.startswith("model.language_model"), info.value
    return info.value.module_path


def test_positions_numbered_on_the_shard_are_rejected_by_the_probe():
    paths = run_world(2, _positions_on_the_shard, "qwen2_vl")
    assert len(set(paths)) == 1, paths
    print("first divergence:", paths[0])
