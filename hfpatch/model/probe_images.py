"""The images of the whole-model probe: for a vision-language model whose images hfpatch scatters under CP
(``hfpatch.model.multimodal.recognise``), a probe row holding two images of different sizes (where the family has
sizes), each image's placeholders straddling a boundary of the shard layouts, and the image inputs the model encodes
for them, built from the model's own config (random pixels, the model's own special tokens).

The probe then runs both of its forwards with the images (``hfpatch.model.probe``): the non-CP forward on the
whole row, the CP forward on this rank's shard, so the image scatter, the model's multimodal positions and the text
model's cut are compared module by module like every other part of the model.

Placement: with ``c`` = S / (2 x ranks) tokens per chunk (the zigzag and llama3 layouts cut the row into 2 x ranks
chunks, the contiguous one into ranks chunks of 2c), the first image's placeholders are centred on the boundary at
``c`` and the second's on the one at ``2c``; the row grows (``c`` grows) until both fit, with text tokens around
them.

Families and their inputs (the model's config gives every size):

- ``qwen2_vl``, ``qwen2_5_vl``, ``qwen3_vl``, ``qwen3_5``: ``pixel_values`` (patches, C x T x P x P) and
  ``image_grid_thw`` (images, 3); an image of grid (1, m, m x n) patches (m: ``spatial_merge_size``) gives n
  placeholders, wrapped in the vision start and end tokens; ``mm_token_type_ids`` (1 on placeholders) where the
  base model takes it. Images of 2 and 3 placeholders.
- ``llava``: ``pixel_values`` (images, C, H, W) at the tower's ``image_size``; every image gives (H / P)^2
  placeholders (+1 with ``vision_feature_select_strategy="full"``): two images of that one size.
- ``llava_next``: ``pixel_values`` (images, tiles, C, I, I) and ``image_sizes`` (images, 2): the two pinpoints of
  ``image_grid_pinpoints`` with the fewest tiles, of different shapes, as the image sizes (so anyres unpads
  nothing): an image of (a x I, b x I) pixels gives s^2 base features and a x s rows of b x s features, each row
  closed by the newline feature (s = I / P); the "default" feature strategy only.
- ``mistral3``: ``pixel_values`` (images, C, H, W) padded to the larger image and ``image_sizes``: images of
  (d, 2d) and (d, 3d) pixels (d = P x ``spatial_merge_size``) give 2 and 3 placeholders.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from hfpatch.model import multimodal

__all__ = ["ProbeImages", "probe_images", "IMAGE_FAMILIES"]


@dataclass(frozen=True)
class ProbeImages:
    """``ids`` (1, S): the probe's row with the images' placeholders; ``text`` (1, S): the same row's text tokens
    without the images (none of the model's image tokens: the probe's check of the model's own loss runs on it);
    ``inputs``: the image inputs of the model's forward (every rank passes them whole); ``count``: how many images;
    ``token_types``: the image token id whose placeholders make the model's ``mm_token_type_ids``, or None when its
    base model takes none."""

    ids: torch.Tensor
    text: torch.Tensor
    inputs: dict = field(default_factory=dict)
    count: int = 0
    token_types: Optional[int] = None

    def per_token(self, ids: torch.Tensor) -> dict:
        """The per-token image inputs for ``ids`` (the whole row, or this rank's shard of it)."""
        if self.token_types is None:
            return {}
        return {"mm_token_type_ids": (ids == self.token_types).to(torch.int)}


@dataclass(frozen=True)
class _Images:
    """What a family's builder gives: the token span of each image (its placeholders, with the family's start and end
    tokens), the model's image inputs, and the image token of ``ProbeImages.token_types``."""

    spans: list            # per image: a LongTensor of token ids
    inputs: dict
    token_types: Optional[int]


def _qwen(model: torch.nn.Module, base: torch.nn.Module, generator: torch.Generator) -> _Images:
    config = model.config
    vision = config.vision_config
    merge, patch, frames = vision.spatial_merge_size, vision.patch_size, vision.temporal_patch_size
    channels = getattr(vision, "in_channels", None) or getattr(vision, "in_chans", 3)
    counts = (2, 3)
    grids = torch.tensor([[1, merge, merge * n] for n in counts])
    patches = int(grids.prod(-1).sum())
    pixels = torch.randn(patches, channels * frames * patch * patch, generator=generator)
    spans = [torch.tensor([config.vision_start_token_id] + [config.image_token_id] * n + [config.vision_end_token_id])
             for n in counts]
    takes_types = "mm_token_type_ids" in inspect.signature(type(base).forward).parameters
    return _Images(spans, {"pixel_values": pixels, "image_grid_thw": grids},
                   config.image_token_id if takes_types else None)


def _image_token(config) -> int:
    """The image placeholder's id (``image_token_id``, or ``image_token_index`` where the release names it so)."""
    token = getattr(config, "image_token_id", None)
    return getattr(config, "image_token_index", None) if token is None else token


def _llava(model: torch.nn.Module, base: torch.nn.Module, generator: torch.Generator) -> _Images:
    config = model.config
    vision = config.vision_config
    side = vision.image_size // vision.patch_size
    placeholders = side * side + (1 if getattr(config, "vision_feature_select_strategy", "default") == "full" else 0)
    pixels = torch.randn(2, vision.num_channels, vision.image_size, vision.image_size, generator=generator)
    return _Images([torch.full((placeholders,), _image_token(config))] * 2, {"pixel_values": pixels}, None)


def _llava_next(model: torch.nn.Module, base: torch.nn.Module, generator: torch.Generator) -> _Images:
    config = model.config
    vision = config.vision_config
    if getattr(config, "vision_feature_select_strategy", "default") != "default":
        raise ValueError(f"probe images for llava_next need vision_feature_select_strategy='default', not "
                         f"{config.vision_feature_select_strategy!r}")
    tile, side = vision.image_size, vision.image_size // vision.patch_size
    shapes = sorted({(h // tile, w // tile) for h, w in config.image_grid_pinpoints}, key=lambda s: (s[0] * s[1], s))
    shapes = shapes[:2]
    placeholders = [side * side + a * side * (b * side + 1) for a, b in shapes]
    tiles = max(1 + a * b for a, b in shapes)
    pixels = torch.randn(len(shapes), tiles, vision.num_channels, tile, tile, generator=generator)
    sizes = torch.tensor([[a * tile, b * tile] for a, b in shapes])
    return _Images([torch.full((n,), _image_token(config)) for n in placeholders],
                   {"pixel_values": pixels, "image_sizes": sizes}, None)


def _mistral3(model: torch.nn.Module, base: torch.nn.Module, generator: torch.Generator) -> _Images:
    config = model.config
    vision = config.vision_config
    side = vision.patch_size * config.spatial_merge_size
    counts = (2, 3)
    pixels = torch.randn(len(counts), vision.num_channels, side, side * max(counts), generator=generator)
    return _Images([torch.full((n,), _image_token(config)) for n in counts],
                   {"pixel_values": pixels, "image_sizes": torch.tensor([[side, side * n] for n in counts])}, None)


# family -> the builder of its probe images
IMAGE_FAMILIES: dict[str, Callable[[torch.nn.Module, torch.nn.Module, torch.Generator], _Images]] = {
    "qwen2_vl": _qwen,
    "qwen2_5_vl": _qwen,
    "qwen3_vl": _qwen,
    "qwen3_5": _qwen,
    "llava": _llava,
    "llava_next": _llava_next,
    "mistral3": _mistral3,
}


def probe_images(model: torch.nn.Module, seq: int, world: int, vocab: int,
                 generator: torch.Generator) -> Optional[ProbeImages]:
    """The probe's row with images for ``model`` (module docstring), at least ``seq`` tokens long and a multiple
    of 2 x ``world``, text tokens drawn from ``vocab`` (none of the model's image tokens); None for a model
    ``multimodal.recognise`` does not recognise, and for one whose image tokens lie past its token embedding (it
    cannot embed an image's placeholders, so it is probed on text: the model sweep's tiny configs put them there,
    so that random text never hits them). ``KeyError`` for a recognised family without a builder
    here (a family added to ``multimodal.FAMILIES`` needs one: tests/model/test_probe_images.py checks both lists
    agree)."""
    found = multimodal.recognise(model)
    if found is None:
        return None
    owner = model if getattr(model, "config", None) is not None else found.base
    images = IMAGE_FAMILIES[found.family](owner, found.base, generator)
    special = torch.unique(torch.cat(images.spans))
    if int(special.max()) >= _embedded_tokens(found.base, vocab):
        return None   # its image tokens lie past its embedding: the model cannot take an image (text only)
    first, second = (len(span) for span in images.spans)
    chunk = max(seq // (2 * world), (first + second) // 2 + 2, first // 2 + 2)
    length = 2 * world * chunk
    ids = torch.randint(0, vocab, (length,), generator=generator)
    ids[torch.isin(ids, special)] = int(next(t for t in range(vocab) if t not in set(special.tolist())))
    text = ids.clone()
    for span, boundary in zip(images.spans, (chunk, 2 * chunk)):
        start = boundary - len(span) // 2
        ids[start:start + len(span)] = span
    return ProbeImages(ids=ids[None], text=text[None], inputs=images.inputs, count=len(images.spans),
                       token_types=images.token_types)


def _embedded_tokens(base: torch.nn.Module, vocab: int) -> int:
    """How many token ids the base model's embedding holds (``vocab`` when it has no ``get_input_embeddings``)."""
    embeddings = base.get_input_embeddings() if hasattr(base, "get_input_embeddings") else None
    return int(getattr(embeddings, "num_embeddings", vocab))
