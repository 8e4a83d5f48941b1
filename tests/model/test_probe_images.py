"""The whole-model probe with images (``hfpatch.model.probe_images``): ``apply(model=)`` on a vision-language
model whose images hfpatch scatters probes it with two images straddling shard boundaries, module by module, on
every rank; and two seeded bugs of a CP image path are rejected by name:

- **sharding before the feature scatter** (what hfpatch would do without ``hfpatch.model.multimodal``'s hooks and
  without the inputs guard): each rank's base model embeds its shard and scatters every image into the
  placeholders it holds, which are never all of them. The model's own feature count check fails on every rank, and
  the probe names the CP forward (``VerificationError``) instead of letting the first step fail or hang;
- silent ones (``_seeded_image_bugs``): the images written as a scatter on this rank's shard would write them
  (its placeholders get the row's first features), and the text model given the positions of a sharded row
  instead of the model's multimodal positions over the whole row. The model runs; the probe's comparison
  rejects them (``ModelDivergence``) in the text model.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import hfpatch
from _dist import run_world
from hfpatch.errors import ModelDivergence, VerificationError
from hfpatch.model import attach, multimodal, probe_images
from hfpatch.model.probe import probe_model
from hfpatch.undo import UndoStack
import _seeded_image_bugs as seeded
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


def _rejected(rank, world, name, bug):
    model = MODELS[name][0]()
    with hfpatch.apply(dist.group.WORLD, model=model, verify="fast") as patch:
        handles = bug(model)
        with pytest.raises(ModelDivergence) as info:
            probe_model(model, patch)
        for handle in handles:
            handle.remove()
        assert probe_model(model, patch).images == 2    # the same model without the bug: accepted
    assert info.value.module_path.startswith("model.language_model"), info.value
    return info.value.module_path, info.value.check, info.value.error


def _scatter_on_the_shard(model):
    return seeded.scatter_on_the_shard(model, model.config.image_token_id)


@pytest.mark.parametrize("name, bug", [("llava", _scatter_on_the_shard), ("qwen2_vl", _scatter_on_the_shard),
                                       ("qwen2_vl", seeded.positions_on_the_shard)])
def test_a_wrong_image_path_is_rejected_by_the_probe(name, bug):
    found = run_world(2, _rejected, name, bug)
    assert len(set(found)) == 1, found
    print(f"{name}, {bug.__name__}: rejected at the {found[0][1]} ({found[0][2]:.3g})")
