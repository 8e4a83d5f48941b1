"""Tiny HuggingFace models built from their config classes with random weights, for ``hfpatch demo`` and the
end-to-end tests: real model code (attention, RoPE, norms, MoE routing), seconds on a CPU.

Every model: 2 layers, hidden 64, 4 query heads over 2 K/V heads (GQA), head_dim 16, vocab 128, fp32, no dropout.
The weights are initialised with a larger spread than HF's default (``initializer_range`` 0.02) so that attention
is far from uniform and a wrong mask, window or softcap changes the loss visibly.
"""
from __future__ import annotations

import torch

from hfpatch import version_gates

__all__ = ["MODEL_NAMES", "tiny_config", "build_model", "eager_reference_overrides"]

_COMMON = dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=256, attention_dropout=0.0, initializer_range=0.2,
    tie_word_embeddings=False, use_cache=False,
)

# name -> (config class name in transformers, model class name, overrides)
_MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    # sliding_window 8 on sequences of 32-64 tokens: the window is active on every layer.
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=8)),
    # Gemma2: softcapped attention logits on every layer, a sliding window on every other layer; a small cap
    # so that tanh is far from linear at these scores.
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        sliding_window=8, attn_logit_softcapping=2.0, final_logit_softcapping=30.0, query_pre_attn_scalar=16,
        hidden_activation="gelu_pytorch_tanh")),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
        decoder_sparse_step=1, mlp_only_layers=[])),
}
MODEL_NAMES = tuple(_MODELS)


def _check_name(name: str) -> None:
    if name not in _MODELS:
        raise ValueError(f"model={name!r} is not a tiny test model; expected one of {MODEL_NAMES}")


def tiny_config(name: str, *, attn_implementation: str = "eager", **overrides):
    """The tiny config of model family ``name`` (see ``MODEL_NAMES``) with ``overrides`` applied."""
    import transformers

    _check_name(name)
    config_cls, _, extra = _MODELS[name]
    kwargs = {**_COMMON, **extra, **overrides}
    config = getattr(transformers, config_cls)(**kwargs)
    # Set after construction: older releases take it only through this attribute.
    config._attn_implementation = attn_implementation
    return config


def build_model(name: str, *, seed: int = 0, attn_implementation: str = "eager", dtype: torch.dtype = torch.float32,
                **overrides) -> torch.nn.Module:
    """A tiny ``<Family>ForCausalLM`` with random weights drawn from ``seed`` (the same weights on every rank and
    for every ``attn_implementation``), in ``dtype`` (fp32 by default) and training mode."""
    import transformers

    config = tiny_config(name, attn_implementation=attn_implementation, **overrides)
    model_cls = getattr(transformers, _MODELS[name][1])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    return model.to(dtype).train()


def eager_reference_overrides(name: str) -> dict:
    """Config overrides under which the EAGER model computes what the installed release's flash path computes.

    The ring replaces transformers' flash path, so it reproduces what that path is given; on some releases that
    differs from the eager path of the same model (upstream differences, read in each release's source):

    - sliding window: eager lets a query see ``w`` keys including itself (left window w - 1), as does the flash
      path from 4.56; in 4.43-4.55 the flash path gives flash-attn ``window_size=(w, w)``: one key more.
    - Gemma2, 4.43: its flash attention passes no ``sliding_window`` at all (eager does apply it).
    - Gemma2, 4.43-4.47: its flash attention passes ``softcap`` only when flash-attn >= 2.6 is installed
      (``is_flash_attn_greater_or_equal("2.6.0")``), else None (eager always caps).
    """
    _check_name(name)
    config = {**_COMMON, **_MODELS[name][2]}
    version = version_gates.installed_transformers_version()
    if version is None:
        return {}
    overrides = {}
    window = config.get("sliding_window")
    if window is not None and version < version_gates.TRANSFORMERS_SLIDING_WINDOW_INCLUSIVE:
        overrides["sliding_window"] = window + 1
    if name == "gemma2" and version < version_gates.TRANSFORMERS_POSITION_IDS:            # 4.43
        overrides["sliding_window"] = config["max_position_embeddings"]         # longer than any test sequence
    if name == "gemma2" and version < version_gates.TRANSFORMERS_ATTENTION_FUNCTIONS:     # 4.43-4.47
        from transformers.utils import is_flash_attn_greater_or_equal

        if not is_flash_attn_greater_or_equal("2.6.0"):
            overrides["attn_logit_softcapping"] = None
    return overrides


def reference_logits(model, ids, docs=None):
    """Non-CP logits of ``ids`` (1 or B, S): the whole row at once, or, for a packed row (``docs`` = document
    lengths), each document run on its own with positions from 0 — independent documents on every release."""
    import torch

    if docs is None:
        return model(input_ids=ids, use_cache=False).logits
    pieces, start = [], 0
    for n in docs:
        pieces.append(model(input_ids=ids[:, start:start + n], position_ids=torch.arange(n)[None],
                            use_cache=False).logits)
        start += n
    return torch.cat(pieces, dim=1)
