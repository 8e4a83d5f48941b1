"""Argument checks the commands share, run before any process is spawned.

Each check raises ``UsageError`` whose text is one line: the option and its value, why the command cannot run
with it, and the fix. ``hfpatch.cli.main`` prints that line under the command's usage and exits 2.

Importing this module imports neither torch nor transformers; ``cpu_kernel`` imports torch when it is called
(the backends it checks against are torch's), which every command that takes ``--kernel`` does anyway.
"""
from __future__ import annotations

import argparse
import textwrap

from hfpatch.errors import UnsupportedArgument

__all__ = ["UsageError", "EXIT_USAGE", "HelpFormatter", "positive_int", "positive_seconds", "require_cp_world",
           "cpu_kernel"]

EXIT_USAGE = 2


class UsageError(ValueError):
    """A command line the command cannot run; ``str(exc)`` is one line naming the cause and the fix."""


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Fills each paragraph of a description or epilog to the help's width, as argparse does with the options,
    but keeps a paragraph with an indented line (examples, a table of commands) as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "\n\n".join(
            paragraph if any(line.startswith(" ") for line in paragraph.splitlines())
            else textwrap.fill(" ".join(paragraph.split()), width, initial_indent=indent, subsequent_indent=indent)
            for paragraph in text.split("\n\n")
        )


def positive_int(text: str) -> int:
    """argparse ``type=``: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def positive_seconds(text: str) -> float:
    """argparse ``type=``: a number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text}")
    return value


def require_cp_world(world_size: int, *, option: str = "--world-size") -> None:
    """A context-parallel group needs at least 2 processes."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 2:
        raise UsageError(
            f"{option} {world_size!r}: context parallelism needs at least 2 processes (with one, hfpatch.apply "
            f"is inactive and nothing is split). Fix: {option} 2 (the default) or more."
        )


def cpu_kernel(kernel: str, world_size: int) -> tuple[str, str]:
    """``(variant, backend)`` of ``kernel`` ("variant" or "variant:backend", as ``hfpatch.apply(kernel=)``) when it
    can run on ``world_size`` CPU processes (``usp:UxR``: U x R of them); ``UsageError`` otherwise."""
    from hfpatch.attention import context  # deferred (torch): `--help` must not load it
    from ring_kernels.backends import available_backends  # deferred (torch): as above

    fix = "Fix: --kernel auto (the default)."
    try:
        variant, backend = context.parse_kernel(kernel)
    except ValueError:
        raise UsageError(
            f"--kernel {kernel!r}: expected auto, a ring variant ({', '.join(context.VARIANTS)}), ulysses or "
            f"usp:UxR (U x R = the world size), optionally followed by :backend (e.g. zigzag:reference). {fix}"
        ) from None
    cpu_backends = available_backends("cpu")
    if backend != "auto" and backend not in cpu_backends:
        raise UsageError(
            f"--kernel {kernel!r}: backend {backend!r} cannot run on CPU processes; the CPU backends are auto, "
            f"{', '.join(cpu_backends)}. Fix: --kernel {variant} (its backend chosen automatically)."
        )
    try:
        context.check_grid(variant, world_size)
    except UnsupportedArgument as exc:
        raise UsageError(f"--kernel {kernel} --world-size {world_size}: {exc.reason} Fix: {exc.fix}") from None
    return variant, backend
