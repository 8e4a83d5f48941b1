"""Release tooling: what hfpatch knows about transformers releases it is not running on, and the tables it
publishes. Nothing here runs in a training process; ``hfpatch.apply`` never imports it.

- ``scan``         read ``_flash_attention_forward``'s signature and binding sites from a release's wheel or
                   source tree without installing it (``hfpatch signatures scan``, ``hfpatch check --transformers``);
- ``compat_table`` COMPAT.md from the release matrix's records and the static scan (``hfpatch compat``);
- ``sweep``        the model sweep: every flash-capable causal-LM class of the installed release built tiny and
                   trained under CP against non-CP, and MODELS.md rendered from its verdicts (``hfpatch models``).
"""
