"""Gated short causal convolution (LFM2 and its relatives).

From 5.19 the forward calls ``causal_conv1d_fn`` by name (rebound under CP); 4.54 - 5.0 convolve inline with an
``nn.Conv1d`` in ``slow_forward`` (``forward`` picks it, or ``cuda_kernels_forward`` on CUDA), so that entry
replaces ``forward`` by ``hfpatch.mixers.forms.short_conv.lfm2_short_conv_forward``, written for
``slow_forward``'s code.
Its key is ``forward``'s fingerprint only: the registry tries a class's entries in order and stops at one whose
replaced method the class lacks, so a ``slow_forward`` entry would end the search for the 5.19+ classes."""
from __future__ import annotations

from hfpatch.mixers.family import MixerFamily
from hfpatch.mixers.forms.short_conv import lfm2_short_conv_forward

# The fingerprint of ``slow_forward`` (the code ``lfm2_short_conv_forward`` follows) read with each forward of the
# inline entry below; tests/mixers/test_mixers_lightning_short_conv_releases.py checks it on every local release.
SLOW_FORWARD_OF = {"d85b1b4a2b04f161": "d7c74a40cfe51ab5", "a048a21f1ad607b8": "986591540db3cf0a",
                   "cb9586d7ad7ca1e9": "3ef75800d50cdd9b"}

FAMILIES = (
    MixerFamily(
        name="short-conv", mixer="gated short causal convolution (LFM2)",
        classes=("Lfm2ShortConv", "Lfm2MoeShortConv", "Lfm3ShortConv"),
        bindings=(("causal_conv1d_fn", "causal_conv1d"),),
        forwards={"3fcd77d0837e1ce0": "5.24.0: lfm2, lfm2_moe, lfm3 (5.23's forward, the cache argument named cache)",
                  "9d25f6f80e2dfb9d": "5.23.0: lfm2, lfm2_moe, lfm3",
                  "f3dee8609f73bd55": "5.19.0: lfm2, lfm2_moe (seq_idx passed on by name)"},
    ),
    MixerFamily(
        name="short-conv", mixer="gated short causal convolution (LFM2)",
        classes=("Lfm2ShortConv", "Lfm2MoeShortConv"),
        bindings=(("causal_conv1d", "causal_conv1d"),),
        forwards={"d85b1b4a2b04f161": "4.54.1: lfm2", "a048a21f1ad607b8": "5.0.0: lfm2",
                  "cb9586d7ad7ca1e9": "5.0.0: lfm2_moe"},
        replaces=(("forward", lfm2_short_conv_forward),),
    ),
)
