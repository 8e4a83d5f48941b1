"""pyproject.toml's metadata in the form current setuptools reads without warnings."""
from __future__ import annotations

import tomllib

from packaging.requirements import Requirement
from packaging.version import Version

from _paths import ROOT

PYPROJECT = ROOT / "pyproject.toml"


def test_license_is_an_spdx_expression_and_the_backend_can_read_it():
    data = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))
    assert data["project"]["license"] == "Apache-2.0"  # PEP 639: a string, not the deprecated table
    assert not any(c.startswith("License ::") for c in data["project"].get("classifiers", []))  # PEP 639 forbids both
    setuptools = next(Requirement(r) for r in data["build-system"]["requires"] if Requirement(r).name == "setuptools")
    assert not setuptools.specifier.contains(Version("76.9"))  # setuptools reads the expression from 77 on
