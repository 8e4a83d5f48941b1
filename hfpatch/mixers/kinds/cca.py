"""ZAYA's compressed convolutional attention projection (``ZayaCCAProjection``) under CP.

The projection convolves the queries and keys along the sequence (a depthwise then a grouped convolution over
W = (K0 - 1) + (K1 - 1) previous tokens, the sequence zero-padded on the left), and half of each value head is the
previous token's delayed projection (``v_proj_delayed`` of zeros before the first token). Its state entering a run
of tokens is therefore a window: the last W projected query/key columns and the last token's delayed value.

Under CP each segment's summary is exactly that window, from its own tokens (zero-padded when it is shorter than
W): per segment (B, Cqk, W) + (B, Cv) travels in the activations' dtype. The window entering a segment, composed
in global order, is handed to HF's own ``ZayaCCAProjection.forward`` as its cache (in the cache interface that
release reads: ``_Window``; the path HF takes when it continues from a cache), so HF's code computes every segment.

``cca_projection`` calls HF's own forward; ZAYA's CP forms (``hfpatch.mixers.forms.zaya``) replace that forward
by a call of ``cca_projection`` by name, so that under CP the kernel's wrapper runs ``CcaProjection.run_cp``.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from hfpatch.errors import UnsupportedArgument
from hfpatch.mixers.kernel import CACHE_FIX, CACHE_REASON, KernelCall, SequenceKernel
from hfpatch.mixers.segments import SegmentPlan
from ring_kernels.layout import shard, unshard

__all__ = ["CcaProjection", "cca_projection"]


def cca_projection(module, hidden_states: torch.Tensor, past_key_values=None,
                   conv_mask: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """HF's own ``ZayaCCAProjection.forward`` of ``module``: hidden (B, L, hidden) -> q, k, v (B, L, heads, D)."""
    return type(module).forward(module, hidden_states, past_key_values, conv_mask)


class _Window:
    """The window (B, C, W) of projected queries/keys and the delayed value (B, Cv) entering a segment, in the
    cache interface each release's ``ZayaCCAProjection.forward`` reads when it continues from a cache:

    - 5.23: ``get_conv_state(layer_idx)`` / ``get_recurrent_state(layer_idx)``;
    - 5.19: ``has_previous_state(layer_idx)``, then ``layers[layer_idx].conv_states[0]`` /
      ``layers[layer_idx].recurrent_states[0]``.

    Both return the same two tensors; the forward's updates of the cache are dropped."""

    def __init__(self, window: torch.Tensor, delayed_value: torch.Tensor) -> None:
        self.window, self.delayed_value = window, delayed_value
        self.conv_states, self.recurrent_states = [window], [delayed_value]

    def get_conv_state(self, layer_idx, state_idx=0):
        return self.window

    def get_recurrent_state(self, layer_idx, state_idx=0):
        return self.delayed_value

    def has_previous_state(self, layer_idx=None):
        return True

    @property
    def layers(self) -> "_EveryLayer":
        return _EveryLayer(self)

    def update_conv_state(self, *args, **kwargs):
        return None

    def update_recurrent_state(self, *args, **kwargs):
        return None


class _EveryLayer:
    """``cache.layers``: every layer index gives the same window (the forward reads its own layer's only)."""

    def __init__(self, window: _Window) -> None:
        self.window = window

    def __getitem__(self, layer_idx) -> _Window:
        return self.window


def _left_pad(x: torch.Tensor, width: int) -> torch.Tensor:
    """x (B, n, hidden) with n <= width, zero-padded on the left to (B, width, hidden)."""
    if x.shape[1] == width:
        return x
    return torch.cat([x.new_zeros(x.shape[0], width - x.shape[1], x.shape[2]), x], dim=1)


class CcaProjection(SequenceKernel):
    """``cca_projection(module, hidden_states (B, L, hidden), past_key_values, conv_mask (B, L)) -> (q, k, v)``,
    each (B, L, heads, D)."""

    role = "cca_projection"
    token_args = {"hidden_states": 1, "conv_mask": 1}
    output_token_dim = 1

    def check(self, call: KernelCall) -> None:
        if call.arg("past_key_values") is not None:
            raise UnsupportedArgument("past_key_values", call.arg("past_key_values"), CACHE_REASON, CACHE_FIX)

    def run_cp(self, call: KernelCall, plan: SegmentPlan):
        module, hidden = call.arg("module"), call.arg("hidden_states")
        mask = call.arg("conv_mask")
        if mask is not None:  # HF's first step, a per-token product: done here once for every segment
            hidden = hidden * mask[:, :, None].to(hidden.dtype)
        width, batch = module.conv_kernel_size, hidden.shape[0]
        reach = max(width, 1)  # the delayed value reads one token back even when the convolution reads none

        # Each segment's last ``reach`` tokens (zero-padded on the left), projected in one call of each projection.
        tails = torch.cat([_left_pad(part[:, -reach:], reach) for part in plan.split(hidden, dim=1)], dim=0)
        window = torch.cat([module.q_proj(tails), module.k_proj(tails)], dim=-1).transpose(1, 2)[..., reach - width:]
        delayed = module.v_proj_delayed(tails[:, -1:])[:, 0]
        channels = window.shape[1]
        real = torch.cat([torch.arange(width, device=hidden.device) >= width - min(s.length, width)
                          for s in plan.local for _ in range(batch)]).reshape(-1, 1, width)
        window = window * real.to(window.dtype)  # HF pads the projected sequence with zeros, not projected zeros
        summaries = list(zip(window.split(batch), delayed.split(batch)))

        def unpack(state):  # the state entering a segment, one tensor (B, C*W + Cv): window (B, C, W), value
            return state[:, :channels * width].reshape(batch, channels, width), state[:, channels * width:]

        def compose(state, summary, segment):
            previous, _ = unpack(state)
            keep = min(segment.length, width)
            joined = torch.cat([previous, summary[0][..., width - keep:]], dim=-1)[..., -width:]
            return torch.cat([joined.flatten(1), summary[1]], dim=1)

        no_token = module.v_proj_delayed(hidden.new_zeros(batch, 1, hidden.shape[-1]))[:, 0]  # HF's value at t=0
        start = torch.cat([no_token.new_zeros(batch, channels * width), no_token], dim=1)
        entering = [unpack(state) for state in plan.exchange(summaries, compose, start)]

        # HF's forward on the whole local shard from the first segment's window: right everywhere except the first
        # ``width`` tokens of each later segment, which HF recomputes from that segment's own window.
        whole = call.original_with(hidden_states=hidden, past_key_values=_Window(*entering[0]), conv_mask=None)
        pieces, cursor = [[] for _ in whole], 0
        for segment, carried in zip(plan.local[1:], entering[1:]):
            head = min(segment.length, reach)
            fixed = call.original_with(hidden_states=hidden[:, segment.local_start:segment.local_start + head],
                                       past_key_values=_Window(*carried), conv_mask=None)
            for column, full, part in zip(pieces, whole, fixed):
                column += [full[:, cursor:segment.local_start], part]
            cursor = segment.local_start + head
        return tuple(torch.cat(column + [full[:, cursor:]], dim=1) for column, full in zip(pieces, whole))

    def reference(self, call: KernelCall, plan: SegmentPlan):
        """HF's projection on the all-gathered sequence; this rank's tokens of q, k and v."""
        whole = {name: unshard(call.arg(name), plan.group, layout=plan.layout, dim=1, cu_seqlens=plan.cu_seqlens)
                 for name in self.token_args if call.arg(name) is not None}
        outputs = call.original_with(**whole)
        return tuple(shard(x, plan.group, layout=plan.layout, dim=1, cu_seqlens=plan.cu_seqlens) for x in outputs)

