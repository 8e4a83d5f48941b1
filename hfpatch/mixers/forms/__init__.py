"""CP forms: the forwards (and the methods they dispatch to) of mixer modules whose release computes the recurrence
inline, so that there is no kernel name in the modeling module for hfpatch to rebind. One module per family, one
form per release line of it (``family.MixerFamily.replaces`` names the form of each entry in
``hfpatch.mixers.families``); under CP ``install_mixers`` replaces the method on each recognised instance by its
form.

A form computes what the release's code computes, its sequence parts through kernels it calls by names that are
globals of its own module (``causal_conv1d``, ``lightning_attention``, ...): those are the entry's ``bindings``,
which ``install_mixers`` rebinds to the kinds' CP wrappers (``hfpatch.mixers.kinds``). It refuses a cache by name
(``kernel.CACHE_REASON``), and where it reproduces methods besides the forward the registry recognised, checks
their fingerprints first (``family.require_methods_read``).
"""
