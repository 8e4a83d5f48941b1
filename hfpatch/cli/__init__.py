"""The ``hfpatch`` command line: ``main(argv) -> exit status`` (the console script and ``python -m hfpatch``).

Contracts:

- ``hfpatch --help`` and ``hfpatch --version`` import no command module, and nothing under ``hfpatch.cli``
  imports torch or transformers for them: the top-level parser is built from ``COMMANDS`` alone, and versions
  are read from package metadata. (``import hfpatch`` runs first; what it imports adds to the start-up.)
- A command's module (``hfpatch.cli.<name>``) is imported only when that command is named. It provides
  ``build_parser(prog) -> argparse.ArgumentParser`` whose defaults set ``func(args) -> int`` (the exit status);
  building that parser imports neither torch nor transformers either.
- Exit status 2 is a usage error: argparse's own (``SystemExit(2)``), or a ``UsageError`` a command raises
  before it spawns any process (``main`` returns 2); either is printed as the command's usage and one line
  naming the cause and the fix.
"""
from __future__ import annotations

import argparse
import importlib
import platform
import sys
import textwrap
from dataclasses import dataclass
from importlib import metadata

from hfpatch import __version__
from hfpatch.cli.arguments import EXIT_USAGE, HelpFormatter, UsageError

__all__ = ["main", "build_parser", "version_text", "COMMANDS", "Command"]

_TABLE_WIDTH = 78  # the command table's lines (kept as written by HelpFormatter)


@dataclass(frozen=True)
class Command:
    """A subcommand: its ``name`` (also its module's, under ``hfpatch.cli``), the one-line ``summary`` shown by
    ``hfpatch --help``, and whether it is a ``developer`` command (listed last)."""

    name: str
    summary: str
    developer: bool = False


# In the order `hfpatch --help` lists them: what a user runs first, developer tooling last.
COMMANDS = {c.name: c for c in (
    Command("demo", "train a tiny model on CPU processes with and without context parallelism; compare losses "
                    "and gradients"),
    Command("check", "can hfpatch patch the installed transformers (or a given release)? exit 0 yes, 1 no"),
    Command("models", "which causal-LM classes train exactly under context parallelism (minutes)"),
    Command("signatures", "scan a transformers release against the signature registry", developer=True),
    Command("compat", "render or check COMPAT.md; record a release-matrix run", developer=True),
)}

_ABOUT = """\
hfpatch gives HuggingFace transformers models context parallelism: ring attention splits each sequence over a
group of GPUs (or CPU processes), and training gives the same loss and gradients as without it. In Python:
patch = hfpatch.apply(cp_group, model=model)."""

_EPILOG = """\
Run 'hfpatch COMMAND --help' for a command's options. Exit status: 0 success; 1 the check or comparison failed;
2 usage or environment error."""


def _command_list(developer: bool) -> str:
    width = max(len(name) for name in COMMANDS) + 4
    return "\n".join(
        textwrap.fill(command.summary, _TABLE_WIDTH, initial_indent=f"  {command.name:<{width - 2}}",
                      subsequent_indent=" " * width)
        for command in COMMANDS.values() if command.developer == developer
    )


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser: ``--help``, ``--version`` and the command's name (its arguments are the command's)."""
    description = (f"{_ABOUT}\n\ncommands:\n{_command_list(developer=False)}\n\n"
                   f"developer commands:\n{_command_list(developer=True)}")
    parser = argparse.ArgumentParser(
        prog="hfpatch", usage="%(prog)s [-h] [--version] COMMAND [ARGS ...]", description=description,
        epilog=_EPILOG, formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="store_true",
                        help="show the hfpatch, transformers and torch versions and exit")
    parser.add_argument("command", nargs="?", choices=tuple(COMMANDS), metavar="COMMAND", help=argparse.SUPPRESS)
    return parser


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    """(hfpatch's own options and the command's name, the command's arguments): the command's arguments start
    after the first word that is not an option, and reach its parser untouched (``--`` included)."""
    for index, word in enumerate(argv):
        if not word.startswith("-"):
            return argv[:index + 1], argv[index + 1:]
    return argv, []


def _installed(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "not installed"


def version_text() -> str:
    """One line: hfpatch's version, then transformers', torch's and Python's (read without importing them)."""
    return (f"hfpatch {__version__} (transformers {_installed('transformers')}, torch {_installed('torch')}, "
            f"Python {platform.python_version()})")


def main(argv: list[str] | None = None) -> int:
    own, rest = _split(sys.argv[1:] if argv is None else list(argv))
    parser = build_parser()
    args = parser.parse_args(own)
    if args.version:
        print(version_text())
        return 0
    if args.command is None:
        parser.error("no COMMAND given; 'hfpatch demo' runs the demo, 'hfpatch --help' lists every command")
    command = COMMANDS[args.command]
    module = importlib.import_module(f"hfpatch.cli.{command.name}")
    command_parser = module.build_parser(f"{parser.prog} {command.name}")
    command_args = command_parser.parse_args(rest)
    try:
        return int(command_args.func(command_args) or 0)
    except UsageError as exc:  # reported as argparse reports its own errors, but returned, not raised
        command_parser.print_usage(sys.stderr)
        print(f"{command_parser.prog}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
