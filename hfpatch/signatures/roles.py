"""The canonical roles: what each parameter of ``_flash_attention_forward`` *means*, independent of its name
or position in a given transformers release. The generated wrapper maps every argument onto its role, so one
function downstream owns the semantics for every release.
"""
from __future__ import annotations

__all__ = ["ROLES", "UNKNOWN_ROLE", "EXTRA_KWARGS_ROLE", "role_for_name"]

ROLES: tuple[str, ...] = (
    "query",              # (batch, q_len, heads, head_dim)
    "key",                # (batch, kv_len, kv_heads, head_dim)
    "value",              # (batch, kv_len, kv_heads, head_dim)
    "attention_mask",     # (batch, kv_len) padding mask, or None
    "query_length",       # int
    "is_causal",          # bool
    "dropout",            # float probability
    "position_ids",       # (batch, q_len) or None; packed sequences restart at 0
    "softmax_scale",      # float or None (None: head_dim ** -0.5)
    "sliding_window",     # int or None
    "use_top_left_mask",  # bool: flash-attn < 2.1 causal-mask alignment
    "softcap",            # float or None
    "deterministic",      # bool or None
    "cu_seq_lens_q",      # (num_seqs + 1,) int32 or None
    "cu_seq_lens_k",      # (num_seqs + 1,) int32 or None
    "max_length_q",       # int or None
    "max_length_k",       # int or None
    "target_dtype",       # torch.dtype or None (PEFT fp32 upcast target)
    "implementation",     # str or None: spelled `attn_implementation` (4.53, 5.x) or `implementation` (4.54-4.57)
    "block_table",        # paged KV cache (5.19+)
    "k_cache",            # paged KV cache (5.19+)
    "v_cache",            # paged KV cache (5.19+)
    "extra_kwargs",       # the trailing **kwargs (4.48+)
)

# A parameter of a *compatible* live signature that no registry entry knows. The wrapper refuses any
# non-default value passed to it (hfpatch cannot honour what it does not understand).
UNKNOWN_ROLE = "unknown"
EXTRA_KWARGS_ROLE = "extra_kwargs"

# Parameter names seen in transformers 4.43 - 5.23, by role. Used to propose roles for a newly scanned
# signature; the registry's JSON files state every role explicitly.
_ROLE_BY_NAME: dict[str, str] = {
    "query_states": "query",
    "key_states": "key",
    "value_states": "value",
    "attention_mask": "attention_mask",
    "query_length": "query_length",
    "is_causal": "is_causal",
    "dropout": "dropout",
    "position_ids": "position_ids",
    "softmax_scale": "softmax_scale",
    "sliding_window": "sliding_window",
    "use_top_left_mask": "use_top_left_mask",
    "softcap": "softcap",
    "deterministic": "deterministic",
    "cu_seq_lens_q": "cu_seq_lens_q",
    "cu_seq_lens_k": "cu_seq_lens_k",
    "max_length_q": "max_length_q",
    "max_length_k": "max_length_k",
    "target_dtype": "target_dtype",
    "attn_implementation": "implementation",
    "implementation": "implementation",
    "block_table": "block_table",
    "k_cache": "k_cache",
    "v_cache": "v_cache",
}


def role_for_name(name: str, *, var_keyword: bool = False) -> str:
    """The role of a parameter called ``name`` (``"unknown"`` for a name never seen in a release)."""
    if var_keyword:
        return EXTRA_KWARGS_ROLE
    return _ROLE_BY_NAME.get(name, UNKNOWN_ROLE)
