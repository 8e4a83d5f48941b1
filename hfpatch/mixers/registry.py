"""The versioned registry of sequence-mixer modules hfpatch runs exactly under CP.

A mixer module is recognised the way ``_flash_attention_forward`` is: by what hfpatch relies on, never by name
alone. For a module of class C defined in modeling module M, an entry of ``FAMILIES`` recognises it when

1. C's name is one of the family's ``classes``;
2. the fingerprint of C's ``forward`` (``forward_fingerprint``: a hash of its syntax tree, decorators dropped, so
   formatting and comments do not count) is one the family lists -- the forward calls the kernels below by these
   global names with these arguments, and nothing else in it mixes tokens;
3. each of the family's ``bindings`` (global name in M -> kernel role) exists in M, and the parameters of the
   function bound there (``parameter_spec``) are one of the role's ``KERNEL_PARAMETERS``.

Anything else of a mixer-like class (another release's forward, a renamed kernel, a changed kernel signature)
is not recognised: ``recognise`` returns None and ``unrecognised_reason`` says which check failed, and the audit
refuses the module by name. Adding a release: run ``forward_fingerprint`` on the new class, read the forward to
check that it still calls the kernels the same way, add the fingerprint (with the releases it covers) and prove it
with the family's test on that release.
"""
from __future__ import annotations

import ast
import hashlib
import inspect
import sys
import textwrap
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Tuple

import torch

__all__ = ["MixerFamily", "Recognised", "FAMILIES", "KERNEL_PARAMETERS", "recognise", "unrecognised_reason",
           "forward_fingerprint", "class_fingerprint", "parameter_spec"]


@dataclass(frozen=True)
class MixerFamily:
    """``name``: the family; ``mixer``: what it is, in words; ``classes``: module class names; ``bindings``:
    (global name in the class's modeling module, kernel role) pairs the forward calls; ``forwards``: forward
    fingerprint -> the releases (and model types) it was read and tested on.

    ``replaces``: for mixers whose recurrence HF computes inline (no kernel name to rebind), (method name, CP form)
    pairs: under CP, ``install_mixers`` replaces each method on the instance by its CP form (``form(module, *args,
    **kwargs)``: the same computation, its sequence parts through kernels); the ``bindings`` are then names in the
    CP forms' module, and ``forwards`` keys join the fingerprints of ``forward`` and each other replaced method
    with "+" (``class_fingerprint``)."""

    name: str
    mixer: str
    classes: Tuple[str, ...]
    bindings: Tuple[Tuple[str, str], ...]
    forwards: Mapping[str, str]
    replaces: Tuple[Tuple[str, Callable], ...] = ()


@dataclass(frozen=True)
class Recognised:
    """A recognised mixer module: its ``family`` and the modeling ``module`` whose globals hfpatch rebinds."""

    family: MixerFamily
    module: object


# Parameters of each kernel role, as ``parameter_spec`` writes them (names, kinds and defaults, no annotations).
_CONV = ("hidden_states", "weight", "bias=None", "activation=None", "**kwargs")
_DELTA = ("query", "key", "value", "g", "beta", "chunk_size=64", "initial_state=None", "output_final_state=False",
          "use_qk_l2norm_in_kernel=False", "**kwargs")
KERNEL_PARAMETERS: Mapping[str, Tuple[Tuple[str, ...], ...]] = {
    "causal_conv1d": (_CONV,),
    "chunk_gated_delta_rule": (_DELTA,),
}

# Mamba2 (SSD) and Mamba (selective scan): HF 5.23's module-level kernels of the Mamba mixers.
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
KERNEL_PARAMETERS = {**KERNEL_PARAMETERS, "ssd_chunk_scan": (_SSD,), "mamba2_split_conv1d_scan": (_SSD_FUSED,),
                     "selective_scan": (_SCAN,), "causal_conv1d_update": (_CONV_STEP,),
                     "mamba2_state_update": (_STATE_STEP,), "selective_state_update": (_STATE_STEP,)}

FAMILIES: Tuple[MixerFamily, ...] = (
    MixerFamily(
        name="short-conv", mixer="gated short causal convolution (LFM2)",
        classes=("Lfm2ShortConv", "Lfm2MoeShortConv", "Lfm3ShortConv"),
        bindings=(("causal_conv1d_fn", "causal_conv1d"),),
        forwards={"9d25f6f80e2dfb9d": "5.23.0: lfm2, lfm2_moe, lfm3"},
    ),
    MixerFamily(
        name="gated-deltanet", mixer="Gated DeltaNet (causal conv + gated delta rule)",
        classes=("Qwen3NextGatedDeltaNet", "Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet",
                 "OlmoHybridGatedDeltaNet"),
        bindings=(("causal_conv1d_fn", "causal_conv1d"), ("torch_chunk_gated_delta_rule", "chunk_gated_delta_rule")),
        forwards={"052c77b2f14ce8aa": "5.23.0: qwen3_next", "93cc9bac2962265d": "5.23.0: qwen3_5, qwen3_5_moe",
                  "945ac3c988a3b01c": "5.23.0: olmo_hybrid (beta x 2 with allow_neg_eigval: still affine)"},
    ),
    MixerFamily(
        name="mamba2", mixer="Mamba2 (causal conv + SSD scan)",
        classes=("BambaMixer", "FalconH1Mixer", "NemotronHMamba2Mixer", "Zamba2MambaMixer",
                 "GraniteMoeHybridMambaLayer"),
        bindings=(("mamba2_split_conv1d_scan_combined", "mamba2_split_conv1d_scan"),
                  ("causal_conv1d_fn", "causal_conv1d"), ("mamba2_chunk_scan", "ssd_chunk_scan"),
                  ("causal_conv1d_update", "causal_conv1d_update"),
                  ("mamba2_selective_state_update", "mamba2_state_update")),
        forwards={"0b88953ce0c266d5": "5.23.0: bamba, nemotron_h, zamba2, granitemoehybrid",
                  "d26f69c65020a12a": "5.23.0: falcon_h1"},
    ),
    MixerFamily(
        name="mamba", mixer="Mamba (causal conv + selective scan)",
        classes=("JambaMambaMixer", "ZambaMambaMixer"),
        bindings=(("causal_conv1d_fn", "causal_conv1d"), ("mamba_selective_scan", "selective_scan"),
                  ("causal_conv1d_update", "causal_conv1d_update"),
                  ("mamba_selective_state_update", "selective_state_update")),
        forwards={"87d4a4c321593491": "5.23.0: jamba", "e57915bae9b46411": "5.23.0: zamba"},
    ),
)
# Lightning attention (MiniMax), the Griffin block and its RG-LRU (RecurrentGemma), Kimi delta attention (Kimi-Linear,
# Bailing hybrid: the gated delta rule with per-channel gates) and ZAYA's convolutional q/k projection.
from hfpatch.mixers.cca import zaya_cca_forward  # noqa: E402  (after the base tables they extend)
from hfpatch.mixers.lightning import minimax_lightning_forward  # noqa: E402
from hfpatch.mixers.rglru import griffin_block_forward, rglru_scan  # noqa: E402

KERNEL_PARAMETERS = {
    **KERNEL_PARAMETERS,
    "lightning_attention": (("query", "key", "value", "slope_rate", "block_size", "initial_state=None",
                             "output_final_state=False"),),
    "diagonal_recurrence": (("hidden_states", "recurrent_gate", "reset", "recurrent_states=None",
                             "acc_dtype=torch.float32"),),
    "cca_projection": (("module", "hidden_states", "past_key_values=None", "conv_mask=None"),),
}
FAMILIES = FAMILIES + (
    MixerFamily(
        name="lightning-attention", mixer="lightning attention (linear attention with a per-head scalar decay)",
        classes=("MiniMaxLightningAttention",),
        bindings=(("lightning_attention", "lightning_attention"),),
        forwards={"1ccc4f34915ff169": "5.23.0: minimax"},
        replaces=(("forward", minimax_lightning_forward),),
    ),
    MixerFamily(
        name="griffin-block", mixer="Griffin recurrent block (causal conv + RG-LRU)",
        classes=("RecurrentGemmaRecurrentBlock",),
        bindings=(("causal_conv1d", "causal_conv1d"),),
        forwards={"33eb81c09c5752c6": "5.23.0: recurrent_gemma"},
        replaces=(("forward", griffin_block_forward),),
    ),
    MixerFamily(
        name="rg-lru", mixer="RG-LRU (real-gated diagonal linear recurrence)",
        classes=("RecurrentGemmaRglru",),
        bindings=(("linear_recurrence", "diagonal_recurrence"),),
        forwards={"8cb3e9038e77561e+d2ef99a3f4bffec6": "5.23.0: recurrent_gemma"},
        replaces=(("_rnn_scan", rglru_scan),),
    ),
    MixerFamily(
        name="kimi-delta-attention", mixer="Kimi delta attention (causal conv + gated delta rule, per-channel gates)",
        classes=("KimiLinearDeltaAttention", "BailingHybridDeltaAttention"),
        bindings=(("causal_conv1d_fn", "causal_conv1d"), ("chunk_kimi_delta_attention", "chunk_gated_delta_rule")),
        forwards={"558dac8b8535e46d": "5.23.0: kimi_linear", "fb5e5fc426e864bd": "5.23.0: bailing_hybrid"},
    ),
    MixerFamily(
        name="zaya-cca", mixer="ZAYA's convolutional q/k projection (causal q/k convolution, delayed values)",
        classes=("ZayaCCAProjection",),
        bindings=(("cca_projection", "cca_projection"),),
        forwards={"0f26620ced6ade2f": "5.23.0: zaya"},
        replaces=(("forward", zaya_cca_forward),),
    ),
)
_BY_CLASS = {name: family for family in FAMILIES for name in family.classes}


def forward_fingerprint(function: Callable) -> str:
    """16 hex digits of the sha256 of ``function``'s syntax tree (decorators dropped, no positions); the
    function is unwrapped first (``functools.wraps`` decorators such as ``force_accelerate_hooks``)."""
    function = inspect.unwrap(function)
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    node = next(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
    node.decorator_list = []
    return hashlib.sha256(ast.dump(node, annotate_fields=False, include_attributes=False).encode()).hexdigest()[:16]


def parameter_spec(function: Callable) -> Tuple[str, ...]:
    """The parameters of ``function`` (its signature, following ``__wrapped__``): names with ``*``/``**`` and
    ``=default`` for defaults, annotations left out."""
    spec = []
    for p in inspect.signature(function).parameters.values():
        prefix = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}.get(p.kind, "")
        default = "" if p.default is inspect.Parameter.empty else f"={p.default!r}"
        spec.append(f"{prefix}{p.name}{default}")
    return tuple(spec)


def class_fingerprint(cls: type, family: MixerFamily) -> str:
    """``forward_fingerprint`` of ``cls.forward``, joined by "+" with those of the other methods ``family``
    replaces (``MixerFamily.replaces``), in that order."""
    methods = ["forward"] + [name for name, _ in family.replaces if name != "forward"]
    return "+".join(forward_fingerprint(getattr(cls, name)) for name in methods)


def _check(module: torch.nn.Module) -> Tuple[Optional[Recognised], str]:
    cls = type(module)
    family = _BY_CLASS.get(cls.__name__)
    if family is None:
        return None, f"{cls.__name__} is not a mixer class hfpatch's mixer registry knows"
    try:
        fingerprint = class_fingerprint(cls, family)
    except (OSError, TypeError, StopIteration, SyntaxError) as exc:
        return None, f"the source of {cls.__name__}.forward cannot be read ({type(exc).__name__})"
    if fingerprint not in family.forwards:
        known = "; ".join(family.forwards.values())
        return None, (f"{cls.__name__}.forward (fingerprint {fingerprint}) is not a forward hfpatch has read and "
                      f"tested for the {family.name} family (known: {known})")
    source = family.replaces[0][1].__module__ if family.replaces else cls.__module__
    modeling = sys.modules.get(source)
    for name, role in family.bindings:
        function = getattr(modeling, name, None) if modeling is not None else None
        if not callable(function):
            return None, f"{source} has no function {name} (the {role} kernel its forward calls)"
        try:
            spec = parameter_spec(function)
        except (TypeError, ValueError):
            return None, f"{source}.{name} has no readable signature"
        if spec not in KERNEL_PARAMETERS[role]:
            return None, (f"{source}.{name}{spec} does not have the parameters hfpatch's {role} kernel "
                          f"expects {KERNEL_PARAMETERS[role][0]}")
    for path, child in module.named_modules():  # a recognised module's mixers run inside it: they must be too
        if path and type(child).__name__ in _BY_CLASS:
            inner, why = _check(child)
            if inner is None:
                return None, f"its submodule {path} is not recognised: {why}"
    return Recognised(family, modeling), ""


def recognise(module: torch.nn.Module) -> Optional[Recognised]:
    """The registry's verdict on ``module``: ``Recognised`` (hfpatch runs it exactly under CP) or None."""
    return _check(module)[0]


def unrecognised_reason(module: torch.nn.Module) -> str:
    """Why ``recognise(module)`` is None, in one sentence ("" when it is recognised)."""
    return _check(module)[1]
