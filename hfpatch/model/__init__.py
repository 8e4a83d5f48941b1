"""Hooks on the user's model that make the whole model exact under CP, beside the attention patch.

``audit`` finds what the model computes outside attention that CP would change (and refuses it by name), and
``expert_parallel`` and ``tensor_parallel`` whether transformers loaded it with expert or tensor parallelism
(refused there too; ``parallel_load`` reads the plan such a load applied);
``routing`` switches the model onto the flash-attention path the patch replaces; ``positions`` gives position
ids and rotary tables the global numbering; ``labels`` aligns shifted labels across shard boundaries;
``inputs_guard`` refuses unsharded inputs; ``probe`` compares the patched model with the unpatched one on a
small input; ``checkpointing`` keeps each ring call's output through activation checkpointing
(``hfpatch.keep_attention``).
"""
