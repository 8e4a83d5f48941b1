"""Lightning attention: linear attention with a per-head scalar decay (MiniMax).

Every release computes the recurrence inline, so each entry replaces ``forward`` by a CP form written for that
release's code (``hfpatch.mixers.forms.lightning``)."""
from __future__ import annotations

from hfpatch.mixers.family import MixerFamily
from hfpatch.mixers.forms.lightning import (minimax_lightning_forward, minimax_lightning_forward_cache,
                                            minimax_lightning_forward_value_mask)

FAMILIES = (
    # 5.24: 5.23's forward with the cache argument named cache (past_key_values before).
    MixerFamily(
        name="lightning-attention", mixer="lightning attention (linear attention with a per-head scalar decay)",
        classes=("MiniMaxLightningAttention",),
        bindings=(("lightning_attention", "lightning_attention"),),
        forwards={"1e63b047235d7a50": "5.24.0: minimax"},
        replaces=(("forward", minimax_lightning_forward_cache),),
    ),
    MixerFamily(
        name="lightning-attention", mixer="lightning attention (linear attention with a per-head scalar decay)",
        classes=("MiniMaxLightningAttention",),
        bindings=(("lightning_attention", "lightning_attention"),),
        forwards={"1ccc4f34915ff169": "5.19.0, 5.23.0: minimax"},
        replaces=(("forward", minimax_lightning_forward),),
    ),
    # The padding mask zeroes the values (not the activated qkv); the cache is ``past_key_value`` before 5.0.
    MixerFamily(
        name="lightning-attention", mixer="lightning attention (linear attention with a per-head scalar decay)",
        classes=("MiniMaxLightningAttention",),
        bindings=(("lightning_attention", "lightning_attention"),),
        forwards={"e044d271f1b3d723": "4.53.3, 4.54.1: minimax", "f9f1020ee4fc1127": "5.0.0: minimax"},
        replaces=(("forward", minimax_lightning_forward_value_mask),),
    ),
)
