"""``hfpatch compat``: COMPAT.md from the release matrix and the static scan (``hfpatch.release.compat_table``).

Modes: render (offline), ``--scan`` (static scan of the latest patch of every minor release from 4.43 on, written
to compat/static.json, then render), ``--check`` (exit 1 when COMPAT.md is stale; with ``--fresh-results DIR``
also when a fresh matrix run disagrees with the committed records), ``--record ENV -- CMD`` (tox: run CMD, then
``hfpatch check --json``, and write the matrix record compat/results/<release>.json; exit with CMD's status).

Exit codes: 0 done / current; 1 stale, or a recorded test run or check failed; 2 usage or environment error.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from hfpatch.cli.arguments import HelpFormatter, UsageError
from hfpatch.cli.static_check import static_check
from hfpatch.errors import InvalidReleaseSpec, ScanError, WheelFetchError
from hfpatch.release.compat_table import (entry_digest, latest_patch_per_minor, load_results, load_static,
                                          registry_digest, render, stale_reasons)
from hfpatch.version_gates import parse_version

__all__ = ["build_parser"]

_DEFAULT_RESULTS = Path("compat/results")
_DEFAULT_STATIC = Path("compat/static.json")
_DEFAULT_OUTPUT = Path("COMPAT.md")
# pytest's closing line, e.g. "123 passed, 2 skipped in 81.20s (0:01:21)" or "no tests ran in 0.01s".
_PYTEST_SUMMARY = re.compile(r"^=*\s*((?:\d+ \w+(?:, )?)+|no tests ran)(?: in [\d.]+s.*)?\s*=*$")


_DESCRIPTION = """\
Developer command: COMPAT.md, the table of every transformers release with hfpatch's verdict, from the release
matrix's records (compat/results/) and the static scan (compat/static.json).

  hfpatch compat            render COMPAT.md from its inputs (offline)
  hfpatch compat --scan     scan the latest patch of every minor release from
                            4.43 on (wheels fetched with pip into a cache),
                            write compat/static.json, then render
  hfpatch compat --check    exit 1 when COMPAT.md is stale (offline); with
                            --fresh-results DIR, also when a fresh matrix run
                            disagrees with the committed records
  hfpatch compat --record ENV -- CMD
                            (tox) run the test command CMD, then 'hfpatch
                            check --json', and write the matrix record
                            compat/results/<release>.json; exit with CMD's
                            status

exit status: 0 done or current; 1 stale, or a recorded test run or check failed; 2 usage or environment
error."""


def build_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=_DESCRIPTION, formatter_class=HelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--scan", action="store_true", help="statically scan every minor release, then render")
    mode.add_argument("--check", action="store_true", help="fail (exit 1) when COMPAT.md is stale")
    mode.add_argument("--record", metavar="ENV", help="run the command after -- and write ENV's matrix record")
    parser.add_argument("--results-dir", type=Path, default=_DEFAULT_RESULTS, help="matrix records (default %(default)s)")
    parser.add_argument("--static", type=Path, default=_DEFAULT_STATIC, help="static scan file (default %(default)s)")
    parser.add_argument("--output", type=Path, default=_DEFAULT_OUTPUT, help="the rendered file (default %(default)s)")
    parser.add_argument("--fresh-results", type=Path, metavar="DIR", help="with --check: records of a fresh matrix run")
    parser.add_argument(
        "--releases", metavar="X.Y.Z,...",
        help="with --scan: the releases known to exist (default: ask the package index with 'pip index versions')",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="with --record: -- the test command")
    parser.set_defaults(func=_main)
    return parser


def _environment_error(message: str) -> int:
    """An environment error found while running (exit 2); usage errors are raised as ``UsageError``."""
    print(f"hfpatch compat: {message}", file=sys.stderr)
    return 2


def _main(args: argparse.Namespace) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if command and not args.record:
        raise UsageError(f"unexpected arguments {command!r}: only --record ENV takes a command. "
                         "Fix: --record ENV -- CMD, or drop them.")
    if args.fresh_results and not args.check:
        raise UsageError("--fresh-results is only used with --check. Fix: add --check.")
    if args.releases and not args.scan:
        raise UsageError("--releases is only used with --scan. Fix: add --scan.")
    if args.record:
        if not command:
            raise UsageError("--record ENV needs the test command after --. Fix: e.g. -- python -m pytest -q")
        return record(args.record, command, args.results_dir)
    if args.check:
        return check(args.output, args.results_dir, args.static, args.fresh_results)
    if args.scan:
        code = scan(args.static, args.results_dir, args.releases)
        if code:
            return code
    return write(args.output, args.results_dir, args.static)


# ---------------------------------------------------------------------------------------- render/check


def write(output: Path, results_dir: Path, static_path: Path) -> int:
    results, static = load_results(results_dir), load_static(static_path)
    digest = registry_digest()
    stale_inputs = [f"compat/results {r}" for r, rec in results.items()
                    if rec.get("entry_digest") != entry_digest(rec.get("signature_id"))]
    if static.get("releases") and static.get("registry_digest") != digest:
        stale_inputs.append(str(static_path))
    output.write_text(render(results, static, digest=digest), encoding="utf-8")
    print(f"wrote {output} ({len(results)} matrix records, {len(static.get('releases', {}))} statically scanned)")
    if stale_inputs:
        print("warning: made against an older registry (run `hfpatch compat --scan` / re-run those tox envs): "
              + ", ".join(stale_inputs), file=sys.stderr)
    return 0


def check(output: Path, results_dir: Path, static_path: Path, fresh_dir: Path | None) -> int:
    if fresh_dir is not None and not fresh_dir.is_dir():
        return _environment_error(f"--fresh-results {fresh_dir}: no such folder (did the matrix run write its records there?)")
    fresh = load_results(fresh_dir) if fresh_dir is not None else None
    if fresh_dir is not None and not fresh:
        return _environment_error(f"--fresh-results {fresh_dir}: the folder holds no matrix records")
    text = output.read_text(encoding="utf-8") if output.is_file() else None
    reasons = stale_reasons(text, load_results(results_dir), load_static(static_path), fresh_results=fresh)
    if reasons:
        print(f"{output} is stale:", file=sys.stderr)
        for reason in reasons:
            print(f"  - {reason}", file=sys.stderr)
        return 1
    unrecorded = sorted(set(fresh or {}) - set(load_results(results_dir)))
    if unrecorded:
        print(f"note: the matrix ran {', '.join(unrecorded)} without a committed record in {results_dir}; "
              "copy those records there and run `hfpatch compat` to show them in COMPAT.md")
    extra = " and agrees with the fresh matrix records" if fresh else ""
    print(f"{output} is current with the registry and its inputs{extra}")
    return 0


# ------------------------------------------------------------------------------------------------ scan


def available_releases() -> list[str]:
    """Every transformers release on the package index, via pip's own client (one query)."""
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "index", "versions", "transformers", "--disable-pip-version-check"],
        capture_output=True, text=True,
    )
    found = re.search(r"Available versions:\s*(.+)", proc.stdout)
    if proc.returncode != 0 or not found:
        raise WheelFetchError(
            "could not list transformers releases with `pip index versions transformers` (no network?). "
            "Fix: connect, or pass --releases X.Y.Z,...",
            pip_output=(proc.stdout + proc.stderr)[-2000:],
        )
    return [v.strip() for v in found.group(1).split(",") if v.strip()]


def scan(static_path: Path, results_dir: Path, releases_arg: str | None) -> int:
    """Statically check the latest patch of every minor release; write ``static_path``. Nothing is written
    unless every release could be read."""
    try:
        if releases_arg:
            known = [str(parse_version(v, argument="--releases entry")) for v in releases_arg.split(",") if v.strip()]
        else:
            known = available_releases()
    except (InvalidReleaseSpec, WheelFetchError) as exc:
        return _environment_error(str(exc))
    matrix = list(load_results(results_dir))
    targets = latest_patch_per_minor(known + matrix)
    # The matrix's release of a minor is scanned too (its static site count is shown beside the live one).
    targets = sorted(set(targets) | set(matrix), key=lambda v: tuple(int(p) for p in v.split(".")[:3]))
    scanned = {}
    for release in targets:
        try:
            facts = static_check(release)
        except (WheelFetchError, ScanError, InvalidReleaseSpec) as exc:
            return _environment_error(f"static scan of transformers {release} failed, nothing written: {exc}")
        scanned[release] = _static_facts(facts)
        print(f"  {release}: {scanned[release]['signature_id']} ({scanned[release]['verdict']}), "
              f"{len(scanned[release]['binding_sites'])} from-import sites")
    data = {
        "registry_digest": registry_digest(),
        "date": _today(),
        "available_releases": sorted(set(known), key=_sort_key),
        "releases": scanned,
    }
    static_path.parent.mkdir(parents=True, exist_ok=True)
    static_path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    print(f"wrote {static_path} ({len(scanned)} releases)")
    return 0


def _static_facts(facts: dict) -> dict:
    """The subset of ``static_check``'s answer that COMPAT.md shows (kept small and stable)."""
    return {
        "verdict": facts.get("verdict"),
        "signature_id": facts.get("signature_id"),
        "supported": bool(facts.get("supported")),
        "binding_sites": sorted(str(s) for s in facts.get("binding_modules") or []),
    }


def _sort_key(text: str):
    from packaging.version import InvalidVersion, Version

    try:
        return (0, Version(text))
    except InvalidVersion:
        return (1, text)


def _today() -> str:
    return _dt.datetime.now(_dt.timezone.utc).date().isoformat()


# ---------------------------------------------------------------------------------------------- record


def _run_streaming(command: list[str]) -> tuple[int, str | None]:
    """Run ``command``, echoing its output; return its exit status and pytest's closing summary (timing cut)."""
    try:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    except OSError as exc:
        print(f"hfpatch compat: cannot run {command!r}: {exc}", file=sys.stderr)
        return 2, None
    summary = None
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stdout.write(line)
        found = _PYTEST_SUMMARY.match(line.strip())
        if found:
            summary = found.group(1).strip().rstrip(",")
    return proc.wait(), summary


def record(env: str, command: list[str], results_dir: Path) -> int:
    """Run the test command, then ``hfpatch check --json`` in a fresh process, and write the record."""
    test_code, summary = _run_streaming(command)
    check_proc = subprocess.run(
        [sys.executable, "-m", "hfpatch", "check", "--json", "--timeout", "600"], capture_output=True, text=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    try:
        report = json.loads(check_proc.stdout)
    except json.JSONDecodeError:
        print(check_proc.stdout + check_proc.stderr, file=sys.stderr)
        return _environment_error(f"`hfpatch check --json` printed no JSON (exit {check_proc.returncode}); no record written")
    print("\n" + _check_line(report))
    record_data = {
        "env": env,
        "release": report.get("transformers"),
        "signature_id": report.get("signature_id"),
        "verdict": report.get("verdict"),
        "binding_sites": report.get("binding_sites", []),
        "check_exit_code": report.get("exit_code"),
        "check_problems": report.get("problems", []),
        "pytest_outcome": "passed" if test_code == 0 else "failed",
        "pytest_exit_code": test_code,
        "pytest_summary": summary,
        "python": report.get("python"),
        "torch": report.get("torch"),
        "date": _today(),
        "entry_digest": entry_digest(report.get("signature_id")),
    }
    if not record_data["release"]:
        return _environment_error("`hfpatch check` could not tell the installed transformers version; no record written")
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{record_data['release']}.json"
    path.write_text(json.dumps(record_data, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    print(f"wrote {path}")
    if test_code != 0:
        return test_code
    return int(report.get("exit_code") or 0)


def _check_line(report: dict) -> str:
    status = "supported and verified" if report.get("exit_code") == 0 else "FAILED: " + "; ".join(report.get("problems", []))
    return (f"hfpatch check: transformers {report.get('transformers')}, {report.get('signature_id')} "
            f"({report.get('verdict')}), {len(report.get('binding_sites') or [])} binding sites: {status}")
