"""Seeded bugs of a CP image path, for the whole-model probe's tests (tests/model/test_probe_images.py,
tests/model/test_model_probe_scale.py): each is installed on a model hfpatch has already patched, and the probe
(``hfpatch.model.probe.probe_model``) must reject it by name.

- ``scatter_on_the_shard``: the images written as a scatter run on this rank's shard writes them. A shard-first
  ``masked_scatter`` fills the placeholders this rank holds, in its token order, with the first features of the
  row (its source is read from the start), not with their own image's features. Silent for the model: no count
  check sees it, as the features are cut to the placeholders' number.
- ``positions_on_the_shard``: the text model given the positions a sharded row numbers (0 .. local length - 1 on
  every axis of the multimodal rotary positions) instead of the model's positions over the whole row.
"""
from __future__ import annotations

import torch

import hfpatch
from hfpatch import modes
from hfpatch.model import multimodal
from hfpatch.model.positions import global_positions


def scatter_on_the_shard(model, image_token: int):
    """Install the bug on ``model`` (patched, images recognised); returns the hook handles."""
    found = multimodal.recognise(model)
    row = {}

    def keep_the_row(module, args, kwargs):   # after hfpatch's gather: the whole row's token ids
        if modes.current_mode() == "ring":
            row["ids"] = kwargs["input_ids"]
        return None

    def rescatter(module, args, kwargs):      # before hfpatch's cut: the whole row's embeddings
        if modes.current_mode() != "ring":
            return None
        embeds = kwargs["inputs_embeds"]
        ctx = hfpatch.active_patch().ctx
        index = global_positions(ctx, ctx.step.seq_len_local)
        placeholders = row["ids"] == image_token                            # (B, S)
        features = embeds[placeholders]                                      # the batch's, in row order
        mine = placeholders[:, index].nonzero()                              # this rank's, in its order
        wrong = embeds.clone()
        wrong[mine[:, 0], index[mine[:, 1]]] = features[:mine.shape[0]]
        return args, dict(kwargs, inputs_embeds=wrong)

    return [found.base.register_forward_pre_hook(keep_the_row, with_kwargs=True),
            found.text.register_forward_pre_hook(rescatter, with_kwargs=True, prepend=True)]


def positions_on_the_shard(model):
    """Install the bug on ``model`` (patched, images recognised); returns the hook handles."""
    found = multimodal.recognise(model)

    def shard_positions(module, args, kwargs):   # after hfpatch's cut
        if modes.current_mode() != "ring":
            return None
        embeds = kwargs["inputs_embeds"]
        positions = kwargs.get("position_ids")
        rows = positions.shape[0] if positions is not None and positions.dim() == 3 else 3
        local = torch.arange(embeds.shape[1]).view(1, 1, -1).expand(rows, embeds.shape[0], -1)
        return args, dict(kwargs, position_ids=local)

    return [found.text.register_forward_pre_hook(shard_positions, with_kwargs=True)]
