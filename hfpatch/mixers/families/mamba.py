"""Mamba: a causal convolution and the selective scan (Jamba, Zamba)."""
from __future__ import annotations

from hfpatch.mixers.family import MixerFamily
from hfpatch.mixers.forms.mamba import jamba_forward

FAMILIES = (
    MixerFamily(
        name="mamba", mixer="Mamba (causal conv + selective scan)",
        classes=("JambaMambaMixer", "ZambaMambaMixer"),
        bindings=(("causal_conv1d_fn", "causal_conv1d"), ("mamba_selective_scan", "selective_scan"),
                  ("causal_conv1d_update", "causal_conv1d_update"),
                  ("mamba_selective_state_update", "selective_state_update")),
        # 5.24: 5.23's forwards with the cache argument named cache (cache_params before).
        forwards={"69d9248863d75128": "5.24.0: jamba", "271b58b34b9462de": "5.24.0: zamba",
                  "87d4a4c321593491": "5.23.0: jamba", "e57915bae9b46411": "5.23.0: zamba"},
    ),
    # Releases whose forward dispatches to slow_forward (the conv and the scan loop inline) or cuda_kernels_forward
    # (imported CUDA kernels): forward replaced by a CP form (hfpatch.mixers.forms.mamba) whose conv and scan go
    # through the names below; it checks the dispatched methods' fingerprints (forms.mamba.JAMBA_METHODS_READ).
    MixerFamily(
        name="mamba-inline", mixer="Mamba (causal conv + selective scan), computed inline",
        classes=("JambaMambaMixer",),
        bindings=(("causal_conv1d", "causal_conv1d"), ("mamba_selective_scan", "selective_scan")),
        forwards={"95365786e1260ddc": "4.43.4: jamba", "f48e4ebccba1fe26": "4.48.3, 4.53.3, 4.54.1: jamba",
                  "38da638c3fa25da5": "5.0.0: jamba"},
        replaces=(("forward", jamba_forward),),
    ),
)

KERNEL_PARAMETERS = {
    # hfpatch.mixers.forms.mamba.mamba_selective_scan (the token loop of the releases that compute it inline)
    "selective_scan": (("hidden_states", "dt", "A", "B", "C", "D=None", "z=None", "delta_bias=None",
                        "delta_softplus=False", "return_last_state=False"),),
}
