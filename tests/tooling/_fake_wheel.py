"""Build small stand-in transformers wheels for the static-check tests (no network, no real release).

A wheel here is a zip with ``transformers/__init__.py`` (the version), the ``.dist-info/METADATA`` naming it,
``transformers/modeling_flash_attention_utils.py`` with the given ``_flash_attention_forward`` definition, and
model modules that bind it by from-import: what the static scanner reads, nothing more.
"""
from __future__ import annotations

import zipfile
from pathlib import Path

# The 4.43 signature (S1), as written in that release.
S1_DEF = '''
import os
from typing import Optional
import torch

def _flash_attention_forward(
    query_states: torch.Tensor,
    key_states: torch.Tensor,
    value_states: torch.Tensor,
    attention_mask: torch.Tensor,
    query_length: int,
    is_causal: bool,
    dropout: float = 0.0,
    softmax_scale: Optional[float] = None,
    sliding_window: Optional[int] = None,
    use_top_left_mask: bool = False,
    softcap: Optional[float] = None,
    deterministic: bool = os.environ.get("FLASH_ATTENTION_DETERMINISTIC", "0") == "1",
):
    raise NotImplementedError
'''

# A signature no registry entry can accept: a required parameter removed and one renamed.
BROKEN_DEF = '''
def _flash_attention_forward(q, k, v, attention_mask, query_length, causal_flag, dropout=0.0, **kwargs):
    raise NotImplementedError
'''

_IMPORTER = "from ...modeling_flash_attention_utils import _flash_attention_forward\n"


def make_wheel(directory: Path, version: str, mfau_source: str | None, models: tuple[str, ...] = ("llama",)) -> Path:
    """Write ``transformers-<version>-py3-none-any.whl`` into ``directory`` and return its path.

    ``mfau_source`` None builds a pre-4.43-style wheel (no modeling_flash_attention_utils module).
    """
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"transformers-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("transformers/__init__.py", f'__version__ = "{version}"\n')
        zf.writestr(f"transformers-{version}.dist-info/METADATA", f"Name: transformers\nVersion: {version}\n")
        if mfau_source is not None:
            zf.writestr("transformers/modeling_flash_attention_utils.py", mfau_source)
        for model in models:
            zf.writestr(f"transformers/models/{model}/__init__.py", "")
            zf.writestr(f"transformers/models/{model}/modeling_{model}.py", _IMPORTER if mfau_source else "")
    return path
