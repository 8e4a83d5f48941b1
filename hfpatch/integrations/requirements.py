"""The releases ``hfpatch.integrations`` supports, as named ``packaging`` constants, and the check ``enable`` runs.

One place for every version gate of the trainer integration. Each constant is the first release the integration
runs on, with the reason; CI runs the tests on the newest releases (the CI venv) and on the oldest claimed
combination (tox.ini's oldest trainer env).
"""
from __future__ import annotations

from importlib import metadata
from typing import Optional

from packaging.version import Version

from hfpatch.errors import UnsupportedRelease

__all__ = ["TRANSFORMERS_MIN", "ACCELERATE_MIN", "TRL_MIN", "installed", "check_releases"]

# 5.0.0: `Trainer._prepare_context_parallel_inputs(model, inputs)` is the one place a training step prepares its
# inputs for context parallelism, and `TrainingArguments.parallelism_config` hands accelerate its mesh.
TRANSFORMERS_MIN = Version("5.0.0")

# 1.12.0: the first accelerate transformers 5's Trainer accepts a `parallelism_config` with (it checks for it);
# `ParallelismConfig(cp_size=)` builds the "cp" mesh dimension and gives every rank of a CP group the same batch.
ACCELERATE_MIN = Version("1.12.0")

# 1.16.0: SFTTrainer's fused LM head scores pre-shifted `shift_labels` without shifting and divides by
# `num_items_in_batch`; its padding-free collator emits position ids and `cu_seq_lens_*`.
TRL_MIN = Version("1.16.0")


def installed(distribution: str) -> Optional[Version]:
    """The installed version of ``distribution`` (read from its metadata, not imported), or None."""
    try:
        return Version(metadata.version(distribution))
    except metadata.PackageNotFoundError:
        return None


def _require(distribution: str, minimum: Version, why: str) -> None:
    found = installed(distribution)
    if found is None or Version(found.base_version) < minimum:
        what = "is not installed" if found is None else f"{found} is installed"
        raise UnsupportedRelease(
            f"hfpatch.integrations needs {distribution}>={minimum} ({why}); {what}. "
            f"Fix: pip install '{distribution}>={minimum}' (or pip install 'hfpatch[trainer]').",
            transformers_version=str(installed("transformers")), requirement=f"{distribution}>={minimum}",
        )


def check_releases(*, trl: bool) -> None:
    """Raise ``UnsupportedRelease`` naming the package when transformers, accelerate (and, with ``trl``, TRL) are
    older than the integration supports."""
    _require("transformers", TRANSFORMERS_MIN, "Trainer's context-parallel input preparation")
    _require("accelerate", ACCELERATE_MIN, "ParallelismConfig with cp_size")
    if trl:
        _require("trl", TRL_MIN, "SFTTrainer's fused LM head and padding-free collator")
