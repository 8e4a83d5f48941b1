"""The project's numerical tolerances: one table per comparison, dtype and quantity, and the check that applies them.

Every test that compares a result with an expected one, and every runtime check that does (the model sweep, the
whole-model probe), takes its bound from ``TABLE`` through ``tolerance(comparison, dtype, quantity)`` and applies
it with ``check`` / ``assert_close``; docs/user-guide.md quotes ``table_markdown()``
(tests/ring_kernels/test_tolerances.py keeps the two equal).

Each comparison has one measure (``MEASURES``):

- ``"max_relative"``: ``max|actual - expected| / max|expected|`` over the whole tensor (a scalar loss: its
  relative error). An entry may add a ``floor``: the error allowed grows by ``floor`` x ``largest``, the largest
  entry of the whole result the tensor belongs to (every gradient of a model), so that a parameter whose gradient
  is rounding noise is compared at the model's scale.
- ``"absolute"``: ``max|actual - expected|``.
- ``"elementwise"``: ``max |actual - expected| / (1 + |expected|)`` over the elements: ``torch.allclose`` with
  ``rtol = atol = bound``.

A bound is set from the worst error measured over the tests' cases, with a margin, and each entry gives its
reason. A semantic error (a wrong mask, a missing block, positions off by a shard) is orders of magnitude above
every bound; tests/model/test_e2e_models.py and tests/integrations/test_training_stack.py show that for a window one
token wide and a missing gradient reduction.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

import torch

__all__ = ["Tolerance", "MEASURES", "COMPARISONS", "TABLE", "tolerance", "error_of", "relative_error", "check",
           "assert_close", "table_markdown"]

MEASURES = {
    "max_relative": "max|actual - expected| / max|expected| (+ floor x the largest entry of the whole result)",
    "absolute": "max|actual - expected|",
    "elementwise": "max over elements of |actual - expected| / (1 + |expected|)",
}


@dataclass(frozen=True)
class Tolerance:
    """One bound: ``comparison`` (a key of ``COMPARISONS``), the ``dtype`` of the result compared (its name,
    "float32"), the ``quantity`` ("out", "lse", "grad", "loss", "param", "module"), the largest error
    ``bound`` in the comparison's measure, an optional ``floor`` (``max_relative`` only) and the ``reason``."""

    comparison: str
    dtype: str
    quantity: str
    bound: float
    reason: str
    floor: float = 0.0

    @property
    def measure(self) -> str:
        return COMPARISONS[self.comparison][0]


# comparison -> (measure, what is compared with what)
COMPARISONS = {
    "kernel": ("max_relative", "a kernel (block backend, ring variant, Triton) on inputs of the dtype vs plain "
                               "attention in float64 on the same inputs"),
    "merged_blocks": ("max_relative", "per-block results of one backend merged by LSE (fp32) vs that backend "
                                      "over all keys at once"),
    "merge": ("elementwise", "the LSE merge and the widening add vs float64 math, and their fused Triton kernels "
                             "vs the eager ones"),
    "cp": ("max_relative", "a model under CP (sharded over ranks, gradients summed over the group) vs the same "
                           "model without CP on the whole batch, same dtype"),
    "cp_training": ("absolute", "parameters after optimizer steps under FSDP2 + CP vs the single-process run"),
    "sweep": ("max_relative", "the model sweep: every causal-LM class of the installed release, tiny, one "
                              "training step under CP vs without"),
    "model_probe": ("max_relative", "apply(model=)'s whole-model probe: each sequence-shaped module input and "
                                    "output under CP, the module fed the non-CP run's inputs, vs without, per dtype "
                                    "of the model"),
}

_ROUNDING = "the ring merges blocks through an fp32 log-sum-exp and sums over ranks in another order"

_ENTRIES = [
    # kernel vs float64 (worst measured over tests/ring_kernels/test_backends, test_ring_batch, test_ring_varlen,
    # test_ring_sinks, test_triton_backend on CPU, and the ring/varlen GPU cases on one H100) -----------------------
    Tolerance("kernel", "float32", "out", 1e-5, "fp32 rounding of softmax and P@V; measured worst 1.6e-6"),
    Tolerance("kernel", "float32", "lse", 1e-5, "fp32 rounding of the row max and log-sum; measured worst 3.6e-7"),
    Tolerance("kernel", "float32", "grad", 1e-5, "fp32 rounding of dS and the gradient products; measured worst "
                                                 "2.0e-6 (the Triton kernel under the interpreter: 8.8e-7)"),
    Tolerance("kernel", "bfloat16", "out", 1e-2, "P rounded to bf16 before P@V and the output rounded once "
                                                 "(bf16 eps 2**-7 = 7.8e-3); measured worst 5.6e-3"),
    Tolerance("kernel", "bfloat16", "lse", 5e-5, "the lse is fp32 whatever the inputs' dtype; measured worst 1.6e-7, "
                                                 "but 1.5e-5 from torch's CPU kernel on a CPU without AVX-512 (AVX2); "
                                                 "an lse error e scales a merged block by exp(e), far below bf16's eps"),
    Tolerance("kernel", "bfloat16", "grad", 2e-2, "dS and P rounded to bf16 before the gradient products, each "
                                                  "gradient rounded once; measured worst 9.0e-3"),
    Tolerance("kernel", "float16", "out", 2e-3, "P rounded to fp16 before P@V (fp16 eps 2**-10 = 9.8e-4); "
                                                "measured worst 3.7e-4"),
    Tolerance("kernel", "float16", "lse", 1e-5, "the lse is fp32 whatever the inputs' dtype; measured worst 1.7e-7"),
    Tolerance("kernel", "float16", "grad", 4e-3, "dS rounded to fp16 before dS@K and dS^T@Q; measured worst 8.1e-4"),
    # merged blocks vs one block ------------------------------------------------------------------------------
    Tolerance("merged_blocks", "float32", "out", 1e-6, "one fp32 LSE merge per block; measured worst 2.9e-7"),
    Tolerance("merged_blocks", "float32", "lse", 1e-6, "one fp32 log-add per block; measured worst 1.2e-7"),
    Tolerance("merged_blocks", "float32", "grad", 1e-5, "per-block gradients summed in another order; measured "
                                                        "worst 7.0e-7"),
    # LSE merge / widening add vs float64, fused vs eager ---------------------------------------------------
    Tolerance("merge", "float32", "out", 1e-6, "fp32 math of the exp(lse - new lse) weights; measured worst 2.1e-7"),
    Tolerance("merge", "float32", "lse", 1e-6, "fp32 log-add; measured worst 6.5e-8"),
    Tolerance("merge", "bfloat16", "out", 2.0 ** -7, "one bf16 rounding of an fp32 result: one eps"),
    Tolerance("merge", "float16", "out", 2.0 ** -10, "one fp16 rounding of an fp32 result: one eps"),
    # CP vs non-CP on a model ---------------------------------------------------------------------------------
    Tolerance("cp", "float32", "loss", 1e-5, f"{_ROUNDING}; measured worst 8.6e-8"),
    Tolerance("cp", "float32", "out", 1e-5, f"logits, or a sequence mixer's output: {_ROUNDING}; measured worst "
                                            "9.5e-7"),
    Tolerance("cp", "float32", "grad", 2e-5, f"each parameter against its own largest entry: {_ROUNDING}; "
                                             "measured worst 3.2e-6"),
    Tolerance("cp", "bfloat16", "loss", 1e-2, "bf16 activations rounded differently on the two sides; measured "
                                              "worst 4.3e-4"),
    Tolerance("cp", "bfloat16", "out", 3e-2, "logits: bf16 rounding of every layer's activations (CUDA, 2 GPUs)"),
    Tolerance("cp", "bfloat16", "grad", 1e-1, "bf16 activations and gradients rounded differently on the two "
                                              "sides, through every layer; measured worst 4.1e-2"),
    # FSDP2 + CP training vs single process -----------------------------------------------------------------
    Tolerance("cp_training", "float32", "param", 2e-6, "weights of scale 0.2-1, updates ~1e-2 per step; measured "
                                                       "worst 2.4e-7 over 3 steps"),
    # the model sweep ---------------------------------------------------------------------------------------
    Tolerance("sweep", "float32", "loss", 1e-5, f"{_ROUNDING}; measured worst 2.4e-7 (the sequence-mixer classes)"),
    Tolerance("sweep", "float32", "grad", 1e-4, "any class of the release (routers, sequence mixers, deep stacks "
                                                "add rounding); measured worst 9.5e-6 (the sequence-mixer "
                                                "classes). A parameter whose gradient is rounding noise compares "
                                                "at the model's scale (the floor, x the largest gradient): measured "
                                                "worst 1.4e-6, DistilBERT's key bias, whose exact gradient is 0 "
                                                "(softmax ignores a shift shared by all keys) while each rank's share "
                                                "of it (~0.1 of the largest) cancels over the ranks", floor=1e-5),
    # the whole-model probe ---------------------------------------------------------------------------------
    Tolerance("model_probe", "float64", "module", 1e-8, f"{_ROUNDING} (float64)"),
    Tolerance("model_probe", "float32", "module", 1e-4, "one module's fp32 rounding, the module fed the non-CP "
                                                        "run's inputs; measured worst 1.6e-6, seeded CP bugs >= 0.29"),
    Tolerance("model_probe", "bfloat16", "module", 5e-2, "one module's bf16 rounding (the attention output: 1-2 bf16 "
                                                         "ulps), the module fed the non-CP run's inputs, at any "
                                                         "depth; measured worst 1.0e-2, seeded CP bugs >= 0.29"),
    Tolerance("model_probe", "float16", "module", 1e-2, "one module's fp16 rounding, the module fed the non-CP "
                                                        "run's inputs; measured worst 1.3e-3, seeded CP bugs >= 0.29"),
]

TABLE: dict[tuple[str, str, str], Tolerance] = {(t.comparison, t.dtype, t.quantity): t for t in _ENTRIES}


def _dtype_name(dtype: Union[torch.dtype, str]) -> str:
    return str(dtype).removeprefix("torch.") if isinstance(dtype, torch.dtype) else dtype


def tolerance(comparison: str, dtype: Union[torch.dtype, str], quantity: str) -> Tolerance:
    """The entry of ``TABLE`` for (comparison, dtype, quantity); ``KeyError`` naming the entries that exist."""
    key = (comparison, _dtype_name(dtype), quantity)
    if key not in TABLE:
        known = sorted(f"{c}/{d}/{q}" for c, d, q in TABLE)
        raise KeyError(f"no tolerance for {'/'.join(key)}; the table has: {', '.join(known)}")
    return TABLE[key]


def _as_float64(x) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach().to(device="cpu", dtype=torch.float64)
    return torch.tensor(float(x), dtype=torch.float64)


def error_of(actual, expected, entry: Tolerance, *, largest: Optional[float] = None) -> float:
    """The error of ``actual`` against ``expected`` in ``entry``'s measure, divided by the error allowed: the
    comparison passes when the result is <= 1 (NaN counts as a failure). ``largest``: the largest entry of the
    whole result, for an entry with a floor."""
    a, e = _as_float64(actual), _as_float64(expected)
    if a.shape != e.shape:
        raise ValueError(f"shape {tuple(a.shape)} vs expected {tuple(e.shape)}")
    if a.numel() == 0:
        return 0.0
    diff = (a - e).abs()
    if entry.measure == "elementwise":
        allowed = entry.bound * (1 + e.abs())
        return float((diff / allowed).max())
    worst = float(diff.max())
    if entry.measure == "absolute":
        allowed = entry.bound
    else:
        allowed = entry.bound * float(e.abs().max()) + entry.floor * (largest or 0.0)
    if allowed == 0.0:
        return 0.0 if worst == 0.0 else math.inf
    return worst / allowed if not math.isnan(worst) else math.inf


def relative_error(actual, expected) -> float:
    """``max|actual - expected| / max|expected|`` (0 when both are all zeros, inf when only ``expected`` is)."""
    a, e = _as_float64(actual), _as_float64(expected)
    worst, scale = float((a - e).abs().max()), float(e.abs().max())
    return worst / scale if scale else (0.0 if worst == 0.0 else math.inf)


def check(actual, expected, entry: Tolerance, *, largest: Optional[float] = None) -> bool:
    """True when ``actual`` is within ``entry`` of ``expected``."""
    return error_of(actual, expected, entry, largest=largest) <= 1.0


def assert_close(actual, expected, entry: Tolerance, what: str = "", *, largest: Optional[float] = None) -> None:
    """Raise ``AssertionError`` unless ``actual`` is within ``entry`` of ``expected``; the message names ``what``,
    the entry, the measured error and the bound."""
    ratio = error_of(actual, expected, entry, largest=largest)
    if ratio <= 1.0:
        return
    if entry.measure == "max_relative":
        measured = f"max|err| / max|expected| = {relative_error(actual, expected):.3g}"
    elif entry.measure == "absolute":
        measured = f"max|err| = {float((_as_float64(actual) - _as_float64(expected)).abs().max()):.3g}"
    else:
        measured = f"max |err| / (1 + |expected|) = {ratio * entry.bound:.3g}"
    floor = f" + {entry.floor:g} x largest {largest:.3g}" if entry.floor and largest else ""
    raise AssertionError(f"{what + ': ' if what else ''}{measured} > {entry.bound:g}{floor} "
                         f"({entry.comparison}/{entry.dtype}/{entry.quantity}: {entry.reason})")


def table_markdown() -> str:
    """The table as Markdown (docs/user-guide.md quotes it)."""
    lines = ["| comparison | measure | dtype | quantity | bound | reason |", "|---|---|---|---|---|---|"]
    for t in _ENTRIES:
        bound = f"{t.bound:.3g}" + (f" + {t.floor:.3g} x largest" if t.floor else "")
        lines.append(f"| {t.comparison} | {t.measure} | {t.dtype} | {t.quantity} | {bound} | {t.reason} |")
    lines.append("")
    lines += [f"- **{name}** ({measure}): {what}." for name, (measure, what) in COMPARISONS.items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # python -m ring_kernels.tolerances: the Markdown docs/user-guide.md quotes
    print(table_markdown(), end="")
