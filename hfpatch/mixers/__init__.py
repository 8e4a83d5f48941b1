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

The wing, a folder per naming scheme; each layer imports only those below it (see each module's docstring):

- ``install``   ``install_mixers(model, context)``: rebinds the kernel names of every recognised module to CP
                wrappers that follow the switch (``MixerInstallation.remove()`` restores them);
- ``registry``  ``recognise(module)``: the entry of ``families/`` it matches, or why none does;
- ``families/`` the registry's entries, one module per family (every release of it): classes, forward
                fingerprints, and the kernel names the forward calls or the CP forms that replace it;
- ``forms/``    CP forms, one module per family, one form per release line that computes the recurrence inline
                (no kernel name to rebind): that release's forward, its kernels called by names of the form's
                own module;
- ``kinds/``    one ``SequenceKernel`` per module, listed in ``kinds.KERNELS`` by role: what a kernel does under
                CP (``conv``, ``delta_rule``, ``ssd``, ``fused_ssd``, ``selective_scan``, ``lightning``,
                ``rglru``, ``cca``; ``cached_step`` refuses the one-token steps from a cache);
- core          ``kernel`` (``SequenceKernel``, ``KernelCall``, the refusals every kind and form shares),
                ``family`` (``MixerFamily``, the fingerprint a forward is recognised by,
                ``require_methods_read``), ``segments`` (``SegmentPlan``: split, join, ``exchange``).

Adding a kind: a ``SequenceKernel`` subclass (``role``, ``token_args``, ``check``, ``run_cp``) in its own module
of ``kinds/``, listed in ``kinds.KERNELS``; entries in ``families/`` for the families calling it; tests comparing
CP with the whole sequence (forward and gradients, zigzag and contiguous) and the real HF classes through the
sweep's ``check_class``. Adding a release that computes a mixer inline: its form in the family's module of
``forms/``, and an entry naming it.
"""
from __future__ import annotations

from hfpatch.mixers.install import MixerInstallation, install_mixers
from hfpatch.mixers.registry import FAMILIES, recognise, unrecognised_reason

__all__ = ["FAMILIES", "MixerInstallation", "install_mixers", "recognise", "unrecognised_reason"]
