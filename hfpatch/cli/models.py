"""``hfpatch models``: the model sweep of the installed transformers (``hfpatch.release.sweep``) -- every causal-LM
class with a flash path, built tiny and trained one step under CP against non-CP on CPU processes, then the
head-parallel columns (Ulysses, USP) on their subsets -- printed as verdicts, written to MODELS.md (``--write``), or
checked against it (``--check``); ``--list`` prints the classes.

Exit status: 0 when no class ended silent or unnamed (and, with ``--check``, the table is current); 1 otherwise;
2 for a usage error, found before the sweep spawns its processes (an unknown ``--classes`` name among them).
Importing this module imports neither torch nor transformers.
"""
from __future__ import annotations

import argparse
import difflib
import json
import time
from pathlib import Path

from hfpatch.cli.arguments import HelpFormatter, UsageError, cpu_kernel, require_cp_world

__all__ = ["build_parser", "run"]

_DEFAULT_TABLE = "MODELS.md"

_DESCRIPTION = """\
The model sweep: every causal-LM class of the installed transformers that has a flash-attention path is built
tiny (random weights, no download) and trained one step on CPU processes with context parallelism and without.
Each class gets a verdict: exact, refused (hfpatch names what it cannot make exact), not built, or a defect
(silent: CP differs; unnamed: an unexpected error). The whole sweep (kernel auto) is followed by the head-parallel
columns: kernel ulysses on 2 processes and usp:2x2 on 4, each on a representative subset of the classes. The whole
sweep takes minutes; --classes picks a few (under --kernel, without the columns).

examples:
  hfpatch models --list                          the classes the sweep covers
  hfpatch models --classes LlamaForCausalLM      one class
  hfpatch models --classes GptOssForCausalLM --kernel usp:2x2 --world-size 4
  hfpatch models --check                         is MODELS.md current?

exit status: 0 no defect (and, with --check, the table is current); 1 otherwise; 2 usage error."""


def build_parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=_DESCRIPTION, formatter_class=HelpFormatter)
    p.add_argument("--list", action="store_true", help="print the classes the sweep covers, and exit")
    p.add_argument("--world-size", type=int, default=2, metavar="N",
                   help="CPU processes in the context-parallel group (default 2)")
    p.add_argument("--classes", default=None, metavar="NAME[,NAME...]",
                   help="comma-separated class names (default: every class; --list shows them)")
    p.add_argument("--kernel", default="auto",
                   help="kernel of the verdicts: auto (default), a ring variant (zigzag, ring, stripe, llama3), "
                        "ulysses or usp:UxR (U x R = --world-size), optionally with :backend; --write and --check "
                        "take auto (MODELS.md's head-parallel columns run their own kernels)")
    p.add_argument("--write", nargs="?", const=_DEFAULT_TABLE, default=None, metavar="PATH",
                   help=f"write the table (default path {_DEFAULT_TABLE})")
    p.add_argument("--check", nargs="?", const=_DEFAULT_TABLE, default=None, metavar="PATH",
                   help=f"exit 1 if the table at PATH (default {_DEFAULT_TABLE}) differs from this sweep")
    p.add_argument("--no-heads", action="store_true",
                   help="leave out the heads table (sequence and token classification, QA, vision-language models on "
                        "text, PEFT, the MoE load-balancing loss): its sweep is not run and --check does not compare "
                        "it")
    p.add_argument("--json", action="store_true", help="print the verdicts as JSON")
    p.set_defaults(func=run)
    return p


def _check_options(args: argparse.Namespace) -> None:
    """The checks that need no catalog; ``UsageError`` with the fix."""
    require_cp_world(args.world_size)
    cpu_kernel(args.kernel, args.world_size)
    if args.kernel != "auto" and (args.write or args.check):
        raise UsageError(f"--kernel {args.kernel} with --write or --check: MODELS.md's verdict column is the sweep "
                         "under kernel auto, and its head-parallel columns run their own kernels (ulysses on 2 "
                         "processes, usp:2x2 on 4). Fix: drop --kernel.")
    if args.classes is not None and (args.write or args.check):
        raise UsageError("--write and --check compare the whole sweep, not a few classes. Fix: drop --classes.")
    if args.check and not Path(args.check).is_file():
        raise UsageError(f"--check {args.check}: no such file. Fix: give the table's path, or write it first "
                         f"with --write {args.check}.")
    if args.write and not Path(args.write).resolve().parent.is_dir():
        raise UsageError(f"--write {args.write}: its folder does not exist. Fix: create it, or write elsewhere.")


def requested_classes(text: str, catalog: list) -> list[str]:
    """The class names of ``--classes``, each one in ``catalog`` (``CatalogEntry`` list); ``UsageError`` naming
    the first that is not, with the nearest names and how to list them all."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise UsageError(f"--classes {text!r} names no class. Fix: --classes LlamaForCausalLM, or drop --classes.")
    known = sorted({entry.class_name for entry in catalog})
    for name in names:
        if name not in known:
            near = difflib.get_close_matches(name, known, n=3)
            hint = f" (did you mean {', '.join(near)}?)" if near else ""
            raise UsageError(
                f"--classes: {name!r} is not a class with a flash-attention path of the sweep's catalog (causal LMs, "
                f"sequence and token classifiers, QA heads, vision-language models) in the installed "
                f"transformers{hint}. Fix: 'hfpatch models --list' prints the class names."
            )
    return names


def _print_catalog(catalog: list) -> int:
    for entry in catalog:
        note = f"   (import failed: {entry.import_error})" if entry.import_error else ""
        head = "" if entry.head == "causal-lm" else f"   [{entry.head}]"
        print(f"{entry.model_type:28s} {entry.class_name}{head}{note}")
    print(f"{len(catalog)} classes")
    return 0


def run(args: argparse.Namespace) -> int:
    _check_options(args)
    from hfpatch.release.sweep import flash_causal_lm_classes, flash_head_classes  # deferred (torch): for --help
    from hfpatch.release.sweep.run import run_columns, run_sweep  # deferred (torch): as above

    causal = flash_causal_lm_classes()
    heads_catalog = [] if args.no_heads else flash_head_classes()
    if args.list:
        return _print_catalog(causal + heads_catalog)
    classes = requested_classes(args.classes, causal + heads_catalog) if args.classes is not None else None
    start = time.time()
    progress = None if args.json else (lambda v: print(
        f"{v.verdict:9s}  {v.model_type:28s} {v.class_name:44s} {'' if v.kernel == 'auto' else f'({v.kernel}) '}"
        f"{'' if v.head == 'causal-lm' else f'[{v.head}] '}{v.detail.splitlines()[0] if v.detail else ''}",
        flush=True))
    wanted = lambda catalog: classes is None or any(e.class_name in classes for e in catalog)  # noqa: E731
    verdicts = run_sweep(world_size=args.world_size, classes=classes, kernel=args.kernel,
                         progress=progress) if wanted(causal) else []
    whole = classes is None and args.kernel == "auto"
    columns = run_columns(progress=progress) if whole else []
    heads = run_sweep(world_size=args.world_size, classes=classes, kernel=args.kernel, progress=progress,
                      heads=True) if heads_catalog and wanted(heads_catalog) else None
    return _report(args, verdicts, columns, time.time() - start, heads)


def _report(args: argparse.Namespace, verdicts: list, columns: list, seconds: float, heads=None) -> int:
    import torch
    import transformers

    from hfpatch.release.sweep import table  # deferred (torch): `--help` must not load it

    every = verdicts + columns + (heads or [])
    defects = [v for v in every if v.verdict in ("silent", "unnamed")]
    if args.json:
        print(json.dumps([v.to_json() for v in every], indent=1))
    else:
        print(f"{table.counts_line(verdicts)} in {seconds:.0f} s (transformers {transformers.__version__})")
        for kernel in dict.fromkeys(v.kernel for v in columns):
            print(f"  under {kernel}: {table.counts_line(v for v in columns if v.kernel == kernel)}")
        if heads is not None:
            print(f"  heads: {table.counts_line(heads)}")
        for v in defects:
            print(f"DEFECT {v.verdict}: {v.class_name} (kernel {v.kernel}): {v.detail}")
    status = 1 if defects else 0
    if args.write and heads is None:
        print("--write with --no-heads would drop MODELS.md's heads table. Fix: drop --no-heads.")
        return 2
    text = table.render(verdicts, transformers_version=transformers.__version__,
                        torch_version=torch.__version__.split("+")[0], world_size=args.world_size, columns=columns,
                        heads=heads or ())
    if args.write:
        Path(args.write).write_text(text)
        print(f"wrote {args.write}")
    if args.check:
        path = Path(args.check)
        differences = table.stale(verdicts, path.read_text(), columns, heads)
        for line in differences:
            print(f"STALE: {line}")
        if differences:
            print(f"{path} is not current: run `hfpatch models --write {path}`")
            status = 1
    return status
