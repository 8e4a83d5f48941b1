"""The Griffin recurrent block and its RG-LRU (RecurrentGemma)."""
from __future__ import annotations

from hfpatch.mixers.family import MixerFamily
from hfpatch.mixers.forms.griffin import griffin_block_forward, rglru_scan

FAMILIES = (
    MixerFamily(
        name="griffin-block", mixer="Griffin recurrent block (causal conv + RG-LRU)",
        classes=("RecurrentGemmaRecurrentBlock",),
        bindings=(("causal_conv1d", "causal_conv1d"),),
        forwards={"33eb81c09c5752c6": "5.19.0, 5.23.0, 5.24.0: recurrent_gemma"},
        replaces=(("forward", griffin_block_forward),),
    ),
    MixerFamily(
        name="rg-lru", mixer="RG-LRU (real-gated diagonal linear recurrence)",
        classes=("RecurrentGemmaRglru",),
        bindings=(("linear_recurrence", "diagonal_recurrence"),),
        forwards={"8cb3e9038e77561e+d2ef99a3f4bffec6": "5.19.0, 5.23.0, 5.24.0: recurrent_gemma"},
        replaces=(("_rnn_scan", rglru_scan),),
    ),
)
