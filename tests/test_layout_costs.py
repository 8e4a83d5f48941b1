"""ring_kernels.layout_costs: the stored table is what scripts/fit_layout_costs.py fits on the committed layout grid,
its pick is within 3% of the fastest measured layout at every measured point but the ones ``KNOWN_MISSES`` names
(the grid's real shapes: 32 query heads, 8 or 32 K/V heads, head dim 128, 8k-128k tokens per GPU, 2 and 4 H100s,
batch and packed), and its choices say what was left out and why."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from ring_kernels import layout_costs
from ring_kernels.layout_costs import CallShape, LayoutCosts, features, load, machine_of, usp_grid

ROOT = Path(__file__).resolve().parents[1]


def _fit_script():
    spec = importlib.util.spec_from_file_location("fit_layout_costs", ROOT / "scripts" / "fit_layout_costs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_stored_table_is_the_fit_of_the_committed_grid():
    assert _fit_script().main(["--check"]) == 0


# Points where the fitted table's pick is measured more than 3% slower than the fastest layout: the target
# is not met there yet. Packed MHA on 4 GPUs at 32k: the fastest head-parallel layout 24.7 ms and llama3 29.1 ms in
# both of two runs (3 and 20 timed calls), so the gap is real, not noise; the linear model puts usp_varlen's flat
# 8k-32k floor and its compute slope on one line (predicts 28.5 ms) and under-counts llama3's K/V all-gather for
# 32 K/V heads (26.3 ms).
# The test fails when the listed point meets the target (remove it) or another point misses it.
KNOWN_MISSES = {("H100", 4, 32768, "mha", True): ("usp_varlen", "llama3")}


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
    machine, note = machine_of("NVIDIA H200")
    assert machine == "H100" and "H200 uses the H100 calibration" in note
    assert machine_of("NVIDIA A100-SXM4-80GB") is None
    assert machine_of("cpu") is None


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
    assert usp_grid(4) == (2, 2) and usp_grid(8) == (4, 2) and usp_grid(2) is None and usp_grid(6) == (3, 2)


def test_the_table_file_ships_beside_the_module():
    assert layout_costs.TABLE_PATH.name == "layout_costs.json" and layout_costs.TABLE_PATH.exists()
