"""``hfpatch check``: can hfpatch patch this transformers release? A yes/no for CI, with the facts.

``run_check`` returns the facts as a dict (what ``--json`` prints); ``report["exit_code"]`` is the command's exit
status: 0 supported and verified, 1 unsupported or verification failed, 2 usage or environment error.

Installed release (no ``--transformers``): the registry verdict for the live ``_flash_attention_forward``
signature, then a dry run in a throwaway gloo world of ``world_size`` spawned CPU processes:
``hfpatch.apply(group, verify=True)`` (install at every binding site, identity check, numeric probe), the sites it
patched, and ``Patch.remove()`` followed by an identity check that every module holds the original function again.
Usage errors (``--world-size``, ``--kernel``) are found before any process is spawned and reported like every
other problem, so that ``--json`` always prints one JSON object.

A release that is not installed (``--transformers X.Y.Z``): the static verdict of
``hfpatch.cli.static_check.static_check``, which reads the release's wheel without installing or importing it.
Its binding sites have the installed check's form, ``module.attribute``.
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import sys
import time
import traceback
from typing import Any

import hfpatch
from hfpatch import __version__
from hfpatch.cli.arguments import HelpFormatter, UsageError, cpu_kernel, positive_seconds, require_cp_world
from hfpatch.cli.static_check import static_check
from hfpatch.errors import HfpatchError, InvalidReleaseSpec, ScanError, WheelFetchError
from hfpatch.signatures import registry
from hfpatch import version_gates
from hfpatch.version_gates import (TRANSFORMERS_ATTENTION_FUNCTIONS, TRANSFORMERS_MIN_SUPPORTED, is_supported_release,
                                   parse_version)

__all__ = ["build_parser", "run_check", "check_installed", "check_release", "format_report", "EXIT_OK",
           "EXIT_FAILED", "EXIT_USAGE", "WorldError", "spawn_world", "holders", "import_integration",
           "apply_verify_remove"]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2

_DRY_RUN_TIMEOUT_S = 300.0  # spawning 2 processes that import torch + transformers: ~10-20 s on an idle 2-core box
_DEFAULT_WORLD_SIZE = 2
_DEFAULT_KERNEL = "auto"
_MFAU = "transformers.modeling_flash_attention_utils"
_TARGET = "_flash_attention_forward"
_INTEGRATION = "transformers.integrations.flash_attention"

_DESCRIPTION = """\
Can hfpatch patch this transformers release? A yes/no for CI, with the facts.

Without --transformers: the installed release. Its version and flash-attention signature are matched against
hfpatch's registry of known signatures, then a dry run on N CPU processes (--world-size) applies the patch,
verifies it numerically and removes it, checking that transformers is exactly as it was.

With --transformers X.Y.Z: a release that is not installed. Its wheel is fetched with pip into a cache
($HFPATCH_WHEEL_CACHE, default ~/.cache/hfpatch/wheels) and read, never installed or imported; no dry run.

examples:
  hfpatch check                          the installed release
  hfpatch check --json                   the same facts as JSON, for CI
  hfpatch check --transformers 4.47.1    a release that is not installed

exit status: 0 supported and verified; 1 unsupported, or the dry run failed; 2 usage or environment error (bad
version, transformers not installed, no network to fetch a wheel, processes that cannot start)."""


# ------------------------------------------------------------------------------------------------ parser


def build_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=_DESCRIPTION, formatter_class=HelpFormatter)
    parser.add_argument("--json", action="store_true", help="print the facts as one JSON object")
    parser.add_argument(
        "--world-size", type=int, default=None, metavar="N",
        help=f"CPU processes in the dry run (default {_DEFAULT_WORLD_SIZE}; at least 2)",
    )
    parser.add_argument(
        "--kernel", default=None, metavar="KERNEL",
        help="kernel for the dry run: auto (default), a ring variant (zigzag, ring, stripe, llama3), ulysses "
             "or usp:UxR, optionally with :backend (e.g. zigzag:reference)",
    )
    parser.add_argument(
        "--timeout", type=positive_seconds, default=None, metavar="S",
        help=f"seconds the dry run may take before it counts as hung (default {_DRY_RUN_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--transformers", metavar="X.Y.Z", default=None,
        help="the static verdict for this release instead of the installed one (reads its wheel; no install)",
    )
    parser.set_defaults(func=_main)
    return parser


def _main(args: argparse.Namespace) -> int:
    dry_run_options = [f"--{name.replace('_', '-')}" for name in ("world_size", "kernel", "timeout")
                       if getattr(args, name) is not None]
    if args.transformers is not None and dry_run_options:
        given = ", ".join(dry_run_options)
        raise UsageError(
            f"{given}: only the installed release's dry run uses {'it' if len(dry_run_options) == 1 else 'them'}, "
            f"and --transformers gives a static verdict without one. Fix: drop {given}, or drop --transformers."
        )
    options = dict(
        transformers=args.transformers,
        world_size=_DEFAULT_WORLD_SIZE if args.world_size is None else args.world_size,
        kernel=_DEFAULT_KERNEL if args.kernel is None else args.kernel,
        timeout=_DRY_RUN_TIMEOUT_S if args.timeout is None else args.timeout,
    )
    report = _json_check(options) if args.json else run_check(**options)
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True, default=str))
    else:
        print(format_report(report))
    return report["exit_code"]


def _json_check(options: dict) -> dict:
    """``run_check(**options)`` with everything it and its ranks write to stdout (gloo's "[Gloo] Rank 0 is
    connected ..." lines of torch 2.8 to 2.10, a model's prints) sent to stderr: ``--json``'s stdout is the JSON
    alone."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        return run_check(**options)
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def run_check(*, transformers: str | None = None, world_size: int = _DEFAULT_WORLD_SIZE,
              kernel: str = _DEFAULT_KERNEL, timeout: float = _DRY_RUN_TIMEOUT_S) -> dict:
    """The check as a dict (what ``--json`` prints); ``report["exit_code"]`` is the command's exit code."""
    started = time.perf_counter()
    if transformers is not None:
        report = check_release(transformers)
    else:
        report = check_installed(world_size=world_size, kernel=kernel, timeout=timeout)
    report["seconds"] = round(time.perf_counter() - started, 2)
    return report


# -------------------------------------------------------------------------------------------- installed


def _base_report(mode: str) -> dict:
    return {
        "mode": mode,
        "hfpatch": __version__,
        "python": platform.python_version(),
        "transformers": None,
        "verdict": None,
        "signature_id": None,
        "supported": False,
        "binding_sites": [],
        "problems": [],
        "exit_code": EXIT_USAGE,
    }


def _fail(report: dict, code: int, problem: str) -> dict:
    report["problems"].append(problem)
    report["exit_code"] = code
    return report


def check_installed(*, world_size: int = _DEFAULT_WORLD_SIZE, kernel: str = _DEFAULT_KERNEL,
                    timeout: float = _DRY_RUN_TIMEOUT_S) -> dict:
    """Registry verdict for the installed release, then a dry-run apply + verify + remove on ``world_size``
    spawned gloo processes. The versions are reported even when the arguments are refused."""
    report = _base_report("installed")
    version = version_gates.installed_transformers_version()
    if version is None:
        return _fail(report, EXIT_USAGE, (
            "transformers is not installed in this environment. Fix: pip install transformers, or give a "
            "release with --transformers X.Y.Z for the static verdict."
        ))
    report["transformers"] = str(version)
    try:
        import torch

        report["torch"] = torch.__version__
    except ImportError as exc:
        return _fail(report, EXIT_USAGE, f"torch cannot be imported ({exc}). Fix: pip install torch.")
    if not _torch_verdict(report):
        return report
    try:
        require_cp_world(world_size)
        cpu_kernel(kernel, world_size)
    except UsageError as exc:
        return _fail(report, EXIT_USAGE, str(exc))
    if not is_supported_release(version):
        report["verdict"] = "unsupported-release"
        return _fail(report, EXIT_FAILED, (
            f"transformers {version} is not supported: before {TRANSFORMERS_MIN_SUPPORTED} every model class has "
            f"its own _flash_attention_forward method, there is no module-level function to patch. "
            f"Fix: upgrade to transformers>={TRANSFORMERS_MIN_SUPPORTED}."
        ))
    if not _registry_verdict(report, version):
        return report
    _dry_run(report, world_size=world_size, kernel=kernel, timeout=timeout)
    return report


def _torch_verdict(report: dict) -> bool:
    """Fill torch_verdict / torch_range: ring_kernels refuses to import on a torch outside its tested range
    (``ring_kernels.torch_releases``); False (report finished) if it does."""
    try:
        import ring_kernels  # deferred (torch): outside its range it raises UnsupportedTorch, reported
    except ImportError as exc:
        releases = sys.modules.get("ring_kernels.torch_releases")
        if releases is None or not isinstance(exc, releases.UnsupportedTorch):
            raise
        report["torch_verdict"] = "unsupported-torch"
        report["torch_range"] = releases.supported_range()
        _fail(report, EXIT_FAILED, str(exc))
        return False
    report["torch_verdict"] = "supported"
    report["torch_range"] = ring_kernels.torch_releases.supported_range()
    return True


def _registry_verdict(report: dict, version) -> bool:
    """Fill verdict / signature_id / diff from the live signature; False (report finished) if unsupported."""
    import importlib

    try:
        mfau = importlib.import_module(_MFAU)
        live = getattr(mfau, _TARGET)
    except Exception as exc:  # an installed release that cannot even be imported: environment problem
        _fail(report, EXIT_USAGE, f"cannot import {_MFAU}.{_TARGET} from transformers {version}: "
                                  f"{type(exc).__name__}: {exc}")
        return False
    result = registry.match(inspect.signature(live), str(version))
    report["verdict"] = result.verdict
    report["signature_id"] = result.id
    report["registry_entry"] = result.entry.id
    if result.verdict == "compatible":
        report["added_parameters"] = list(result.added)
    if not result.supported:
        report["diff"] = result.diff
        _fail(report, EXIT_FAILED, (
            f"transformers {version}: {_MFAU}.{_TARGET} matches no registry entry (nearest {result.entry.id}); "
            "see 'diff'. Fix: pin a supported release (hfpatch check --transformers X.Y.Z tells), or run "
            "`hfpatch signatures scan --version "
            f"{version}` and open an issue with its output."
        ))
        return False
    return True


def _dry_run(report: dict, *, world_size: int, kernel: str, timeout: float) -> None:
    """Spawn the world, collect every rank's facts, and decide the exit code."""
    started = time.perf_counter()
    try:
        ranks = spawn_world(world_size, kernel, timeout)
    except WorldError as exc:
        report["dry_run"] = {"world_size": world_size, "kernel": kernel, "ok": False, "error": str(exc)}
        _fail(report, EXIT_USAGE, f"the dry-run world could not run: {exc}")
        return
    dry = {
        "world_size": world_size,
        "kernel": kernel,
        "seconds": round(time.perf_counter() - started, 2),
        "ranks": ranks,
    }
    report["dry_run"] = dry
    rank0 = ranks[0]
    report["binding_sites"] = rank0.get("sites", [])
    failures = [r for r in ranks if not r.get("ok")]
    dry["ok"] = not failures
    if not failures:
        report["supported"] = True
        report["exit_code"] = EXIT_OK
        return
    worst = EXIT_USAGE if any(r.get("error_kind") == "environment" for r in failures) else EXIT_FAILED
    for r in failures:
        _fail(report, worst, f"rank {r['rank']}: {r.get('error') or 'dry run failed'}")


class WorldError(RuntimeError):
    """The throwaway world could not run (spawn failure, timeout, a crashed process)."""


def spawn_world(world_size: int, kernel: str, timeout: float = _DRY_RUN_TIMEOUT_S) -> list[dict]:
    """Run ``_dry_run_rank`` on ``world_size`` spawned processes; return their fact dicts, by rank."""
    from ring_kernels.world import DistributedFailure, run_world  # deferred (torch): `--help` must not load it

    try:
        return run_world(world_size, _dry_run_rank, kernel, timeout=timeout)
    except DistributedFailure as exc:
        raise WorldError(f"{exc} (a loaded machine: --timeout S allows more)" if exc.hung else str(exc)) from exc


def holders(obj: Any) -> list[str]:
    """``module.attribute`` for every loaded module attribute that IS ``obj`` (identity, not equality)."""
    found = []
    for name, module in list(sys.modules.items()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for attr, value in list(namespace.items()):
            if value is obj:
                found.append(f"{name}.{attr}")
    return sorted(found)


def _dry_run_rank(rank: int, world_size: int, kernel: str) -> dict:
    """One process of the dry run, in the gloo world: apply + verify + remove; the facts it found."""
    import torch.distributed as dist

    facts: dict[str, Any] = {"rank": rank, "ok": False}
    try:
        apply_verify_remove(facts, dist.group.WORLD, kernel)
    except BaseException as exc:  # reported to the parent, never hidden: the traceback travels with it
        facts["error"] = f"{type(exc).__name__}: {exc}"
        facts["error_type"] = type(exc).__name__
        facts["error_kind"] = "environment" if isinstance(exc, ImportError) else (
            "hfpatch" if isinstance(exc, HfpatchError) else "internal"
        )
        if facts["error_kind"] != "hfpatch":
            facts["traceback"] = traceback.format_exc()
    return facts


def import_integration(facts: dict) -> None:
    """Import transformers' flash-attention integration (4.48+), the binding site every model reaches through
    ALL_ATTENTION_FUNCTIONS, so that the dry run patches and reports it as a real training process would."""
    import importlib
    import importlib.util

    version = version_gates.installed_transformers_version()
    if version is None or version < TRANSFORMERS_ATTENTION_FUNCTIONS:
        return  # 4.43-4.47: no integration module; model modules bind the function only with flash-attn installed
    try:
        importlib.import_module(_INTEGRATION)
    except Exception as exc:  # reported, not fatal: apply's import hook still covers a later import
        facts.setdefault("notes", []).append(f"could not import {_INTEGRATION}: {type(exc).__name__}: {exc}")


def apply_verify_remove(facts: dict, group, kernel: str) -> None:
    """Apply with verification, then remove, in ``group``; record in ``facts`` the sites patched, whether every
    holder of the original function was patched while applied, and whether remove() restored each of them."""
    import importlib

    mfau = importlib.import_module(_MFAU)
    original = getattr(mfau, _TARGET)
    import_integration(facts)
    before = holders(original)
    patch = hfpatch.apply(group, kernel=kernel, verify=True)
    facts["active"] = bool(patch.active)
    facts["signature_id"] = getattr(patch, "signature_id", None)
    facts["sites"] = sorted(str(site) for site in getattr(patch, "sites", ()))
    if not patch.active:
        facts["error"] = f"apply returned an inactive patch: {getattr(patch, 'reason', '(no reason given)')}"
        facts["error_kind"] = "hfpatch"
        return
    still_original = holders(original)
    facts["verified"] = True
    patch.remove()
    after = holders(original)
    missing = sorted(set(before) - set(after))
    facts["removed"] = not missing and getattr(mfau, _TARGET) is original
    if still_original:
        # A site that still held the original function while the patch was active was missed by apply.
        facts["error"] = f"while applied, these still held the original function: {still_original}"
        facts["error_kind"] = "hfpatch"
        return
    if not facts["removed"]:
        facts["error"] = f"remove() did not restore the original function at: {missing or [_MFAU]}"
        facts["error_kind"] = "hfpatch"
        return
    facts["ok"] = True


# ---------------------------------------------------------------------------------------------- static


def check_release(version_text: str) -> dict:
    """The static verdict for a release that need not be installed (its wheel is read, never imported)."""
    report = _base_report("static")
    try:
        version = parse_version(version_text, argument="--transformers")
    except InvalidReleaseSpec as exc:
        return _fail(report, EXIT_USAGE, str(exc))
    report["transformers"] = str(version)

    try:
        facts = static_check(str(version))
    except (WheelFetchError, ScanError, InvalidReleaseSpec) as exc:
        return _fail(report, EXIT_USAGE, f"{type(exc).__name__}: {exc}")
    report["static"] = facts
    report["verdict"] = facts.get("verdict")
    report["signature_id"] = facts.get("signature_id")
    report["binding_sites"] = list(facts.get("binding_sites") or [])
    report["supported"] = bool(facts.get("supported"))
    if report["supported"]:
        report["exit_code"] = EXIT_OK
    else:
        if facts.get("diff"):
            report["diff"] = facts["diff"]
        _fail(report, EXIT_FAILED, facts.get("message") or f"transformers {version}: verdict {report['verdict']}")
    return report


# ------------------------------------------------------------------------------------------------ text


# What the listed sites are, by mode: both list module.attribute names that hold the function.
_SITES_MEANING = {
    "installed": "(patched in the dry run; a module imported later is patched on import)",
    "static": "(in the wheel: the definition and every module that imports it by name)",
}


def format_report(report: dict) -> str:
    """The human-readable form of ``report``."""
    status = {EXIT_OK: "OK", EXIT_FAILED: "NOT SUPPORTED / FAILED", EXIT_USAGE: "ERROR"}[report["exit_code"]]
    lines = [f"hfpatch check ({report['mode']}): {status}"]
    lines.append(f"  transformers   {report.get('transformers') or '(unknown)'}")
    if report.get("torch"):
        verdict = f" ({report['torch_verdict']}: {report['torch_range']})" if report.get("torch_verdict") else ""
        lines.append(f"  torch          {report['torch']}{verdict}")
    if report.get("verdict"):
        lines.append(f"  signature      {report.get('signature_id')} ({report['verdict']})")
    if report.get("added_parameters"):
        lines.append(f"  added params   {', '.join(report['added_parameters'])} (refused if ever given a value)")
    sites = report.get("binding_sites") or []
    if report.get("verdict") and (sites or report["mode"] == "static" or report.get("dry_run")):
        lines.append(f"  binding sites  {len(sites)} {_SITES_MEANING[report['mode']]}")
        lines.extend(f"    {site}" for site in sites)
    dry = report.get("dry_run")
    if dry:
        state = "apply + verify + remove OK" if dry.get("ok") else "FAILED"
        took = f" in {dry['seconds']}s" if "seconds" in dry else ""
        lines.append(f"  dry run        {dry['world_size']} gloo processes, kernel={dry['kernel']}: {state}{took}")
    if report.get("diff"):
        lines.append("  diff:")
        lines.extend(f"    {line}" for line in str(report["diff"]).splitlines())
    for problem in report["problems"]:
        lines.append(f"  problem: {problem}")
    return "\n".join(lines)
