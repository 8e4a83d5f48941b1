"""What each exact layout costs for one causal attention call on a calibrated machine, and the cheapest of them.

A layout's time for one call, forward + backward, in milliseconds, is modelled as

    t = max(f, a * F + b * G + c)

- ``F``: the call's attention TFLOP per rank (causal: ``7 * sum(s^2) * H * D / N`` over the global sequences s:
  the forward's two matmuls on half the square, the backward 2.5 times the forward);
- ``G``: the GB each rank sends (bf16), forward + backward: the ring variants pass the other ranks' K/V and, in the
  backward, K/V and their gradients again; Ulysses sends q, k, v and the output gradient out and the output and
  q/k/v gradients back over all-to-alls; USP does both, Ulysses within its groups and the ring across them. llama3
  is charged the ring's bytes, an upper bound (it moves only the K/V rows of documents that cross a rank
  boundary): its fitted ``a, c, f`` carry the difference on the points it was fitted on (which calibrations
  measured the exchange: docs/performance.md#llama3-exchanges-only-the-rows-other-ranks-read);
- ``c``: what a call costs whatever its size (launches, synchronisation);
- ``f``: the floor, in ms: what a call costs while the GPU finishes its work before the host has issued it (packed
  rows launch kernels per document, so their small calls take the same time whatever their size; 0 where no
  measured point sits on a floor).

The coefficients ``a, b, c, f`` are per (GPU model, world size, layout), fitted by ``scripts/fit_layout_costs.py``
(the floor on the points of least TFLOP, the line, by weighted least squares with no coefficient negative, on the
rest) on the layout grid that ``benchmarks/layout_grid.sh`` measures, into ``layout_costs.json`` beside this
module, which records the measured points and how close the fit came.

Layouts are ring_kernels' functions on the inputs' layout (``COSTED_KERNELS``): batch rows ``"zigzag"``,
``"ring"`` (contiguous), ``"ulysses"``, ``"usp"`` (the zigzag ring across Ulysses groups); packed rows
(``PACKED_KERNELS``) ``"llama3"``, ``"ring_varlen"``, ``"zigzag_varlen"``, ``"ulysses_varlen"``, ``"usp_varlen"``
(the llama3 ring across Ulysses groups). USP runs on the squarest grid of the world (``squarest_usp_grid``).
``choose`` returns the cheapest feasible layout with every prediction and every exclusion, as a ``LayoutChoice``.
``ONE_SPLIT`` lists the layouts that compute on one split of the inputs: what a caller that has already sharded
the sequence can choose among.
"""
from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Mapping, Optional, Sequence, Tuple

from .ulysses import kv_replication

__all__ = ["CallShape", "LayoutChoice", "LayoutCosts", "COSTED_KERNELS", "PACKED_KERNELS", "ONE_SPLIT",
           "TABLE_PATH", "squarest_usp_grid", "features", "load", "machine_of", "gpu_model"]

TABLE_PATH = Path(__file__).with_name("layout_costs.json")
# The kernels the model prices (its "layouts"; not ``ring_kernels.layout.LAYOUTS``, the token splits).
PACKED_KERNELS = ("llama3", "ring_varlen", "zigzag_varlen", "ulysses_varlen", "usp_varlen")
COSTED_KERNELS = ("zigzag", "ring", "ulysses", "usp") + PACKED_KERNELS
# packed -> the layouts that compute on one split of the inputs (batch rows: zigzag; packed rows: contiguous), the
# plain ring and zigzag varlen left out (each needs its own split, and neither is the fastest causal layout there).
ONE_SPLIT: Dict[bool, Tuple[str, ...]] = {False: ("zigzag", "ulysses", "usp"),
                                          True: ("llama3", "ring_varlen", "ulysses_varlen", "usp_varlen")}
_ULYSSES = ("ulysses", "ulysses_varlen")
_USP = ("usp", "usp_varlen")
_BYTES = 2           # bf16 / fp16: what the grid measures


@dataclass(frozen=True)
class CallShape:
    """One attention call as the cost model sees it.

    heads, kv_heads, head_dim: H, Hk, D of the call.
    tokens:      the tokens this rank holds (all rows of the batch).
    world:       N, the ranks of the group.
    square_sum:  the sum of s^2 over the causal sequences of the whole step (a batch of B rows of S tokens:
                 B * S^2; a packed row: the sum over its documents).
    packed:      a packed row of documents (the varlen layouts), else batch rows.
    """

    heads: int
    kv_heads: int
    head_dim: int
    tokens: int
    world: int
    square_sum: float
    packed: bool

    @classmethod
    def batch(cls, heads: int, kv_heads: int, head_dim: int, rows: int, seq_global: int, world: int) -> "CallShape":
        return cls(heads, kv_heads, head_dim, rows * seq_global // world, world, float(rows) * seq_global ** 2,
                   False)

    @classmethod
    def documents(cls, heads: int, kv_heads: int, head_dim: int, lengths: Sequence[int], world: int) -> "CallShape":
        """A packed row of documents of ``lengths`` (the global row), split over ``world`` ranks."""
        total = int(sum(lengths))
        return cls(heads, kv_heads, head_dim, total // world, world, float(sum(int(n) ** 2 for n in lengths)), True)

    def describe(self) -> str:
        form = "packed" if self.packed else "batch"
        return (f"{form}, {self.tokens} tokens per rank over {self.world} ranks, H={self.heads} Hk={self.kv_heads} "
                f"D={self.head_dim}")


def squarest_usp_grid(world: int) -> Optional[Tuple[int, int]]:
    """(U, R): the squarest grid of ``world`` ranks with U >= R >= 2 (4: 2 x 2, 8: 4 x 2), or None. (Not
    ``ring_kernels.usp.usp_grid``, which checks a grid of process groups.)"""
    splits = [(world // r, r) for r in range(2, math.isqrt(world) + 1) if world % r == 0]
    return splits[-1] if splits else None


# The old name, while hfpatch.attention.context imports it.



def features(layout: str, shape: CallShape) -> Tuple[float, float, float]:
    """(F TFLOP per rank, G GB sent per rank, 1) of ``layout`` on ``shape`` (the module docstring)."""
    h, d, n, t = shape.heads, shape.head_dim, shape.world, shape.tokens
    flops = 7.0 * shape.square_sum * h * d / n / 1e12
    if layout in _ULYSSES:
        hk = shape.kv_heads * kv_replication(h, shape.kv_heads, n)   # K/V heads sent, replicated as Ulysses does
        sent = t * d * _BYTES * (n - 1) / n * (4 * h + 4 * hk)
    elif layout in _USP:
        u, r = squarest_usp_grid(n) or (n, 1)
        hk = shape.kv_heads * kv_replication(h, shape.kv_heads, u)
        sent = t * d * _BYTES * ((u - 1) / u * (4 * h + 4 * hk) + 6 * (r - 1) * hk)
    else:
        sent = 6.0 * (n - 1) * t * shape.kv_heads * d * _BYTES
    return flops, sent / 1e9, 1.0


@dataclass(frozen=True)
class LayoutChoice:
    """What ``LayoutCosts.choose`` picked and why.

    layout:        the cheapest feasible layout (None when none was both feasible and calibrated).
    machine:       the calibration's machine (e.g. "H100"); ``calibrated_world``: the world size whose
                   coefficients predicted (the call's, or the nearest calibrated one: see ``reason``).
    shape:         ``CallShape.describe()`` of the call.
    predicted_ms:  (layout, predicted ms) of every layout considered, cheapest first.
    excluded:      (layout, why) of every candidate left out: infeasible for this call, or not calibrated.
    reason:        one sentence: the pick and its margin over the next, or why nothing was picked.
    """

    layout: Optional[str]
    machine: str
    calibrated_world: Optional[int]
    shape: str
    predicted_ms: Tuple[Tuple[str, float], ...]
    excluded: Tuple[Tuple[str, str], ...]
    reason: str


class LayoutCosts:
    """The fitted coefficients of one machine: ``coefficients[world][layout] = (a, b, c, f)`` (a floor ``f`` left
    out is 0: the plain line). ``borrowed[world] = (machine, why)`` marks a world size whose coefficients are
    another machine's (``load``: one calibrated where this one is not)."""

    def __init__(self, machine: str, coefficients: Mapping[int, Mapping[str, Sequence[float]]],
                 borrowed: Optional[Mapping[int, Tuple[str, str]]] = None):
        self.machine = machine
        self.coefficients = {int(w): {k: _with_floor(v) for k, v in table.items()}
                             for w, table in coefficients.items()}
        self.borrowed = {int(w): tuple(found) for w, found in (borrowed or {}).items()}

    def calibration(self, world: int) -> str:
        """Whose calibration predicts at the calibrated ``world`` (``world_for``), said for a reason: "H100", or
        "H100 (for H200: why)" where borrowed."""
        if world not in self.borrowed:
            return self.machine
        other, why = self.borrowed[world]
        return f"{other} (for {self.machine}, not calibrated at {world} GPUs: {why})"

    def world_for(self, world: int) -> Optional[int]:
        """The calibrated world size used for ``world``: itself, else the largest calibrated one below it, else
        the smallest above it; None without any."""
        if world in self.coefficients:
            return world
        below = [w for w in self.coefficients if w < world]
        if below:
            return max(below)
        return min(self.coefficients) if self.coefficients else None

    def predict(self, layout: str, shape: CallShape) -> Optional[float]:
        """Predicted ms of ``layout`` on ``shape``; None where that layout is not calibrated for the world used."""
        world = self.world_for(shape.world)
        coefficients = self.coefficients.get(world, {}).get(layout) if world is not None else None
        if coefficients is None:
            return None
        *line, floor = coefficients
        return max(floor, sum(c * f for c, f in zip(line, features(layout, shape))))

    def choose(self, shape: CallShape, candidates: Mapping[str, Optional[str]]) -> LayoutChoice:
        """The cheapest of ``candidates`` (layout -> None when it can run this call, else why it cannot)."""
        world = self.world_for(shape.world)
        predicted, excluded = [], [(k, why) for k, why in candidates.items() if why is not None]
        for layout in (k for k, why in candidates.items() if why is None):
            ms = self.predict(layout, shape)
            if ms is None:
                excluded.append((layout, f"not calibrated on {self.machine} at {world} GPUs"))
            else:
                predicted.append((layout, float(f"{ms:.4g}")))
        predicted.sort(key=lambda item: item[1])
        machine = self.borrowed.get(world, (self.machine,))[0]
        where = f"{self.calibration(world)}, {world} GPUs" + ("" if world == shape.world else
                                                               f" (the nearest calibrated world to {shape.world})")
        if not predicted:
            return LayoutChoice(None, machine, world, shape.describe(), (), tuple(excluded),
                                f"no candidate layout is calibrated and feasible ({where})")
        best, ms = predicted[0]
        margin = ""
        if len(predicted) > 1:
            runner_up, its_ms = predicted[1]
            more = f"+{its_ms / ms - 1:.1%}" if ms > 0 else f"+{its_ms - ms:.3g} ms"
            margin = f"; next {runner_up} {its_ms:.3g} ms ({more})"
        return LayoutChoice(best, machine, world, shape.describe(), tuple(predicted), tuple(excluded),
                            f"{best}: predicted {ms:.3g} ms by the cost model of {where}{margin}")


def _with_floor(coefficients: Sequence[float]) -> Tuple[float, float, float, float]:
    values = tuple(float(x) for x in coefficients)
    if len(values) not in (3, 4):
        raise ValueError(f"layout cost coefficients are (a, b, c) or (a, b, c, floor); got {values}")
    return values if len(values) == 4 else values + (0.0,)


def gpu_model(device_name: str) -> Optional[str]:
    """The GPU model in a CUDA device name ("NVIDIA H100 80GB HBM3" -> "H100"), or None."""
    found = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Za-z]?)\b", device_name or "")
    return found.group(1) if found else None


@functools.lru_cache(maxsize=1)
def _table() -> dict:
    with open(TABLE_PATH) as f:
        return json.load(f)


def machine_of(device_name: str) -> Optional[Tuple[str, str]]:
    """(the calibrated machine, a note) for a CUDA device name, or None when no calibration covers it. A model
    without a calibration of its own but listed under the table's "same_as" uses another's; the note says which and
    why (a model with its own borrows only the world sizes it lacks: ``load``)."""
    model = gpu_model(device_name)
    table = _table()
    if model in table["machines"]:
        return model, ""
    alias = table.get("same_as", {}).get(model)
    if alias is not None:
        return alias["machine"], f"{model} uses the {alias['machine']} calibration: {alias['why']}"
    return None


def load(machine: str) -> LayoutCosts:
    """The coefficients of ``machine`` (a key of ``layout_costs.json``'s machines), and, for the world sizes it has
    none of, those of the machine it is listed the same as ("same_as"), marked ``borrowed``; KeyError naming the
    calibrated machines."""
    table = _table()
    machines = table["machines"]
    if machine not in machines:
        raise KeyError(f"no layout-cost calibration for {machine!r}; calibrated: {sorted(machines)}")
    coefficients = _worlds(machines[machine])
    borrowed = {}
    alias = table.get("same_as", {}).get(machine)
    if alias is not None:
        for world, fits in _worlds(machines[alias["machine"]]).items():
            if world not in coefficients:
                coefficients[world] = fits
                borrowed[world] = (alias["machine"], alias["why"])
    return LayoutCosts(machine, coefficients, borrowed)


def _worlds(entry: dict) -> Dict[int, Dict[str, list]]:
    return {int(w): {layout: list(fit["coefficients"]) + [fit.get("floor_ms", 0.0)] for layout, fit in fits.items()}
            for w, fits in entry["worlds"].items()}
