"""Tiny random-weight builds of catalog classes: each class from its OWN config class, no downloads, ever.

``tiny_config(entry)`` is the family's default config put through one generic shrink (every attribute the config
has, by name: vocab 128, hidden 64, intermediate 128, 2 layers, 4 query heads over 2 K/V heads of head_dim 16,
no dropout, no cache, ``initializer_range`` 0.2, MoE 4 experts top-2 without jitter, every sliding window 8 so
that it is active on 32-64 tokens, special token ids inside the vocabulary), then the family's recipe
(``_RECIPES``: overrides where the generic shrink fails or leaves a degenerate model). ``tie_word_embeddings``
keeps the family's default.

Per-layer pattern lists (``layer_types``, ``mlp_layer_types``, ... : every list attribute as long as the default
stack) are not cut to a prefix but *compressed*: the first layer of each distinct (attention kind, mlp kind, ...)
combination is kept, in order, so that a hybrid keeps every kind of layer it has. Families that encode the
pattern otherwise (periods, index lists, pattern strings) say their pattern in their recipe.

``build_tiny(entry)`` builds the model from that config with ``attn_implementation`` "eager" (the CP machinery
switches to the flash path itself), under ``torch.random.fork_rng`` seeded with ``seed`` so that every process
gets identical weights, in ``dtype`` and train mode; ``NotBuilt`` (a ``RuntimeError`` with ``.reason``) when it
cannot. An eager forward on (2, 32) token ids drawn from ``range(TINY_VOCAB)`` gives finite logits of shape
(2, 32, TINY_VOCAB) for every built class (``tests/model/test_sweep_tiny.py``).

Not built on transformers 5.24 (3 of 151, <= 5 % of the catalog; ``_NOT_BUILT`` holds the reasons):

    model_type                 class                                    why
    gemma3n                    Gemma3nForConditionalGeneration          timm vision tower (timm + PIL; no tiny
                                                                        size); text stack built as gemma3n_text
    gemma4_assistant           Gemma4AssistantForCausalLM               speculative-decoding drafter: forward
    gemma4_unified_assistant   Gemma4UnifiedAssistantForCausalLM        takes the backbone's embeddings and K/V
"""
from __future__ import annotations

from typing import Any

import torch

from hfpatch.release.sweep.catalog import CatalogEntry

__all__ = ["TINY_VOCAB", "HYBRID_KINDS", "NotBuilt", "tiny_config", "build_tiny", "layer_kinds",
           "training_inputs", "training_labels"]

TINY_VOCAB = 128
_HIDDEN = 64
_INTERMEDIATE = 128
_EXPERT_INTERMEDIATE = 64
_LAYERS = 2
_HEADS = 4
_KV_HEADS = 2
_HEAD_DIM = 16
_POSITIONS = 256
_WINDOW = 8
_EXPERTS = 4
_TOP_K = 2


class NotBuilt(RuntimeError):
    """``build_tiny`` could not build a class; ``.reason`` says why (and ``.entry`` which one, when known)."""

    def __init__(self, reason: str, entry: CatalogEntry | None = None):
        self.reason = reason
        self.entry = entry
        where = f"{entry.class_name} (model_type={entry.model_type!r})" if entry is not None else "model"
        super().__init__(f"{where} not built tiny: {reason}")


# The generic shrink: attribute name -> tiny value, applied to every name the config (or a sub-config) has.
# A default of None usually means "feature off" (no q LoRA, no window, head_dim derived): it stays None unless
# the name is in _EVEN_IF_NONE.
_SHRINK: dict[str, Any] = {
    **dict.fromkeys(("vocab_size",), TINY_VOCAB),
    **dict.fromkeys(("hidden_size", "d_model", "n_embd"), _HIDDEN),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "decoder_ffn_dim", "encoder_ffn_dim", "n_inner",
                     "ffn_hidden_size", "dff", "prefix_dense_intermediate_size"), _INTERMEDIATE),
    **dict.fromkeys(("moe_intermediate_size", "shared_expert_intermediate_size", "expert_ffn_hidden_size",
                     "moe_shared_expert_intermediate_size", "shared_intermediate_size"), _EXPERT_INTERMEDIATE),
    **dict.fromkeys(("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers",
                     "encoder_layers"), _LAYERS),
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "num_heads", "decoder_attention_heads",
                     "encoder_attention_heads"), _HEADS),
    **dict.fromkeys(("num_key_value_heads", "num_kv_heads"), _KV_HEADS),
    **dict.fromkeys(("head_dim", "kv_channels", "attention_head_dim"), _HEAD_DIM),
    **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx", "max_target_positions",
                     "max_source_positions", "max_seq_len"), _POSITIONS),
    **dict.fromkeys(("initializer_range", "init_std"), 0.2),
    **dict.fromkeys(("use_cache", "output_router_logits", "add_cross_attention", "apply_spec_augment"), False),
    # The torch Mamba path on every machine (4.4x refuses to run Jamba without the CUDA kernels otherwise).
    "use_mamba_kernels": False,
    # BERT-style classes attend bidirectionally unless told they are a decoder.
    "is_decoder": True,
    # MoE: few experts, top-2, one group, no jitter (deterministic routing).
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), _EXPERTS),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk", "moe_k", "top_k_experts", "num_experts_per_token"),
                    _TOP_K),
    **dict.fromkeys(("n_shared_experts", "num_shared_experts", "moe_num_shared_experts"), 1),
    **dict.fromkeys(("n_group", "topk_group", "num_expert_group"), 1),
    **dict.fromkeys(("router_jitter_noise", "input_jitter_noise"), 0.0),
    # Dense first layer, then sparse: a 2-layer MoE model keeps both MLP kinds.
    "first_k_dense_replace": 1, "decoder_sparse_step": 1, "mlp_only_layers": [],
    # Multi-head latent attention, Q/K head 24 (16 without + 8 with rotary) over V head 16: the released
    # models' 192 / 128 asymmetry (HF's flash path pads V up to the Q/K width), kept. head_dim follows
    # qk_rope_head_dim there (the rotary tables are built from head_dim; see _derived).
    "q_lora_rank": 32, "kv_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
    "qk_head_dim": 24,
    # Partial rotary by an absolute width (GPT-J, ...): within head_dim 16.
    "rotary_dim": 8,
    # Mamba / Mamba2: 4 heads of 32 over expand 2 x hidden 64, chunks of 16 (several chunks on 32-64 tokens).
    **dict.fromkeys(("mamba_d_state", "ssm_state_size"), 16),
    **dict.fromkeys(("mamba_n_heads", "mamba_num_heads", "n_mamba_heads"), 4),
    **dict.fromkeys(("mamba_d_head", "mamba_head_dim", "mamba_headdim"), 32),
    **dict.fromkeys(("mamba_n_groups", "n_groups", "mamba_ngroups"), 1),
    **dict.fromkeys(("mamba_chunk_size", "chunk_size"), 16),
    "mamba_expand": 2, "mamba_d_conv": 4, "mamba_dt_rank": 8, "mamba_d_ssm": 128,
    # Linear attention (gated delta net and kin).
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": _HEAD_DIM,
    "linear_value_head_dim": _HEAD_DIM, "linear_head_dim": _HEAD_DIM, "linear_num_heads": 4,
    "linear_conv_kernel_dim": 4,
    # Per-layer input embeddings (Gemma3n, Gemma4).
    "vocab_size_per_layer_input": TINY_VOCAB, "hidden_size_per_layer_input": 16, "laurel_rank": 8,
    # Windows: active on 32-64 tokens.
    **dict.fromkeys(("sliding_window", "attention_window_size", "window_size"), _WINDOW),
}
# None here means "derive it" and some families then derive it wrongly at a tiny size (or not at all).
# (GPT-2, GPT-J, GPT-Neo, BigCode: MLP width None means 4 x hidden.)
_EVEN_IF_NONE = frozenset({"num_key_value_heads", "head_dim", "n_routed_experts", "num_experts_per_tok",
                           "n_group", "topk_group", "n_inner", "intermediate_size"})

# 0 here is a count, not "off": all-MoE stacks get one dense first layer so that both MLP kinds are built.
_ZERO_IS_A_SIZE = frozenset({"first_k_dense_replace"})

# Sub-config attributes shrunk recursively (vision/audio towers are built, never run, but must be small).
_SUB_CONFIGS = ("text_config", "vision_config", "audio_config", "vq_config", "audio_encoder_config",
                "depth_decoder_config", "decoder", "text_encoder", "audio_encoder")

_LAYER_COUNT_NAMES = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers")

# Ids the embedding must hold: kept when < vocab, else given a small id (pad 0, bos 1, eos 2, others 3...).
_TEXT_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id",
                   "cls_token_id", "unk_token_id", "mask_token_id", "eod_token_id", "forced_eos_token_id",
                   "forced_bos_token_id")


def _shrinkable(name: str, value) -> bool:
    """None (unless in _EVEN_IF_NONE) and 0 (a feature switched off: no per-layer input, no window) stay."""
    if value is None:
        return name in _EVEN_IF_NONE
    return name in _ZERO_IS_A_SIZE or not (isinstance(value, (int, float)) and value == 0 and value is not False)


def _is_dropout(name: str) -> bool:
    """Every randomness of a train-mode forward, by name: dropouts, layer drop, router jitter, SpecAugment."""
    return "dropout" in name or "pdrop" in name or "jitter" in name or name.endswith("layerdrop") or name in (
        "mask_time_prob", "mask_feature_prob")


def _is_placeholder_token(name: str) -> bool:
    """Multimodal placeholder ids (image/audio/video tokens): moved past the vocabulary, so that random text
    ids never hit them (these models replace such ids before the embedding lookup)."""
    return (name.endswith("_token_id") or name.endswith("_token_index")) and name not in _TEXT_TOKEN_IDS


# A recipe value that removes the keyword (a pattern list the family derives itself from periods or indices).
_UNSET = object()


# What a release-dependent recipe value gives where the release needs no override (the generic shrink stands).
_NO_OVERRIDE = object()


class _PerRelease:
    """A recipe value that depends on the installed release: ``pick(config_cls, default)`` returns the value
    (``_UNSET`` removes the keyword, ``_NO_OVERRIDE`` leaves the generic shrink's), given the config class and
    its default instance."""

    def __init__(self, pick):
        self.pick = pick


def _layer_kinds_spelled(kinds: list[str]):
    """A ``layer_types`` list in the spelling the installed release's config accepts: transformers' current
    names ("linear_attention", "full_attention"), or the 4.x ones ("mamba", "attention") where the config
    rejects the current ones (Granite 4 hybrid before 5.x)."""

    def pick(config_cls, default):
        try:
            config_cls(num_hidden_layers=len(kinds), layer_types=kinds)
            return kinds
        except ValueError:
            legacy = {modern: old for old, modern in _LEGACY_KINDS.items() if old != "recurrent"}
            return [legacy.get(k, k) for k in kinds]

    return _PerRelease(pick)


def _as_dict(value) -> dict:
    """A sub-config as a dict (DBRX's are config objects on some releases, dicts on others)."""
    return value if isinstance(value, dict) else value.to_dict()


def _default_rope_if_unset(config_cls, default):
    """4.4x configs whose rotary embedding reads ``rope_scaling["rope_type"]`` but default it to None (Mllama's
    text model): the plain rotary embedding; releases that default it already keep theirs."""
    if "rope_scaling" in default.to_dict() and getattr(default, "rope_scaling", None) is None:
        return {"rope_type": "default"}
    return _NO_OVERRIDE


def _sub_config_if_unset(name: str):
    """A composite's sub-config that the default leaves None although the model builds it (4.53's
    Phi-4-multimodal drops its default vision config): the sub-config class's default, shrunk."""

    def pick(config_cls, default):
        if getattr(default, name, None) is not None:
            return _NO_OVERRIDE
        return _tiny_sub_config(config_cls.sub_configs[name]())

    return _PerRelease(pick)

# Per-family overrides, applied after the generic shrink (a nested dict merges into that sub-config). A recipe
# keyed by a sub-config's own model_type (e.g. "gemma3_text") also applies inside composite configs.
_RECIPES: dict[str, dict[str, Any]] = {
    # DBRX keeps attention and FFN sizes in two sub-configs (plain dicts here); 5.x's attention reads a
    # rope_theta that the attention sub-config does not define by default, and clamps Q/K/V by clip_qkv
    # unconditionally (None fails; 8 is the released checkpoints' value). The FFN sub-config of 5.x has a
    # hidden_size of its own (4.x rejects the keyword), and 5.0's router reads ffn_hidden_size as its input
    # width: an FFN as wide as the model keeps every release consistent.
    "dbrx": dict(attn_config=dict(kv_n_heads=_KV_HEADS, clip_qkv=8.0, rope_theta=10000.0),
                 ffn_config=_PerRelease(lambda config_cls, default: dict(
                     ffn_hidden_size=_HIDDEN, moe_num_experts=_EXPERTS, moe_top_k=_TOP_K, moe_jitter_eps=None,
                     **({"hidden_size": _HIDDEN} if "hidden_size" in _as_dict(default.ffn_config) else {})))),
    # GPT-Neo expands attention_types ([[kinds, repeats]]) into attention_layers: one (global, local) pair.
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]], attention_layers=_UNSET),
    # dots1's defaults leave the expert counts unset.
    "dots1": dict(n_shared_experts=1),
    # Gemma3n: the last num_kv_shared_layers layers reuse the K/V of the last earlier layer of their type, so the
    # tiny stack keeps both a producing and a sharing layer of each type: [S, F | S, F] (S sliding, F full).
    "gemma3n_text": dict(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2,
                         num_kv_shared_layers=2, intermediate_size=[_INTERMEDIATE] * 4,
                         activation_sparsity_pattern=[0.95, 0.95, 0.0, 0.0]),
    # Bamba (Mamba2 hybrid): the default has no attention layer (attn_layer_indices None); tiny [M, A, M, A].
    "bamba": dict(num_hidden_layers=4, attn_layer_indices=[1, 3], layer_types=_UNSET, layers_block_type=_UNSET),
    # Granite 4 hybrid: the default is all Mamba2; tiny [M, A, M, A].
    "granitemoehybrid": dict(num_hidden_layers=4,
                             layer_types=_layer_kinds_spelled(["linear_attention", "full_attention"] * 2),
                             layers_block_type=_UNSET),
    # Jamba: attention every attn_layer_period layers, experts every expert_layer_period layers; tiny
    # [M+E, A, M+E, A] (M Mamba, A attention, +E mixture of experts instead of the dense MLP).
    "jamba": dict(num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                  expert_layer_offset=0, layer_types=_UNSET, layers_block_type=_UNSET),
    # RecurrentGemma cycles block_types (recurrent, recurrent, attention) over the stack; 3 layers keep one full
    # cycle [R, R, A] (R RG-LRU, A local attention with attention_window_size 8).
    "recurrent_gemma": dict(num_hidden_layers=3, layer_types=_UNSET, layers_block_type=_UNSET),
    # Cohere Compass: multimodal rotary (mrope) per layer type; the default parameters are empty. The
    # sections split head_dim / 2 = 8 frequencies over (time, height, width).
    "cohere_compass_text": dict(rope_parameters={
        kind: dict(rope_type="default", rope_theta=10000.0, mrope_section=[4, 2, 2])
        for kind in ("full_attention", "sliding_attention")}),
    # LFM2 (short-conv hybrid): the default stack is all attention; the tiny one is [C, A, C, A]
    # (C gated short convolution, A full attention), as in the released checkpoints' mix.
    "lfm2": dict(num_hidden_layers=4, full_attn_idxs=[1, 3], layer_types=["conv", "full_attention"] * 2),
    # LFM2-MoE: [A, C | C, A] -- the first num_dense_layers=2 have a dense MLP, the rest experts, so that every
    # (mixer, MLP) pair but two occurs and each mixer meets each MLP kind.
    "lfm2_moe": dict(num_hidden_layers=4, num_dense_layers=2,
                     layer_types=["full_attention", "conv", "conv", "full_attention"]),
    # ModernBERT decoder: 4.5x derive the window as local_attention // 2 (a window of 8 from 16).
    "modernbert-decoder": dict(local_attention=2 * _WINDOW),
    # LongCat-Flash adds "zero-computation" experts (identity) to the routed ones: 2 beside the 4.
    "longcat_flash": dict(zero_expert_num=2),
    # Mllama's text model: 4.4x's default leaves rope_scaling None, which its rotary embedding indexes.
    "mllama_text_model": dict(rope_scaling=_PerRelease(_default_rope_if_unset)),
    # Phi-4-multimodal: 4.53-4.54 forget to set the default vision config, which the model builds.
    "phi4_multimodal": dict(vision_config=_sub_config_if_unset("vision_config")),
    # Phi-4-multimodal's audio encoder (built, never run on text) has its own width names.
    "phi4_multimodal_audio": dict(num_blocks=1, nemo_conv_channels=_HIDDEN, ext_pw_out_channel=_HIDDEN,
                                  depthwise_separable_out_channel=_HIDDEN),
    # RoCBert embeds glyph shape and pronunciation ids beside the token ids, with vocabularies of their own.
    "roc_bert": dict(shape_vocab_size=TINY_VOCAB, shape_embed_dim=16, pronunciation_vocab_size=TINY_VOCAB,
                     pronunciation_embed_dim=16),
    # MiMo-V2-Flash: Q/K heads wider than V heads (192 / 128 released: 24 / 16 tiny, so that the partial
    # rotary factor 0.334 gives an even rotary width, 8); sliding layers carry attention sinks and twice the
    # K/V heads of the full layers (its own code).
    "mimo_v2_flash": dict(head_dim=24, v_head_dim=16),
    # Musicgen decoders read (batch x codebooks, seq) ids; one codebook makes that (batch, seq).
    # Their init std is initializer_factor (0.02), not initializer_range.
    "musicgen_decoder": dict(num_codebooks=1, initializer_factor=0.2),
    "musicgen_melody_decoder": dict(num_codebooks=1, initializer_factor=0.2),
    # Zamba: Mamba layers, and hybrid layers that run ONE shared attention block (tied across them) before
    # their Mamba mixer; the tie needs two hybrid layers: [M, H, M, H] (period 2, offset 1). The shared
    # block attends over the concatenation [hidden, embeddings]: width 2 x 64 = 4 heads of 32.
    "zamba": dict(num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1,
                  layers_block_type=["linear_attention", "hybrid"] * 2, attention_hidden_size=2 * _HIDDEN,
                  attention_head_dim=2 * _HIDDEN // _HEADS),
    # Zamba2 with rotary positions in its shared attention (use_mem_rope, as the released checkpoints): 5.0
    # reads the rotary embedding that it builds only then.
    "zamba2": dict(use_mem_rope=True),
    # ZAYA routes to one expert only (its config refuses more).
    "zaya": dict(num_experts_per_tok=1),
}

# Calls on the built model that the family needs before a forward (model_type -> function of the model).
_AFTER_BUILD: dict[str, Any] = {
    # X-MOD routes every layer through a per-language adapter and refuses to guess the language.
    "xmod": lambda model: model.set_default_language(model.config.default_language or next(
        iter(model.config.languages))),
}

# Inputs beside the token ids that a family's forward requires in train mode, each as zeros shaped like the ids:
# 5.0's Gemma 3 (multimodal) refuses to train without token_type_ids (0 marks a text token).
_TRAINING_INPUTS: dict[str, tuple[str, ...]] = {"gemma3": ("token_type_ids",)}


# Families whose labels are not shaped like the token ids: MusicGen's decoders take (batch, seq, codebooks).
_CODEBOOK_LABELS = frozenset({"musicgen_decoder", "musicgen_melody_decoder"})


def training_labels(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The labels of the model's own non-CP loss for token ids ``ids``: ``ids`` itself, or, for MusicGen's
    decoders, one copy per codebook (``(batch, seq, num_codebooks)``)."""
    if getattr(model.config, "model_type", "") in _CODEBOOK_LABELS:
        return ids[..., None].expand(*ids.shape, int(getattr(model.config, "num_codebooks", 1)))
    return ids


def training_inputs(model: torch.nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The keyword inputs beside ``ids`` that ``model``'s family needs to train on text (``_TRAINING_INPUTS``),
    for the tokens ``ids`` (a rank's shard under CP: zeros are the same on every layout)."""
    import inspect

    names = _TRAINING_INPUTS.get(getattr(model.config, "model_type", ""), ())
    accepted = inspect.signature(model.forward).parameters
    return {name: torch.zeros_like(ids) for name in names if name in accepted}


# Families that are not built, with the reason (checked before any work).
_NOT_BUILT: dict[str, str] = {
    "gemma3n": "the vision tower is a timm MobileNetV5 (needs the timm and PIL packages; its timm config has "
               "no tiny size); Gemma3n's text stack is built as gemma3n_text",
    "gemma4_assistant": "a speculative-decoding drafter: its forward takes the backbone's inputs_embeds and "
                        "shared_kv_states (every layer reads the backbone's K/V), not token ids",
    "gemma4_unified_assistant": "a speculative-decoding drafter: its forward takes the backbone's inputs_embeds "
                                "and shared_kv_states (every layer reads the backbone's K/V), not token ids",
}


# Hybrid families: the layer kinds (``layer_kinds`` names) their tiny stack must keep, whatever the default
# config shows (some defaults are degenerate: LFM2 all attention, Bamba and Granite 4 all Mamba). Kinds:
# full/sliding_attention; linear_attention (any recurrent mixer: Mamba/Mamba2, gated delta net, lightning
# attention, RG-LRU -- transformers' own convention); conv (short convolution); hybrid (attention and Mamba
# in one layer). Tiny patterns where the generic compression gives them (5.23; L linear/recurrent mixer, A full
# and S sliding attention, C conv, H hybrid): bailing_hybrid and kimi_linear [L, L, A] (dense then sparse
# MLPs), lfm3 [C, A, S], minimax [A, L], olmo_hybrid, qwen3_5*, qwen3_next [L, A], zamba2 [M, H], falcon_h1
# [H, H] (attention and Mamba2 side by side in every layer), nemotron_h "ME*-" (its default is already 4
# layers: Mamba2, experts, attention, MLP). The others are in their recipe.
HYBRID_KINDS: dict[str, frozenset[str]] = {
    family: frozenset(kinds) for family, kinds in {
        "bailing_hybrid": ("linear_attention", "full_attention"),
        "bamba": ("linear_attention", "full_attention"),
        "falcon_h1": ("hybrid",),
        "granitemoehybrid": ("linear_attention", "full_attention"),
        "jamba": ("linear_attention", "full_attention"),
        "kimi_linear": ("linear_attention", "full_attention"),
        "lfm2": ("conv", "full_attention"),
        "lfm2_moe": ("conv", "full_attention"),
        "lfm3": ("conv", "full_attention", "sliding_attention"),
        "minimax": ("linear_attention", "full_attention"),
        "nemotron_h": ("linear_attention", "full_attention"),
        "olmo_hybrid": ("linear_attention", "full_attention"),
        "qwen3_5": ("linear_attention", "full_attention"),
        "qwen3_5_text": ("linear_attention", "full_attention"),
        "qwen3_5_moe": ("linear_attention", "full_attention"),
        "qwen3_5_moe_text": ("linear_attention", "full_attention"),
        "qwen3_next": ("linear_attention", "full_attention"),
        "recurrent_gemma": ("linear_attention", "sliding_attention"),
        "zamba": ("linear_attention", "hybrid"),
        "zamba2": ("linear_attention", "hybrid"),
    }.items()}

# Older spellings of the kinds (4.x configs), as transformers' own remap_legacy_layer_types maps them.
_LEGACY_KINDS = {"mamba": "linear_attention", "attention": "full_attention", "recurrent": "linear_attention"}
# Families whose 4.x configs name a layer kind wrongly, as the current releases name it: RecurrentGemma's
# "attention" is local (attention_window_size); Falcon-H1's 4.x property says "attention" for layers that run
# Mamba2 beside attention.
_FAMILY_KINDS = {"recurrent_gemma": {"attention": "sliding_attention"},
                 "falcon_h1": {"attention": "hybrid"}}
# Nemotron-H's hybrid_override_pattern characters: Mamba2, attention, MLP, mixture of experts.
_PATTERN_CHARS = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}


def layer_kinds(config) -> list[str]:
    """The mixer kind of every layer of ``config`` (its text part for a composite), read from the family's own
    pattern (``layer_types``, ``layers_block_type``, ``block_types``, ``hybrid_override_pattern``); ``[]``
    where the config has none (a homogeneous stack)."""
    text = getattr(config, "text_config", None)
    config = text if _is_config(text) else config
    _, count = _layer_count(_stored_attrs(config))
    for name in ("layer_types", "layers_block_type", "block_types"):
        try:
            kinds = getattr(config, name, None)
        except (AttributeError, RuntimeError):
            kinds = None
        if isinstance(kinds, (list, tuple)) and kinds:
            cycled = [kinds[i % len(kinds)] for i in range(count or len(kinds))]
            family = _FAMILY_KINDS.get(getattr(config, "model_type", ""), {})
            return [family.get(k, _LEGACY_KINDS.get(k, k)) for k in cycled]
    pattern = getattr(config, "hybrid_override_pattern", None)
    if isinstance(pattern, str):
        return [_PATTERN_CHARS.get(c, c) for c in pattern]
    return []


def _stored_attrs(config) -> dict[str, Any]:
    """name -> value of every attribute the config serialises (the real names, not ``attribute_map`` aliases);
    sub-configs as config objects. Where reading the attribute raises (Gemma4's global read of a per-layer
    attribute), the serialised value stands in."""
    stored = config.to_dict()
    out = {}
    for name, value in stored.items():
        try:
            out[name] = getattr(config, name)
        except (AttributeError, RuntimeError):  # AmbiguousGlobalPerLayerAttributeError is a RuntimeError
            out[name] = value
    return out


def _is_config(value) -> bool:
    import transformers

    # 5.x spells the base class PreTrainedConfig (PretrainedConfig stays as an alias); 4.x only PretrainedConfig.
    base = getattr(transformers, "PreTrainedConfig", None) or transformers.PretrainedConfig
    return isinstance(value, base)


def _layer_count(attrs: dict[str, Any]) -> tuple[str | None, int]:
    for name in _LAYER_COUNT_NAMES:
        if isinstance(attrs.get(name), int):
            return name, attrs[name]
    return None, 0


def _hashable(value):
    return tuple(_hashable(v) for v in value) if isinstance(value, (list, tuple)) else (
        repr(value) if isinstance(value, dict) else value)


def _compress_layers(attrs: dict[str, Any], shrunk: dict[str, Any]) -> dict[str, Any]:
    """The per-layer lists cut to the first layer of each distinct combination of their values (>= 2 layers),
    and the layer count set to match. A per-layer list of a shrunk size (Gemma3n's ``intermediate_size``)
    takes the shrunk value on every kept layer."""
    count_name, count = _layer_count(attrs)
    if count_name is None:
        return {}
    lists = {n: v for n, v in attrs.items() if isinstance(v, (list, tuple)) and len(v) == count and count > 2}
    picked, seen = [], set()
    for i in range(count):
        key = tuple(_hashable(v[i]) for n, v in lists.items() if n not in shrunk)
        if key not in seen:
            seen.add(key)
            picked.append(i)
    if len(picked) < _LAYERS:
        picked = list(range(min(_LAYERS, count)))
    out = {n: [shrunk[n] if n in shrunk else v[i] for i in picked] for n, v in lists.items()}
    out[count_name] = len(picked)
    per_layer = attrs.get("per_layer_config")
    if isinstance(per_layer, dict) and per_layer and all(str(k).isdigit() for k in per_layer):
        out["per_layer_config"] = _remap_per_layer(per_layer, picked, attrs, shrunk)
    return out


def _remap_per_layer(per_layer: dict, picked: list[int], attrs: dict[str, Any], shrunk: dict[str, Any]) -> dict:
    """Gemma4's ``per_layer_config`` ({"05": {"head_dim": 512}, ...}: overrides by layer index) re-keyed to the
    kept layers; a shrunk size keeps its ratio to the global value (512 over 256 -> 2 x 16)."""
    width = len(next(iter(per_layer)))
    out = {}
    for new, old in enumerate(picked):
        layer = per_layer.get(f"{old:0{width}d}")
        if layer is None:
            continue
        out[f"{new:0{width}d}"] = {
            name: (shrunk[name] * value // attrs[name]
                   if name in shrunk and isinstance(value, int) and isinstance(attrs.get(name), int) else value)
            for name, value in layer.items()}
    return out


def _derived(attrs: dict[str, Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Sizes that must agree with others the generic shrink set."""
    out = {}
    if "qk_rope_head_dim" in attrs and attrs.get("head_dim") is not None:
        # MLA: the rotary tables are built from head_dim, which these configs define as the rope part.
        out["head_dim"] = kwargs.get("qk_rope_head_dim", attrs["qk_rope_head_dim"])
    if "kv_lora_rank" in attrs and "num_key_value_heads" in attrs:
        # MLA decompresses K/V per query head: no grouping (a K/V head count below it breaks repeat_kv).
        out["num_key_value_heads"] = kwargs.get("num_attention_heads", _HEADS)
    return out


def _tiny_mrope(config_cls, attrs: dict[str, Any]) -> dict[str, Any]:
    """Multimodal rotary sections for the tiny head_dim. A vision-language text config that leaves
    ``mrope_section`` out of its rope parameters (which its validation then ignores) gets its model's default, a
    split of a released head_dim's frequencies ([16, 24, 24] of 64); the tiny head_dim has 8: [4, 2, 2]."""
    rope = attrs.get("rope_parameters")
    if ("mrope_section" not in getattr(config_cls, "ignore_keys_at_rope_validation", ()) or not isinstance(rope, dict)
            or "mrope_section" in rope):
        return {}
    return {"rope_parameters": {**rope, "mrope_section": [4, 2, 2]}}


def _token_ids(attrs: dict[str, Any], vocab: int | None) -> dict[str, Any]:
    """Special ids inside the vocabulary (text ids) or just past it (multimodal placeholders)."""
    out, spare, past = {}, iter(range(3, vocab or 3)), vocab or 0
    small = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}

    def fit(name, tid):
        nonlocal past
        if not isinstance(tid, int) or isinstance(tid, bool) or vocab is None:
            return tid
        if name in _TEXT_TOKEN_IDS:
            return tid if tid < vocab else small.get(name, next(spare, 0))
        if tid < vocab:
            return tid
        past += 1
        return past - 1

    for name, value in attrs.items():
        if name in _TEXT_TOKEN_IDS or _is_placeholder_token(name):
            out[name] = [fit(name, v) for v in value] if isinstance(value, list) else fit(name, value)
    return out


def _merge(kwargs: dict[str, Any], recipe: dict[str, Any]) -> dict[str, Any]:
    out = dict(kwargs)
    for name, value in recipe.items():
        if value is _UNSET:
            out.pop(name, None)
        elif isinstance(value, dict) and isinstance(out.get(name), dict) and "model_type" in out[name]:
            out[name] = {**out[name], **value}
        else:
            out[name] = value
    return out


def _shrunk_kwargs(config_cls, model_type: str) -> dict[str, Any]:
    """Constructor keywords of the tiny ``config_cls``: the generic shrink of its default, then the recipe."""
    recipe = _RECIPES.get(model_type, {})
    default = config_cls(**recipe.get("__init__", {}))
    attrs = _stored_attrs(default)
    kwargs: dict[str, Any] = {}
    for name, value in attrs.items():
        if name in _SHRINK and _shrinkable(name, value):
            kwargs[name] = _SHRINK[name]
        elif _is_dropout(name) and isinstance(value, (int, float)) and not isinstance(value, bool):
            kwargs[name] = 0.0
        elif name in _SUB_CONFIGS and _is_config(value):
            kwargs[name] = _tiny_sub_config(value)
    kwargs.update(_compress_layers(attrs, kwargs))
    kwargs.update(_derived(attrs, kwargs))
    kwargs.update(_tiny_mrope(config_cls, attrs))
    recipe = {k: (v.pick(config_cls, default) if isinstance(v, _PerRelease) else v)
              for k, v in recipe.items() if k != "__init__"}
    recipe = {k: v for k, v in recipe.items() if v is not _NO_OVERRIDE}
    kwargs = _merge(kwargs, recipe)
    kwargs.update(_token_ids({**attrs, **kwargs}, kwargs.get("vocab_size", attrs.get("vocab_size"))))
    return _merge(kwargs, {k: v for k, v in recipe.items() if k in kwargs and "token" in k})


def _tiny_sub_config(sub) -> dict[str, Any]:
    """The shrunk sub-config as a dict with its ``model_type``: every release's composite configs take the dict
    form (4.4x's Moshi and Musicgen take only that), few take an instance."""
    sub_type = getattr(sub, "model_type", "")
    return type(sub)(**_shrunk_kwargs(type(sub), sub_type)).to_dict()


def _own_config_class(entry: CatalogEntry):
    """The config class the model class is built from: the mapped one (``CONFIG_MAPPING_NAMES``), or, where
    that is a composite whose sub-config is the class's own ``config_class`` (Emu3, Qwen3.5 and Musicgen map
    their text-only causal LM to the composite's model_type), that sub-config class."""
    mapped = entry.config_class()
    own = getattr(entry.model_class(), "config_class", None)
    if own is None or issubclass(mapped, own):
        return mapped
    parts = getattr(mapped, "sub_configs", None)  # class attribute naming the composite's parts, 4.47+
    if parts is not None:
        return own if own in parts.values() else mapped
    # Before 4.47: transformers names a composite's parts "<composite>_<part>" ("musicgen_decoder").
    return own if str(getattr(own, "model_type", "")).startswith(f"{mapped.model_type}_") else mapped


def tiny_config(entry: CatalogEntry):
    """The tiny config of ``entry``'s class (eager attention); ``NotBuilt`` when it cannot be made."""
    if entry.model_type in _NOT_BUILT:
        raise NotBuilt(_NOT_BUILT[entry.model_type], entry)
    try:
        config_cls = _own_config_class(entry)
        model_type = entry.model_type if config_cls.__name__ == entry.config_class_name else config_cls.model_type
        config = config_cls(**_shrunk_kwargs(config_cls, model_type))
    except Exception as exc:  # noqa: BLE001 -- any failure of the family's own config code is a reason, kept.
        raise NotBuilt(f"config: {type(exc).__name__}: {exc}", entry) from exc
    if not hasattr(config, "pad_token_id"):
        # 5.0.0's Phi, StableLM, JetMoe and Exaone4 configs define no pad_token_id, which their models read (a
        # checkpoint's config.json supplies it): no padding row, as their defaults elsewhere.
        config.pad_token_id = None
    _set_eager(config)
    return config


def _set_eager(config) -> None:
    """Eager attention on the config and every sub-config (composite models read the sub-config's)."""
    config._attn_implementation = "eager"
    for name in _SUB_CONFIGS:
        sub = getattr(config, name, None)
        if _is_config(sub):
            _set_eager(sub)


def build_tiny(entry: CatalogEntry, *, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """``entry``'s class at a tiny size with random weights drawn from ``seed`` (identical in every process), in
    ``dtype`` and train mode, eager attention. Raises ``NotBuilt`` (with ``.reason``) when it cannot."""
    if entry.import_error is not None:
        raise NotBuilt(f"import: {entry.import_error}", entry)
    config = tiny_config(entry)
    model_cls = entry.model_class()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            model = model_cls(config)
        except Exception as exc:  # noqa: BLE001 -- the family's own construction code; the reason is kept.
            raise NotBuilt(f"construction: {type(exc).__name__}: {exc}", entry) from exc
    after = _AFTER_BUILD.get(entry.model_type)
    if after is not None:
        after(model)
    return model.to(dtype).train()
