"""``hfpatch signatures scan``: read a transformers release statically and give the registry verdict.

    hfpatch signatures scan (--wheel PATH | --version X.Y.Z | --source DIR) [--json]
                            [--write [--id ID] [--releases SPEC] [--registry-dir DIR]]

Exit codes: 0 the signature is in the registry (exact) or a compatible extension of an entry, or ``--write``
stored it; 1 unsupported (a new generation, or a release before 4.43), or ``--write`` refused; 2 bad input (unknown version, not a transformers wheel, no
network), with nothing written.

``--write`` stores the entry in the registry folder: for an exact match it records the scanned release in the
existing entry's ``scanned_in`` (and sets ``releases`` when ``--releases`` is given); for a new generation it
writes the proposal as ``<ID>.json``. This is how the registry's files are (re)generated: see
``hfpatch/signatures/REGENERATE.md``.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import Version

from hfpatch.cli.arguments import HelpFormatter
from hfpatch.errors import HfpatchError, ScanError
from hfpatch.release.scan import ReleaseScan, scan_source, scan_version, scan_wheel
from hfpatch.signatures import registry
from hfpatch.signatures.roles import UNKNOWN_ROLE

EXIT_SUPPORTED, EXIT_UNSUPPORTED, EXIT_USAGE = 0, 1, 2


_DESCRIPTION = """\
Developer command: read a transformers release statically (never installed or imported) and match its
flash-attention signature against hfpatch's signature registry; --write stores the result in the registry (see
hfpatch/signatures/REGENERATE.md).

  hfpatch signatures scan --version X.Y.Z   its wheel, fetched with pip
  hfpatch signatures scan --wheel PATH      a transformers-*.whl file
  hfpatch signatures scan --source DIR      a checkout or site-packages folder

exit status: 0 exact or compatible (or --write stored it); 1 unsupported, or --write refused; 2 bad input
(unknown version, not a transformers wheel, no network), nothing written."""


def build_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=_DESCRIPTION, formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="signatures_command", metavar="ACTION")

    def help_without_action(args: argparse.Namespace) -> int:
        parser.print_help()  # the help is the fix: it names the one action
        return EXIT_USAGE

    parser.set_defaults(func=help_without_action)
    scan = sub.add_parser("scan", help="read a release statically (never imported) and give the registry verdict",
                          description="Read a transformers release statically and give the registry verdict.")
    source = scan.add_mutually_exclusive_group(required=True)
    source.add_argument("--wheel", metavar="PATH", help="a transformers-*.whl file")
    source.add_argument("--version", metavar="X.Y.Z", help="fetch this release's wheel with pip (cached)")
    source.add_argument("--source", metavar="DIR", help="a source tree (checkout or site-packages)")
    scan.add_argument("--json", action="store_true", help="print the facts as JSON")
    scan.add_argument("--write", action="store_true", help="store the entry in the registry folder")
    scan.add_argument("--id", dest="entry_id", metavar="ID", help="id of a new entry, e.g. S8-5.30.0")
    scan.add_argument("--releases", metavar="SPEC", help="the entry's releases, a packaging specifier")
    scan.add_argument("--registry-dir", metavar="DIR", help="where --write writes (default: the installed registry)")
    scan.set_defaults(func=run_scan)
    return parser


def run_scan(args: argparse.Namespace) -> int:
    try:
        if args.releases is not None:
            SpecifierSet(args.releases)
        result = _scan(args)
    except InvalidSpecifier as exc:
        print(f"hfpatch: --releases {args.releases!r} is not a packaging specifier ({exc}); e.g. '>=5.30,<5.31'", file=sys.stderr)
        return EXIT_USAGE
    except HfpatchError as exc:
        print(f"hfpatch: {exc}", file=sys.stderr)
        return EXIT_USAGE
    found = result.match()
    report = _report(result, found, args)
    if args.write:
        try:
            report["written"] = str(_write(result, found, args))
        except HfpatchError as exc:
            print(f"hfpatch: --write: {exc}", file=sys.stderr)
            return EXIT_UNSUPPORTED
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print(_render_text(result, found, report))
    if args.write:
        return EXIT_SUPPORTED  # the registry now holds this release's signature
    return EXIT_SUPPORTED if found is not None and found.supported else EXIT_UNSUPPORTED


def _scan(args: argparse.Namespace) -> ReleaseScan:
    if args.wheel:
        return scan_wheel(args.wheel)
    if args.version:
        return scan_version(args.version)
    return scan_source(args.source)


def _report(result: ReleaseScan, found: registry.Match | None, args) -> dict:
    report = {"scan": result.to_json()}
    if found is None:
        report["verdict"] = "unsupported"
        report["signature_id"] = None
        report["message"] = (
            f"transformers {result.version} has no module-level _flash_attention_forward "
            f"({len(result.class_methods)} per-class methods); not supported; upgrade to >= 4.43"
        )
        return report
    report.update(verdict=found.verdict, signature_id=found.id, nearest_entry=found.entry.id if found.entry else None, diff=found.diff)
    report["notes"] = list(found.notes)
    if found.verdict != "exact":
        report["proposed_entry"] = result.to_registry_entry(entry_id=args.entry_id, releases=args.releases)
    return report


def _render_text(result: ReleaseScan, found: registry.Match | None, report: dict) -> str:
    lines = [f"transformers {result.version}  ({result.origin})"]
    if found is None:
        lines.append(report["message"])
        return "\n".join(lines)
    lines.append(f"verdict: {found.verdict}  signature: {found.id}")
    lines.extend(f"note: {note}" for note in found.notes)
    if found.diff:
        lines.append(found.diff)
    lines.append(f"from-import binding modules ({len(result.binding_modules)}):")
    lines.extend(f"  {module}" for module in result.binding_modules)
    ai = result.attention_interface
    lines.append(f"attention interface: {ai.kind}; default keys: {', '.join(ai.keys) or '-'}")
    lines.append(f"flash keys: {', '.join(ai.flash_keys) or '-'}")
    if "proposed_entry" in report:
        lines.append("proposed registry entry:")
        lines.append(json.dumps(report["proposed_entry"], indent=2))
    if "written" in report:
        lines.append(f"written: {report['written']}")
    return "\n".join(lines)


def _registry_dir(args) -> Path:
    return Path(args.registry_dir) if args.registry_dir else Path(registry.__file__).parent


def _write(result: ReleaseScan, found: registry.Match | None, args) -> Path:
    """Write the entry (see the module docstring); refuses anything the registry could not load."""
    if found is None:
        result.to_registry_entry()  # raises ScanError: nothing to write before 4.43
    directory = _registry_dir(args)
    if found.verdict == "exact":
        path = directory / f"{found.entry.id}.json"
        data = json.loads(path.read_text(encoding="utf-8")) if path.exists() else found.entry.to_json()
        scanned = set(data.get("scanned_in", [])) | {result.version}
        data["scanned_in"] = sorted(scanned, key=Version)
        if args.releases:
            data["releases"] = args.releases
    else:
        if not args.entry_id:
            raise ScanError("a new generation needs --id (e.g. S8-<first release>) and --releases")
        data = result.to_registry_entry(entry_id=args.entry_id, releases=args.releases)
        unknown = [p["name"] for p in data["params"] if p["role"] == UNKNOWN_ROLE]
        undecided = [p["name"] for p in data["params"] if "todo" in p.get("default", {})]
        if unknown or undecided:
            raise ScanError(
                f"parameters {unknown} have no known role and {undecided} have a non-literal default; "
                "edit the proposal by hand (roles from hfpatch.signatures.ROLES) instead of --write"
            )
        path = directory / f"{args.entry_id}.json"
    registry.entry_from_json(data, origin=str(path))  # validate before touching the file
    directory.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    registry.load_cached.cache_clear()
    return path
