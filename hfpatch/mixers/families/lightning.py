"""Lightning attention: linear attention with a per-head scalar decay (MiniMax)."""
from __future__ import annotations

from hfpatch.mixers.family import MixerFamily
from hfpatch.mixers.lightning import minimax_lightning_forward

FAMILIES = (
    MixerFamily(
        name="lightning-attention", mixer="lightning attention (linear attention with a per-head scalar decay)",
        classes=("MiniMaxLightningAttention",),
        bindings=(("lightning_attention", "lightning_attention"),),
        forwards={"1ccc4f34915ff169": "5.23.0: minimax"},
        replaces=(("forward", minimax_lightning_forward),),
    ),
)
