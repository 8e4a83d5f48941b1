"""``hfpatch models``: the model sweep of the installed transformers -- every causal-LM class with a flash path,
built tiny and trained one step under CP against non-CP on CPU processes -- printed as verdicts (exact /
refused / not built), written to MODELS.md (``--write``), or checked against it (``--check``).

Exit status: 0 when no class ended silent or unnamed (and, with ``--check``, MODELS.md is current); 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from hfpatch.release.sweep import table
from hfpatch.release.sweep.run import run_sweep

__all__ = ["add_parser", "run"]

_DEFAULT_TABLE = "MODELS.md"


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "models", help="the model sweep: which causal-LM classes train exactly under CP (MODELS.md)",
        description=__doc__,
    )
    p.add_argument("--world-size", type=int, default=2, help="CPU processes (gloo ranks) of the CP group")
    p.add_argument("--classes", default=None, help="comma-separated class names (default: every catalog class)")
    p.add_argument("--kernel", default="auto", help="ring variant[:backend], as hfpatch.apply(kernel=...)")
    p.add_argument("--write", nargs="?", const=_DEFAULT_TABLE, default=None, metavar="PATH",
                   help=f"write the table (default path {_DEFAULT_TABLE})")
    p.add_argument("--check", nargs="?", const=_DEFAULT_TABLE, default=None, metavar="PATH",
                   help="exit 1 if the table at PATH differs from this sweep")
    p.add_argument("--json", action="store_true", help="print the verdicts as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    import torch
    import transformers

    if args.world_size < 2:
        print("hfpatch models: --world-size must be at least 2 (a CP group of one is not CP)", file=sys.stderr)
        return 2
    if args.classes is not None and (args.write or args.check):
        print("hfpatch models: --write/--check need the whole sweep; drop --classes", file=sys.stderr)
        return 2
    classes = [c.strip() for c in args.classes.split(",")] if args.classes else None
    start = time.time()
    progress = None if args.json else (lambda v: print(f"{v.verdict:9s}  {v.model_type:28s} {v.class_name:44s} "
                                                       f"{v.detail.splitlines()[0] if v.detail else ''}", flush=True))
    verdicts = run_sweep(world_size=args.world_size, classes=classes, kernel=args.kernel, progress=progress)
    defects = [v for v in verdicts if v.verdict in ("silent", "unnamed")]
    if args.json:
        print(json.dumps([v.to_json() for v in verdicts], indent=1))
    else:
        print(f"{table.counts_line(verdicts)} in {time.time() - start:.0f} s (transformers {transformers.__version__})")
        for v in defects:
            print(f"DEFECT {v.verdict}: {v.class_name}: {v.detail}")
    status = 1 if defects else 0
    text = table.render(verdicts, transformers_version=transformers.__version__,
                        torch_version=torch.__version__.split("+")[0], world_size=args.world_size)
    if args.write:
        Path(args.write).write_text(text)
        print(f"wrote {args.write}")
    if args.check:
        path = Path(args.check)
        differences = table.stale(verdicts, path.read_text()) if path.exists() else [f"{path} does not exist"]
        for line in differences:
            print(f"STALE: {line}")
        if differences:
            print(f"{path} is not current: run `hfpatch models --write {path}`")
            status = 1
    return status
