"""The parameters of each kernel role as ``registry.parameter_spec`` writes them (names, kinds and defaults, no
annotations): the specs of the newest release's kernels. A family module adds the specs of its older releases'
kernels in its own ``KERNEL_PARAMETERS``; the registry accepts a bound function whose spec is any of its role's."""
from __future__ import annotations

from typing import Mapping, Tuple

__all__ = ["KERNEL_PARAMETERS"]

_CONV = ("hidden_states", "weight", "bias=None", "activation=None", "**kwargs")
_DELTA = ("query", "key", "value", "g", "beta", "chunk_size=64", "initial_state=None", "output_final_state=False",
          "use_qk_l2norm_in_kernel=False", "**kwargs")
_SSD = ("hidden_states", "dt", "A", "B", "C", "chunk_size", "D=None", "dt_bias=None", "initial_states=None",
        "dt_softplus=False", "dt_limit=(0.0, inf)", "return_final_states=False", "**kwargs")
_SSD_FUSED = ("zxbcdt", "conv1d_weight", "conv1d_bias", "dt_bias", "A", "D", "chunk_size", "initial_states=None",
              "dt_limit=(0.0, inf)", "return_final_states=False", "activation='silu'", "rmsnorm_weight=None",
              "rmsnorm_eps=1e-06", "outproj_weight=None", "outproj_bias=None", "headdim=None", "ngroups=1",
              "norm_before_gate=True", "**kwargs")
_SCAN = ("hidden_states", "dt", "A", "B", "C", "D=None", "z=None", "delta_bias=None", "delta_softplus=False",
         "return_last_state=False", "use_mambapy=False", "use_associative_scan=False", "**kwargs")
_CONV_STEP = ("hidden_states", "conv_state", "weight", "bias=None", "activation=None")
_STATE_STEP = ("state", "hidden_states", "dt", "A", "B", "C", "D=None", "dt_bias=None", "dt_softplus=False", "z=None",
               "**kwargs")

KERNEL_PARAMETERS: Mapping[str, Tuple[Tuple[str, ...], ...]] = {
    "causal_conv1d": (_CONV,),
    "chunk_gated_delta_rule": (_DELTA,),
    "ssd_chunk_scan": (_SSD,),
    "mamba2_split_conv1d_scan": (_SSD_FUSED,),
    "selective_scan": (_SCAN,),
    "causal_conv1d_update": (_CONV_STEP,),
    "mamba2_state_update": (_STATE_STEP,),
    "selective_state_update": (_STATE_STEP,),
    # hfpatch's own kernels, called by the CP forms of inline recurrences (``MixerFamily.replaces``)
    "lightning_attention": (("query", "key", "value", "slope_rate", "block_size", "initial_state=None",
                             "output_final_state=False"),),
    "diagonal_recurrence": (("hidden_states", "recurrent_gate", "reset", "recurrent_states=None",
                             "acc_dtype=torch.float32"),),
    "cca_projection": (("module", "hidden_states", "past_key_values=None", "conv_mask=None"),),
}
