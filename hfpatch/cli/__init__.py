"""The ``hfpatch`` command line. Each subcommand lives in its own module and registers itself here."""
from __future__ import annotations

import argparse
import importlib
import sys

# subcommand name -> module under hfpatch.cli that defines ``add_parser(subparsers)``;
# the parser it adds sets ``func(args) -> int`` (the exit code).
SUBCOMMANDS = {
    "signatures": "signatures",
    "check": "check",
    "compat": "compat",
    "demo": "demo",
    "models": "models",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hfpatch", description=__doc__)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in SUBCOMMANDS.values():
        importlib.import_module(f"hfpatch.cli.{module_name}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
