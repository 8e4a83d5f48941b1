"""The one semantic implementation behind every generated wrapper: what each argument of
``_flash_attention_forward`` means under context parallelism, and how it reaches ``ring_kernels``.

The wrapper (``hfpatch.attention.codegen``) maps the caller's arguments, by name, onto roles (``hfpatch.signatures.roles``)
and calls the dispatcher, which plans a ring call here -- ``ring_plan`` (every refusal, the step, the kernel's
arguments) -- runs it (``RingPlan.run``) and keeps the plan for the calls it computes as is
(``hfpatch.attention.dispatch``); ``ring_attention`` is the two in one. ``call`` maps role -> value,
``extra`` holds the trailing ``**kwargs`` (4.48+). The stages, one module each: ``context`` (the group, the
kernel asked for, the step), ``refusals``, ``step`` (the step a call belongs to), ``kernel_choice`` (which kernel
runs), ``plan`` (the kernel's arguments, run), ``whole`` (the switch's modes on whole sequences). Shapes
(flash-attn layout, this rank's shard):

    query:            (B, S_local, H,  D)
    key, value:       (B, S_local, Hk, D)     H % Hk == 0 (GQA: the kernels never repeat K/V heads)
    returned output:  (B, S_local, H,  D)     dtype of query

What each role means here (docs/user-guide.md's "What ring attention honours and what it refuses" is the user's
copy of this table):

- ``is_causal``, ``softmax_scale`` (None: D ** -0.5), GQA: passed to the kernels.
- the kernel: a ring variant splits only the sequence; ``"ulysses"`` and ``"usp:UxR"`` (``RingContext.heads``)
  also split the query heads, on the same layouts (``kernel_choice.plan_step``), so positions, labels and the mixers' state
  passing are those of the ring. The query heads must divide by the Ulysses degree (``UnsupportedArgument``
  naming ``query``, with the grids that fit); whatever a kernel refuses reaches the caller as
  ``UnsupportedArgument`` naming the kernel's argument (a block backend's refusal: ``kernel``).
- ``sliding_window``: converted to flash-attn's ``window_size`` exactly as the installed release converts it
  (``(w - 1, w - 1)`` from 4.56, ``(w, w)`` before; ``plan.window_size_of``), and
  like HF only when the (global) key length exceeds the window.
- ``softcap``: passed to the kernels (scores -> softcap * tanh(scores / softcap)).
- packing: the step's layout and GLOBAL ``cu_seqlens`` come from ``ctx.step`` (set once per step by
  ``hfpatch.inputs.shard_inputs``), or, without it, are derived once per step from the ``position_ids`` /
  ``cu_seq_lens_*`` HF passes (cached on the tensor's identity and version: one all-gather per step, none per
  layer). The rule for "packed" is HF's own (``_is_packed_sequence``: batch 1 and positions that are not
  ``arange + min``; documents start where the position equals the minimum).
- ``attention_mask``: a padding mask cannot be honoured (the local mask does not describe the global sequence):
  refused, unless it is all ones, in which case it changes nothing and is dropped (HF >= 4.53 itself drops an
  all-ones mask before calling flash attention).
- ``block_table`` / ``k_cache`` / ``v_cache``, a ``cache`` or ``cache_seqlens`` kwarg, or keys longer than the
  queries (a KV cache during generation): refused. CP is for training and prefill of whole sequences.
- ``dropout`` > 0: refused. HF passes the module's dropout only when ``module.training`` is True
  (``dropout=0.0 if not self.training else ...``), so a non-zero value *is* the training signal, whatever the
  grad mode; the ring kernels have no dropout.
- ``s_aux`` (attention sinks: a ``**kwargs`` entry wherever a model passes it -- gpt-oss from 4.55; from 5.6 the
  integration names it and casts it to the query's dtype): one logit per query head, an extra key of value 0 in
  every query's softmax (HF's eager sink attention). A tensor (H,), floating, on the query's device, else
  ``UnsupportedArgument``; passed to the kernels as ``sink=`` (folded into the final log-sum-exp); its gradient on
  each rank is the partial sum over that rank's queries (summed over the group like every parameter's).
- ``use_top_left_mask``: only matters when query and key lengths differ (flash-attn < 2.1 aligned the causal mask
  top-left); under CP they never do (refused above), so it is ignored.
- ``target_dtype``: as HF's flash path (``fa_peft_integration_check``): when it is given and the query is fp32,
  q, k and v are all cast to it before attention (e.g. an fp32 model under ``torch.autocast``: RoPE leaves q/k
  fp32 and v in the autocast dtype, and the integration passes the autocast dtype). Otherwise nothing is cast, and
  q, k and v must share one dtype (the kernels refuse a mix).
- ``deterministic``, ``implementation``: no effect; the ring kernels are deterministic by construction.
- other ``**kwargs`` (``layer_idx``, ``output_attentions``, ...): ignored, as HF's own function ignores them.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from hfpatch.attention.context import RingContext
from hfpatch.attention.plan import RingPlan, build_plan
from hfpatch.attention.refusals import cast_to_target, refuse, sink_of
from hfpatch.attention.step import step_for_call

__all__ = ["ring_plan", "ring_attention"]

_EMPTY: Mapping[str, Any] = {}


def ring_plan(call: Mapping[str, Any], extra: Mapping[str, Any], ctx: RingContext, *,
              inputs: Optional[tuple] = None) -> RingPlan:
    """The plan that computes this call: every refusal runs (``UnsupportedArgument`` for what ring attention cannot
    honour), the step's layout comes from ``ctx.step`` or is derived once per step, and the kernel's arguments come
    from the call's configuration. ``call``: role -> value; ``extra``: the caller's other keywords; ``inputs``:
    kept as ``RingPlan.inputs`` (what a caller that reuses the plan compares later calls with; not read here).
    Nothing is cached here: a caller that reuses plans keeps them (``hfpatch.attention.dispatch``)."""
    q, k = call["query"], call["key"]
    get = call.get
    window, softcap = get("sliding_window"), get("softcap")
    q_shape = q.shape
    refuse(call, extra or _EMPTY, q_shape, k, ctx, window, softcap)
    step = step_for_call(call, q, ctx, q_shape)
    return build_plan(step, get("is_causal", True), get("softmax_scale"), window, softcap, ctx, inputs, q_shape[2],
                       k.shape[2], q_shape[3])


def ring_attention(call: Mapping[str, Any], extra: Mapping[str, Any], ctx: RingContext) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence, by ring attention over ``ctx.group``.

    ``call``: role -> value (``query`` (B, S_local, H, D), ``key``/``value`` (B, S_local, Hk, D), ...);
    ``extra``: the caller's other keyword arguments. Returns (B, S_local, H, D) in the query's dtype.
    ``ring_plan(call, extra, ctx).run(q, k, v, sink)`` on q, k, v cast as HF casts them (``cast_to_target``): no
    collective outside the kernels' own, no Python loop over tokens; every refusal runs on every call.
    """
    q, k, v = cast_to_target(call.get("target_dtype"), call["query"], call["key"], call["value"])
    sink = sink_of(extra, q)
    return ring_plan(call, extra, ctx).run(q, k, v, sink)
