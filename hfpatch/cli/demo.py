"""``hfpatch demo``: the main job in one command (the world itself is ``hfpatch.cli.demo_world``).

Every argument is checked here before any process is spawned: a value the world could not run (a sequence
length the kernel's layout cannot split, a kernel or backend that does not exist on CPU) is a ``UsageError``,
exit status 2 with one line. Importing this module imports neither torch nor transformers.
"""
from __future__ import annotations

import argparse

from hfpatch.cli.arguments import HelpFormatter, UsageError, cpu_kernel, positive_int

__all__ = ["build_parser", "run", "MODEL_FAMILIES", "sequence_units"]

# The tiny model families of hfpatch.cli.demo_models.MODEL_NAMES (which imports torch, so --help cannot read it;
# tests/tooling/test_cli.py checks that the two agree).
MODEL_FAMILIES = ("llama", "qwen2", "mistral", "gemma2", "mixtral", "qwen2_moe")

_DESCRIPTION = """\
Train a tiny HuggingFace model on N CPU processes joined by gloo, once with context parallelism (hfpatch.apply:
each process holds a slice of the sequence) and once without (the same model, eager attention on the whole
sequence), and compare the losses and gradients of every step. Random weights, no download; seconds on a laptop.

examples:
  hfpatch demo                             a tiny Llama on 2 processes
  hfpatch demo --world-size 4 --steps 3    4 processes, 3 SGD steps
  hfpatch demo --model gemma2 --packed     softcap, sliding window, packing

exit status: 0 when CP matches non-CP; 1 on a mismatch or when a process fails; 2 usage error. With
--world-size 1 there is no context parallelism: the demo says so and exits 0."""


def build_parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=_DESCRIPTION, formatter_class=HelpFormatter)
    p.add_argument("--world-size", type=positive_int, default=2, metavar="N",
                   help="CPU processes in the context-parallel group (default 2)")
    p.add_argument("--model", choices=MODEL_FAMILIES, default="llama",
                   help="tiny model family (default llama)")
    p.add_argument("--steps", type=positive_int, default=1, metavar="N",
                   help="training steps (SGD), compared at each step (default 1)")
    p.add_argument("--seq-len", type=positive_int, default=64, metavar="TOKENS",
                   help="tokens per row of the whole sequence (default 64); split evenly over the processes")
    p.add_argument("--kernel", default="auto",
                   help="kernel: auto (default), a ring variant (zigzag, ring, stripe, llama3), ulysses or "
                        "usp:UxR, optionally with :backend (e.g. zigzag:reference)")
    p.add_argument("--packed", action="store_true", help="one row of packed documents instead of a batch")
    p.set_defaults(func=run)
    return p


def sequence_units(variant: str, world_size: int, *, packed: bool) -> tuple[int, str, int]:
    """``(row unit, layout, document unit)``: a row's length must be a multiple of the row unit for the step's
    ``layout`` to split it over ``world_size`` ranks, and with packed zigzag every document a multiple of the
    document unit. The layouts are ``ring_kernels.layout``'s: zigzag cuts 2N chunks (of each document, when
    packed), contiguous and stripe N."""
    from hfpatch.attention.kernel_choice import plan_step  # deferred (torch): `--help` must not load it

    _, layout = plan_step(variant, packed=packed)
    if world_size == 1:  # a world of one holds the whole sequence, whatever the layout
        return 1, layout, 1
    row = 2 * world_size if layout == "zigzag" else world_size
    return row, layout, row if (packed and layout == "zigzag") else 1


def _check_seq_len(seq_len: int, variant: str, world_size: int, packed: bool) -> int:
    """The document unit for ``_inputs``; ``UsageError`` when ``seq_len`` cannot be split."""
    row, layout, document = sequence_units(variant, world_size, packed=packed)
    if seq_len % row:
        fit = -(-seq_len // row) * row
        what = "each packed document" if document > 1 else "a row"
        raise UsageError(
            f"--seq-len {seq_len}: the {layout} layout splits {what} over {world_size} processes in {row} equal "
            f"parts, so the length must be a multiple of {row}. Fix: --seq-len {fit}."
        )
    return document


def run(args: argparse.Namespace) -> int:
    variant, _ = cpu_kernel(args.kernel, args.world_size)
    document_unit = _check_seq_len(args.seq_len, variant, args.world_size, args.packed)
    from hfpatch.cli.demo_world import DemoOptions, run_demo  # deferred (torch): as above

    return run_demo(DemoOptions(model=args.model, world_size=args.world_size, steps=args.steps,
                                seq_len=args.seq_len, kernel=args.kernel, packed=args.packed,
                                document_unit=document_unit))
