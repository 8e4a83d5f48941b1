"""The attention patch: transformers' flash-attention entry point, replaced by a generated wrapper that runs the
ring kernels.

Flow of one patch: ``discovery`` finds the model's attention layers; ``codegen`` renders the wrapper for the
release's signature; ``patcher`` installs it at the defining module and every binding site (all-or-nothing,
undone by identity); at each call ``dispatch`` chooses ring, original, reference or local and ``semantics``
turns the call's arguments into a ring plan (layout, masks, windows, softcap, sinks) or a named refusal;
``opaque`` hides the ring call from torch.compile's tracer as one opaque op.
"""
