"""Fit ring_kernels' layout cost model (ring_kernels/layout_costs.py) on the measured layout grid and write
ring_kernels/layout_costs.json; print how the cheapest predicted layout compares with the fastest measured one at
every measured point, fitted on all points and with each point left out of its own fit.

    python scripts/fit_layout_costs.py                 # benchmarks/results/layout_grid_*.json -> the table
    python scripts/fit_layout_costs.py --check         # exit 1 when the stored table differs from a fresh fit

The grid's files come from ``benchmarks/layout_grid.sh`` (ring_bench.py rows: kind "ring", causal, fwd_bwd, status
ok; packed rows use ring_bench's document mix, rebuilt here from benchmarks/_cases.py). Every layout of every
(machine, world size) is fitted on its own points: weighted least squares on the relative error, terms whose
coefficient would be negative dropped, for the line; the floor is the level of the points of least TFLOP that best
fits them all together with the line through the rest (``fit``). A layout measured at fewer points than the line
has terms (3) is not calibrated: the table lists it under "too_few_points", and auto never predicts it.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from collections import defaultdict
from typing import Dict, List, Sequence, Tuple

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from _cases import global_document_mix, local_document_mix  # noqa: E402
from _stamp import gpu_model  # noqa: E402

from ring_kernels.layout_costs import (COSTED_KERNELS, ONE_SPLIT, TABLE_PATH, CallShape, LayoutCosts,  # noqa: E402
                                       features)

DEFAULT_RESULTS = os.path.join(ROOT, "benchmarks", "results", "layout_grid_*.json")
# GPU models that use another's calibration at the world sizes they have none of their own at, and why
# (ring_kernels.layout_costs.load).
SAME_AS = {"H200": {"machine": "H100", "why": "the same Hopper SMs and NVLink 4 (900 GB/s); only the HBM differs"}}
SIGNIFICANT = 5
MIN_POINTS = 3           # the model's terms: a layout measured at fewer points is left uncalibrated


def _point_key(row: dict) -> Tuple:
    return row["machine"], row["world"], row["tokens"], row["config"], row["shape"].packed


def read_grid(paths: Sequence[str]) -> List[dict]:
    """Every measured (machine, layout, shape, ms) of the grid files, in file order."""
    rows = []
    for path in paths:
        with open(path) as f:
            doc = json.load(f)
        machine = gpu_model(doc["stamp"]["device_name"])
        configs = {c["name"]: c for c in doc["settings"]["configs"]}
        for r in doc["results"]:
            if (r.get("kind") != "ring" or r.get("status") != "ok" or r.get("mode") != "fwd_bwd"
                    or not r.get("causal") or r.get("variant") not in COSTED_KERNELS):
                continue
            c, world, tokens = configs[r["config"]], r["world_size"], r["tokens_per_rank"]
            if r["layout"] == "varlen":
                shape = CallShape.documents(c["nheads"], c["nheads_k"], c["head_dim"],
                                            global_document_mix(local_document_mix(tokens, world), world), world)
            else:
                shape = CallShape.batch(c["nheads"], c["nheads_k"], c["head_dim"], 1, tokens * world, world)
            rows.append(dict(machine=machine, world=world, tokens=tokens, config=r["config"], layout=r["variant"],
                             shape=shape, ms=float(r["time_ms"]["median_ms"]), file=os.path.basename(path)))
    return rows


def _line(rows: Sequence[dict]) -> Tuple[float, float, float]:
    """(a, b, c) of ``rows``: least squares on the relative error, a term whose coefficient would be negative dropped
    (fewer points than terms, as in a left-out fit: F first, then c)."""
    x = torch.tensor([features(r["layout"], r["shape"]) for r in rows], dtype=torch.float64)
    y = torch.tensor([r["ms"] for r in rows], dtype=torch.float64)
    w = (1.0 / y).unsqueeze(1)
    active = {1: [0], 2: [0, 2]}.get(len(rows), [0, 1, 2])
    while True:
        solution = torch.zeros(3, dtype=torch.float64)
        if active:
            sol = torch.linalg.lstsq((x * w)[:, active], (y * w.squeeze(1)).unsqueeze(1)).solution.squeeze(1)
            solution[active] = sol
        if not active or (solution >= 0).all():
            return tuple(solution.tolist())
        active.remove(active[int(torch.argmin(solution[active]))])


def _relative_error(coefficients: Sequence[float], rows: Sequence[dict]) -> float:
    """The squared relative error of ``coefficients`` summed over ``rows`` (one machine, world size and layout)."""
    first = rows[0]
    costs = LayoutCosts(first["machine"], {first["world"]: {first["layout"]: coefficients}})
    return sum((costs.predict(r["layout"], r["shape"]) / r["ms"] - 1) ** 2 for r in rows)


def fit(rows: Sequence[dict]) -> Tuple[float, float, float, float]:
    """(a, b, c, f) of ``rows`` (one layout of one machine and world size): see the module docstring. The points in
    order of TFLOP, then GB (of equal work, the one sending less sits nearer the floor), then time; every split of
    that order that leaves the line at least ``MIN_POINTS`` points is tried: the points before it set the floor (the
    level of least relative error over them), the rest the line; the split with the least squared relative error
    over all points wins (the empty split: no floor)."""
    ordered = sorted(rows, key=lambda r: (features(r["layout"], r["shape"])[:2], r["ms"]))
    best = None
    for k in range(0, max(1, len(ordered) - MIN_POINTS + 1)):
        below = ordered[:k]
        floor = sum(1 / r["ms"] for r in below) / sum(1 / r["ms"] ** 2 for r in below) if below else 0.0
        coefficients = _line(ordered[k:]) + (floor,)
        error = _relative_error(coefficients, ordered)
        if best is None or error < best[0] - 1e-12:   # a floor only where it fits better than none
            best = (error, coefficients)
    return tuple(float(f"{v:.{SIGNIFICANT}g}") for v in best[1])


def _groups(rows: Sequence[dict]) -> Dict[Tuple, List[dict]]:
    groups: Dict[Tuple, List[dict]] = defaultdict(list)
    for r in rows:
        groups[r["machine"], r["world"], r["layout"]].append(r)
    return groups


def build_table(rows: Sequence[dict]) -> dict:
    machines: dict = {}
    for (machine, world, layout), group in sorted(_groups(rows).items()):
        if len(group) < MIN_POINTS:
            entry = machines.setdefault(machine, {"worlds": {}})
            entry.setdefault("too_few_points", {}).setdefault(str(world), {})[layout] = len(group)
            continue
        a_b_c_f = fit(group)
        costs = LayoutCosts(machine, {world: {layout: a_b_c_f}})
        worst = max(abs(costs.predict(layout, r["shape"]) / r["ms"] - 1) for r in group)
        entry = machines.setdefault(machine, {"worlds": {}})
        entry["worlds"].setdefault(str(world), {})[layout] = {
            "coefficients": list(a_b_c_f[:3]), "floor_ms": a_b_c_f[3], "points": len(group),
            "worst_relative_error": round(worst, 4)}
    for machine, entry in machines.items():
        entry["source"] = sorted({r["file"] for r in rows if r["machine"] == machine})
    return {"schema": 2,
            "model": "t_ms = max(floor_ms, a * tflop_per_rank + b * gb_sent_per_rank + c) "
                     "(ring_kernels/layout_costs.py)",
            "generated_by": "scripts/fit_layout_costs.py", "machines": machines, "same_as": SAME_AS}


def measured_points(rows: Sequence[dict]) -> Dict[Tuple, Dict[str, Tuple[float, CallShape]]]:
    """(machine, world, tokens, config, packed) -> layout -> (ms, shape) of every measured point; a layout measured
    more than once at a point (repeated runs) counts with its mean time there."""
    runs: Dict[Tuple, Dict[str, List[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        runs[_point_key(r)][r["layout"]].append(r)
    return {point: {layout: (sum(r["ms"] for r in found) / len(found), found[0]["shape"])
                    for layout, found in by_layout.items()}
            for point, by_layout in runs.items()}


def regrets(rows: Sequence[dict], leave_out: bool) -> List[Tuple]:
    """(point, fastest measured, picked, regret) at every measured point (``measured_points``); ``leave_out``:
    each point's rows are left out of the fits that predict it."""
    groups = _groups(rows)
    out = []
    for point, measured in sorted(measured_points(rows).items()):
        machine, world, _, _, packed = point
        ms = {layout: found[0] for layout, found in measured.items()}
        candidates = [k for k in ONE_SPLIT[packed] if k in measured]
        predicted = {}
        for layout in candidates:
            train = [r for r in groups[machine, world, layout] if not (leave_out and _point_key(r) == point)]
            if len(groups[machine, world, layout]) >= MIN_POINTS and train:
                predicted[layout] = LayoutCosts(machine, {world: {layout: fit(train)}}).predict(
                    layout, measured[layout][1])
        if not predicted:
            continue
        best = min(candidates, key=ms.get)
        pick = min(predicted, key=predicted.get)
        out.append((point, best, ms[best], pick, ms[pick], ms[pick] / ms[best] - 1))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="*", help=f"layout grid JSON files (default {DEFAULT_RESULTS})")
    p.add_argument("--check", action="store_true", help="compare with the stored table instead of writing it")
    p.add_argument("--out", default=str(TABLE_PATH))
    args = p.parse_args(argv)
    paths = sorted(args.results or glob.glob(DEFAULT_RESULTS))
    if not paths:
        print(f"fit_layout_costs: no layout grid files ({DEFAULT_RESULTS})", file=sys.stderr)
        return 2
    rows = read_grid(paths)
    table = build_table(rows)
    text = json.dumps(table, indent=1, sort_keys=True) + "\n"
    if args.check:
        with open(args.out) as f:
            if f.read() != text:
                print(f"fit_layout_costs: {args.out} is stale: run python scripts/fit_layout_costs.py",
                      file=sys.stderr)
                return 1
        print(f"fit_layout_costs: {args.out} is current ({len(rows)} measured rows)")
        return 0
    with open(args.out, "w") as f:
        f.write(text)
    print(f"wrote {os.path.relpath(args.out, ROOT)}: {len(rows)} measured rows from {len(paths)} files")
    for leave_out in (False, True):
        found = regrets(rows, leave_out)
        within = sum(1 for *_, regret in found if regret <= 0.03)
        print(f"\n{'each point left out of its fit' if leave_out else 'fitted on every point'}: the pick within 3% "
              f"of the fastest at {within} of {len(found)} points; worst {max(r for *_, r in found):.1%}")
        for (machine, world, tokens, config, packed), best, best_ms, pick, pick_ms, regret in found:
            print(f"  {machine} x{world} {tokens // 1024:>4}k {config:<9} {'packed' if packed else 'batch ':<6} "
                  f"fastest {best:<14} {best_ms:9.1f} ms  pick {pick:<14} {pick_ms:9.1f} ms  +{regret:.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
