"""ring_kernels.layout_costs: the stored table is what scripts/fit_layout_costs.py fits on the committed layout grid,
its pick is within 3% of the fastest measured layout at every measured point but the ones ``KNOWN_MISSES`` names
(the grid's real shapes: 32 query heads, 8 or 32 K/V heads, head dim 128, 8k-128k tokens per GPU, 2 and 4 H100s
and 2 H200s, batch and packed), the fit finds a floor where the points sit on one, and its choices say whose
calibration predicted, what was left out and why."""
from __future__ import annotations

import importlib.util

import pytest

from _paths import ROOT
from ring_kernels import layout_costs
from ring_kernels.layout_costs import CallShape, LayoutCosts, features, load, machine_of, squarest_usp_grid


def _fit_script():
    spec = importlib.util.spec_from_file_location("fit_layout_costs", ROOT / "scripts" / "fit_layout_costs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_stored_table_is_the_fit_of_the_committed_grid():
    assert _fit_script().main(["--check"]) == 0


# Points where the fitted table's pick is measured more than 3% slower than the fastest layout: the target
# is not met there. Packed GQA on 2 H200s at 8k: llama3 8.4 ms and ring_varlen 8.8 ms, the means of four runs whose
# spread is far wider than the gap (llama3 6.7-10.0 ms, ring_varlen 7.6-10.6 ms): both sit on the same host-bound
# floor (8.2 ms in the fit), and which is faster there is run-to-run noise, not a layout's property.
# The test fails when the listed point meets the target (remove it) or another point misses it.
KNOWN_MISSES = {("H200", 2, 8192, "llama3-8b", True): ("llama3", "ring_varlen")}


def test_pick_is_within_3_percent_of_the_fastest_at_every_measured_point():
    script = _fit_script()
    rows = script.read_grid(sorted(str(p) for p in (ROOT / "benchmarks" / "results").glob("layout_grid_*.json")))
    points = script.measured_points(rows)                 # repeated runs of a point: the mean
    assert len(points) >= 30
    checked, misses = 0, {}
    for point, measured in points.items():
        packed = point[-1]
        candidates = [k for k in layout_costs.ONE_SPLIT[packed] if k in measured]
        if len(candidates) < 2:
            continue
        ms = {k: measured[k][0] for k in candidates}
        choice = load(point[0]).choose(measured[candidates[0]][1], {k: None for k in candidates})
        fastest = min(candidates, key=ms.get)
        if ms[choice.layout] / ms[fastest] - 1 > 0.03:
            misses[point] = (fastest, choice.layout)
        checked += 1
    assert checked >= 30
    assert misses == KNOWN_MISSES


def test_choice_names_what_it_left_out_and_why():
    costs = load("H100")
    shape = CallShape.batch(32, 8, 128, 1, 4 * 8192, 4)
    choice = costs.choose(shape, {"zigzag": None, "ulysses": "30 query heads do not divide by 4", "usp": None})
    assert choice.layout in ("zigzag", "usp")
    assert ("ulysses", "30 query heads do not divide by 4") in choice.excluded
    assert [name for name, _ in choice.predicted_ms] == sorted(
        ("zigzag", "usp"), key=lambda k: costs.predict(k, shape))
    assert choice.reason.startswith(choice.layout) and "H100, 4 GPUs" in choice.reason


def test_an_uncalibrated_world_uses_the_nearest_calibrated_one_and_says_so():
    choice = load("H100").choose(CallShape.batch(32, 8, 128, 1, 8 * 32768, 8), {"zigzag": None, "ulysses": None})
    assert choice.calibrated_world == 4 and "nearest calibrated world to 8" in choice.reason


def test_nothing_feasible_and_calibrated_gives_no_layout_with_the_reason():
    costs = LayoutCosts("H100", {2: {"zigzag": (1.0, 1.0, 1.0)}})
    choice = costs.choose(CallShape.batch(32, 8, 128, 1, 4096, 2), {"zigzag": "refused", "ulysses": None})
    assert choice.layout is None
    assert dict(choice.excluded) == {"zigzag": "refused", "ulysses": "not calibrated on H100 at 2 GPUs"}


def test_machine_of_device_names():
    assert machine_of("NVIDIA H100 80GB HBM3") == ("H100", "")
    assert machine_of("NVIDIA H200") == ("H200", "")
    assert machine_of("NVIDIA A100-SXM4-80GB") is None
    assert machine_of("cpu") is None


def test_a_world_the_machine_lacks_borrows_the_same_as_machines_and_says_so():
    h200, h100 = load("H200"), load("H100")
    assert 2 in h200.coefficients and 2 not in h200.borrowed          # measured on 2 H200s
    assert h200.borrowed[4][0] == "H100" and h200.coefficients[4] == h100.coefficients[4]
    shape = CallShape.documents(32, 8, 128, [4096] * 16, 4)
    choice = h200.choose(shape, {"llama3": None, "ring_varlen": None})
    assert choice.machine == "H100" and choice.calibrated_world == 4
    assert "H100 (for H200, not calibrated at 4 GPUs:" in choice.reason
    own = h200.choose(CallShape.documents(32, 8, 128, [4096] * 8, 2), {"llama3": None, "ring_varlen": None})
    assert own.machine == "H200" and "H200, 2 GPUs" in own.reason


def test_the_prediction_is_the_line_above_the_floor():
    costs = LayoutCosts("H100", {2: {"zigzag": (2.0, 0.0, 1.0, 10.0), "ulysses": (2.0, 0.0, 1.0)}})
    small, large = (CallShape.batch(32, 8, 128, 1, s, 2) for s in (4096, 65536))
    line = lambda shape: 2.0 * features("zigzag", shape)[0] + 1.0                     # noqa: E731
    assert line(small) < 10.0 < line(large)
    assert costs.predict("zigzag", small) == 10.0 and costs.predict("zigzag", large) == pytest.approx(line(large))
    assert costs.predict("ulysses", small) == pytest.approx(line(small))               # no floor given: none
    with pytest.raises(ValueError, match=r"\(a, b, c\) or \(a, b, c, floor\)"):
        LayoutCosts("H100", {2: {"zigzag": (1.0, 2.0)}})


def test_the_fit_recovers_a_floor_and_the_line_above_it():
    script = _fit_script()
    shapes = [CallShape.batch(32, 8, 128, 1, s, 2) for s in (2048, 4096, 8192, 16384, 32768, 65536, 131072)]
    truth = (1.9, 0.0, 2.0, 30.0)                    # floor 30 ms: the four smallest calls sit on it
    costs = LayoutCosts("H100", {2: {"zigzag": truth}})
    rows = [dict(machine="H100", world=2, layout="zigzag", shape=shape, ms=costs.predict("zigzag", shape))
            for shape in shapes]
    assert sum(r["ms"] == 30.0 for r in rows) == 4
    a, b, c, floor = script.fit(rows)
    assert floor == pytest.approx(30.0, rel=1e-4) and a == pytest.approx(1.9, rel=1e-4)
    assert c == pytest.approx(2.0, rel=1e-3) and b == pytest.approx(0.0, abs=1e-3)
    on_a_line = [dict(r, ms=1.9 * features("zigzag", r["shape"])[0] + 2.0) for r in rows]
    assert script.fit(on_a_line)[3] == 0.0           # no point on a floor: none fitted


def test_features_count_what_each_layout_sends():
    gqa = CallShape.batch(32, 8, 128, 1, 4 * 1024, 4)
    flops, ring_gb, one = features("zigzag", gqa)
    assert one == 1.0 and flops == pytest.approx(7 * (4 * 1024) ** 2 * 32 * 128 / 4 / 1e12)
    assert ring_gb == pytest.approx(6 * 3 * 1024 * 8 * 128 * 2 / 1e9)          # K/V of 3 others, fwd + bwd
    _, ulysses_gb, _ = features("ulysses", gqa)
    assert ulysses_gb == pytest.approx(1024 * 128 * 2 * 3 / 4 * (4 * 32 + 4 * 8) / 1e9)
    # 2 K/V heads over 4 ranks are replicated to 4 (ring_kernels.ulysses.kv_replication)
    _, replicated_gb, _ = features("ulysses", CallShape.batch(32, 2, 128, 1, 4 * 1024, 4))
    assert replicated_gb == pytest.approx(1024 * 128 * 2 * 3 / 4 * (4 * 32 + 4 * 4) / 1e9)
    packed = CallShape.documents(32, 8, 128, [1024, 3072], 2)
    assert packed.tokens == 2048 and packed.square_sum == 1024 ** 2 + 3072 ** 2 and packed.packed
    grids = {n: squarest_usp_grid(n) for n in (2, 4, 6, 8)}
    assert grids == {2: None, 4: (2, 2), 6: (3, 2), 8: (4, 2)}


def test_the_table_file_ships_beside_the_module():
    assert layout_costs.TABLE_PATH.name == "layout_costs.json" and layout_costs.TABLE_PATH.exists()
