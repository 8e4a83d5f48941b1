"""tox.ini read as the matrix's tests need it (the torch axis: which torch venv each env shares)."""
from __future__ import annotations

import configparser
import os
import re

TOX_INI = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tox.ini")
_TORCH_PYTHON = re.compile(r"HFPATCH_TORCH_PYTHON\s*=\s*\{toxinidir\}/(\.venv[\w.-]*)/bin/python")


def read_tox() -> configparser.ConfigParser:
    """tox.ini as written (no substitution: ``{[testenv]commands}`` stays a reference)."""
    config = configparser.ConfigParser(interpolation=None)
    config.read(TOX_INI)
    return config


def matrix_torch_venvs() -> dict:
    """tox env -> the venv its ``HFPATCH_TORCH_PYTHON`` names (``.venv``, the CI venv, where it names none), for
    every env of ``env_list``."""
    config = read_tox()
    venvs = {}
    for env in (e.strip() for e in config["tox"]["env_list"].split(",")):
        section = config[f"testenv:{env}"] if config.has_section(f"testenv:{env}") else {}
        found = _TORCH_PYTHON.search(section.get("set_env", ""))
        venvs[env] = found.group(1) if found else ".venv"
    return venvs
