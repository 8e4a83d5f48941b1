"""ring_kernels.tolerances: the table every comparison takes its bound from, its check, and the docs that quote it.

docs/user-guide.md's "Tolerances" section holds ``table_markdown()`` between two markers, equal to the module's;
each measure of ``error_of`` / ``assert_close`` against its definition (max_relative with and without a floor,
absolute, elementwise = ``torch.allclose``), and the failure message.
"""
from __future__ import annotations

import math
import re

import pytest
import torch

from _paths import ROOT
from ring_kernels import tolerances
from ring_kernels.tolerances import COMPARISONS, MEASURES, TABLE, Tolerance, assert_close, check, error_of, tolerance

DOCS = ROOT / "docs" / "user-guide.md"
_QUOTED = re.compile(r"<!-- tolerances:begin -->\n(.*?)<!-- tolerances:end -->", re.DOTALL)


def test_the_user_guide_quotes_the_table():
    quoted = _QUOTED.search(DOCS.read_text(encoding="utf-8"))
    assert quoted, "docs/user-guide.md has no <!-- tolerances:begin --> ... <!-- tolerances:end --> section"
    assert quoted.group(1) == tolerances.table_markdown(), (
        "docs/user-guide.md's tolerance table differs from ring_kernels/tolerances.py: paste the output of "
        "`python -m ring_kernels.tolerances` between the markers")


def test_every_entry_names_a_known_comparison_with_a_reason():
    for key, entry in TABLE.items():
        assert key == (entry.comparison, entry.dtype, entry.quantity)
        assert entry.comparison in COMPARISONS and entry.measure in MEASURES, key
        assert getattr(torch, entry.dtype).is_floating_point, key
        assert 0 < entry.bound < 1 and entry.reason.strip(), key
        assert entry.floor == 0 or entry.measure == "max_relative", f"{key}: a floor needs the max_relative measure"
    # the kernels are covered in every dtype a block backend computes in, for every quantity it returns
    for dtype in ("float32", "bfloat16", "float16"):
        for quantity in ("out", "lse", "grad"):
            assert ("kernel", dtype, quantity) in TABLE


def test_lookup_by_torch_dtype_or_name_and_unknown_entries_named():
    assert tolerance("kernel", torch.bfloat16, "out") is tolerance("kernel", "bfloat16", "out")
    with pytest.raises(KeyError, match=r"no tolerance for kernel/float64/out; the table has: .*kernel/float32/out"):
        tolerance("kernel", torch.float64, "out")


_REL = Tolerance("kernel", "float32", "out", 1e-3, "test")
_FLOOR = Tolerance("sweep", "float32", "grad", 1e-3, "test", floor=1e-2)
_ABS = Tolerance("cp_training", "float32", "param", 1e-3, "test")
_ELEMENTWISE = Tolerance("merge", "float32", "out", 1e-3, "test")


def test_max_relative_is_max_error_over_max_reference():
    expected, f64 = torch.tensor([10.0, -0.1, 1.0], dtype=torch.float64), dict(dtype=torch.float64)
    assert check(expected + torch.tensor([0.0, 0.0099, 0.0], **f64), expected, _REL)    # 0.0099 <= 1e-3 x 10
    assert not check(expected + torch.tensor([0.0, 0.0101, 0.0], **f64), expected, _REL)
    assert error_of(expected + torch.tensor([0.005, 0.0, 0.0], **f64), expected, _REL) == pytest.approx(0.5)
    assert check(torch.tensor(2.0019), torch.tensor(2.0), _REL)                        # a scalar loss
    assert not check(torch.tensor(2.0021), 2.0, _REL)
    assert check(torch.zeros(3), torch.zeros(3), _REL)                                  # nothing to compare
    assert not check(torch.tensor([0.0, 1e-30, 0.0]), torch.zeros(3), _REL)            # zero means exactly zero
    assert not check(torch.tensor([float("nan"), 1.0]), torch.tensor([1.0, 1.0]), _REL)
    assert check(torch.ones(2, dtype=torch.bfloat16), torch.ones(2, dtype=torch.float64), _REL)   # any dtypes
    with pytest.raises(ValueError, match="shape"):
        check(torch.zeros(2), torch.zeros(3), _REL)


def test_floor_is_relative_to_the_largest_entry_of_the_whole_result():
    noise, expected = torch.tensor([1e-4, 0.0]), torch.tensor([1e-6, 0.0])    # a gradient that is rounding noise
    assert not check(noise, expected, _FLOOR, largest=None)
    assert check(noise, expected, _FLOOR, largest=1e-2)                        # 1e-4 <= 1e-3 x 1e-6 + 1e-2 x 1e-2
    assert not check(noise, expected, _FLOOR, largest=1e-3)


def test_absolute_and_elementwise_measures():
    assert check(torch.tensor([5.0009]), torch.tensor([5.0]), _ABS)
    assert not check(torch.tensor([5.0011]), torch.tensor([5.0]), _ABS)
    gen = torch.Generator().manual_seed(0)
    expected = torch.randn(1000, generator=gen)
    for scale in (1e-4, 5e-4, 1e-3, 2e-3, 1e-2):
        actual = expected + scale * torch.randn(1000, generator=gen)
        assert check(actual, expected, _ELEMENTWISE) == torch.allclose(actual.double(), expected.double(),
                                                                       rtol=1e-3, atol=1e-3), scale


def test_assert_close_message_names_what_the_entry_the_error_and_the_bound():
    with pytest.raises(AssertionError) as info:
        assert_close(torch.tensor([1.0, 2.1]), torch.tensor([1.0, 2.0]), _REL, "dq of case 3")
    message = str(info.value)
    assert message.startswith("dq of case 3: max|err| / max|expected| = 0.05 > 0.001")
    assert "(kernel/float32/out: test)" in message
    with pytest.raises(AssertionError, match=r"max\|err\| = 0.5 > 0.001 \(cp_training/float32/param"):
        assert_close(torch.tensor([1.5]), torch.tensor([1.0]), _ABS)
    with pytest.raises(AssertionError, match=r"\+ 0.01 x largest 1"):
        assert_close(torch.tensor([1.0]), torch.tensor([0.0]), _FLOOR, largest=1.0)
    assert_close(torch.tensor([1.0]), torch.tensor([1.0]), _REL)                       # passes silently
    assert math.isinf(error_of(torch.tensor([1.0]), torch.tensor([0.0]), _REL))
