"""Gated DeltaNet: a causal convolution and the chunked gated delta rule (Qwen3-Next, Qwen3.5, OLMo hybrid,
LaraMini).

From 5.19 the forward calls its kernels by module-level names (``causal_conv1d_fn``,
``torch_chunk_gated_delta_rule``), which hfpatch rebinds. Qwen3-Next of 5.0 picks them in ``__init__`` as instance
attributes, so its entry replaces ``forward`` by a CP form (``hfpatch.mixers.forms.gated_deltanet``) whose two
kernel names run the instance's kernels."""
from __future__ import annotations

from hfpatch.mixers.family import MixerFamily
from hfpatch.mixers.forms.gated_deltanet import qwen3_next_forward_instance_kernels

FAMILIES = (
    MixerFamily(
        name="gated-deltanet", mixer="Gated DeltaNet (causal conv + gated delta rule)",
        classes=("Qwen3NextGatedDeltaNet", "Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet",
                 "OlmoHybridGatedDeltaNet", "LaraMiniGatedDeltaNet"),
        bindings=(("causal_conv1d_fn", "causal_conv1d"), ("torch_chunk_gated_delta_rule", "chunk_gated_delta_rule")),
        # 5.24: 5.23's forwards with the cache argument named cache (cache_params before); LaraMini's is Qwen3.5's.
        forwards={"5a6ff6066d8b9695": "5.24.0: qwen3_next",
                  "f5ac25ccb08a27f6": "5.24.0: qwen3_5, qwen3_5_moe, lara_mini",
                  "8202c7cae83e0724": "5.24.0: olmo_hybrid (beta x 2 with allow_neg_eigval: still affine)",
                  "052c77b2f14ce8aa": "5.23.0: qwen3_next", "93cc9bac2962265d": "5.23.0: qwen3_5, qwen3_5_moe",
                  "945ac3c988a3b01c": "5.23.0: olmo_hybrid (beta x 2 with allow_neg_eigval: still affine)"},
    ),
    # The forward repeats q and k to the value heads before the call (the kernel takes as many key heads as value
    # heads); the same kernel names and parameters, the cache read otherwise.
    MixerFamily(
        name="gated-deltanet", mixer="Gated DeltaNet (causal conv + gated delta rule)",
        classes=("Qwen3NextGatedDeltaNet", "Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet",
                 "OlmoHybridGatedDeltaNet"),
        bindings=(("causal_conv1d_fn", "causal_conv1d"), ("torch_chunk_gated_delta_rule", "chunk_gated_delta_rule")),
        forwards={"63135e43b6c96306": "5.19.0: qwen3_next", "6a7fb7096a1c1fa1": "5.19.0: qwen3_5, qwen3_5_moe",
                  "0c93520dfed77227": "5.19.0: olmo_hybrid (beta x 2 with allow_neg_eigval)"},
    ),
    # The kernels are instance attributes (causal-conv1d's function or nn.Conv1d; fla's or HF's torch delta rule).
    MixerFamily(
        name="gated-deltanet", mixer="Gated DeltaNet (causal conv + gated delta rule)",
        classes=("Qwen3NextGatedDeltaNet",),
        bindings=(("causal_conv1d", "causal_conv1d"), ("chunk_gated_delta_rule", "chunk_gated_delta_rule")),
        forwards={"e8ac44127045a5ae": "5.0.0: qwen3_next"},
        replaces=(("forward", qwen3_next_forward_instance_kernels),),
    ),
)

# The kernel names of the CP form above: each takes the instance's kernel as ``implementation`` and passes every
# argument the kind reads (hidden_states / query, key, value, g, beta, initial_state, output_final_state) on.
KERNEL_PARAMETERS = {
    "causal_conv1d": (("hidden_states", "weight", "bias=None", "activation=None", "implementation=None"),),
    "chunk_gated_delta_rule": (("query", "key", "value", "g", "beta", "implementation", "initial_state=None",
                                "output_final_state=False", "use_qk_l2norm_in_kernel=False"),),
}
