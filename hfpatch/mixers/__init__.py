"""Sequence mixers (short convolutions, gated delta rules, ...) run exactly under context parallelism.

A sequence mixer carries a state along the sequence that is an affine function of the state entering any run of
tokens, plus a short causal-convolution window. Under CP each rank holds some runs ("segments") of the global
sequence. For each mixer call, hfpatch

1. summarises each local segment from a zero state (its state transition and zero-start final state, or the
   convolution's last K-1 inputs), computed with the model's own kernel;
2. all-gathers every segment's summary (O(state) per segment, never O(tokens)) -- one differentiable collective;
3. composes, in global order, the state entering each local segment, and corrects (or re-runs) the segment from it.

Works for every layout the attention uses except stripe (refused by name): contiguous (ring, llama3, packed) and
zigzag (batch, and zigzag varlen). Packed rows: documents are run as one sequence, as HF's modules do when the
documents are given by position_ids only; packing metadata passed to the kernels (``cu_seq_lens_*``, ``seq_idx``)
is refused by name.

Layers (see each module's docstring):

- ``segments``  -- ``Segment``, ``SegmentPlan`` (split/join a local tensor, ``exchange`` summaries), layouts;
- ``kernel``    -- ``SequenceKernel`` (the interface of one kernel kind) and ``KernelCall`` (its bound call);
- the kinds, one module each; ``kinds.KERNELS`` lists them by role:
  ``conv`` (causal short convolution: LFM2, and the convolution of every hybrid below),
  ``delta_rule`` (chunked gated delta rule: Qwen3-Next, Qwen3.5, OLMo hybrid, Kimi-Linear's KDA, Bailing),
  ``ssd`` (Mamba2's chunked scan: Bamba, Falcon-H1, Nemotron-H, Zamba2, Granite 4 hybrid),
  ``selective_scan`` (Mamba's scan: Jamba, Zamba), ``lightning`` (MiniMax's lightning attention),
  ``rglru`` (RecurrentGemma's RG-LRU), ``cca`` (ZAYA's convolved Q/K projection);
  ``cached_step`` refuses the one-token decode kernels (a cache) by name;
- CP forms of modules whose release computes the recurrence inline (no kernel name to rebind; the registry
  replaces the method on the instance): ``mamba_inline`` (Jamba 4.43 - 5.0), ``mamba2_inline`` (Bamba 4.48 - 5.0),
  ``short_conv`` (LFM2 4.54 - 5.0), ``gated_deltanet_forms`` (Qwen3-Next 5.0), and in the kinds' own modules
  ``lightning`` (MiniMax), ``rglru`` (RecurrentGemma), ``cca`` (ZAYA);
- ``fingerprint`` -- the key a forward is recognised by: a hash of its syntax tree, written by one fixed rule so
  that it is the same on every Python minor;
- ``registry``  -- the versioned registry: which module classes, forward fingerprints and kernel bindings of
  which releases hfpatch recognises (``recognise``, ``unrecognised_reason``); its entries live in ``families``
  (one module per family, every release of it) as ``family.MixerFamily`` records;
- ``install``   -- ``install_mixers(model, ctx)``: rebind the kernels of recognised modules to CP wrappers that
  follow the switch; ``MixerInstallation.remove()`` restores them.

Adding a kind: a ``SequenceKernel`` subclass (``role``, ``token_args``, ``check``, ``run_cp``) in its own module,
listed in ``kinds.KERNELS``; registry entries for the families calling it; tests comparing CP with the whole
sequence (forward and gradients, zigzag and contiguous) and the real HF classes through the sweep's
``check_class``.
"""
from __future__ import annotations

from hfpatch.mixers.install import MixerInstallation, install_mixers
from hfpatch.mixers.registry import FAMILIES, recognise, unrecognised_reason

__all__ = ["FAMILIES", "MixerInstallation", "install_mixers", "recognise", "unrecognised_reason"]
