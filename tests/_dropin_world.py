"""One gloo world per world size for BOTH drop-in test files (ring-flash-attn and axolotl).

Starting a rank costs ~8 CPU-seconds of imports (torch, transformers, the model classes); two files with two
worlds each would spend most of their budget there. So each world size runs once per pytest session, the
ring-flash-attn part first, then the axolotl part; each file's test asks for the outcome of its own part.
A failing part stops the world (the ranks would otherwise wait on each other's collectives): the parts after it
report "not run" with the failure, never a pass.
"""
from __future__ import annotations

from typing import Dict, Optional

from _dist import DistributedFailure, run_world

PARTS = ("ring_flash_attn", "axolotl")
_FUNCTIONS = {"ring_flash_attn": "_rfa_part", "axolotl": "_axolotl_part"}
_outcomes: Dict[int, Optional[str]] = {}


def _both(rank: int, world: int) -> None:
    import test_dropin_axolotl
    import test_dropin_ring_flash_attn

    test_dropin_ring_flash_attn._rfa_part(rank, world)
    test_dropin_axolotl._axolotl_part(rank, world)


def failure_of(part: str, world: int) -> Optional[str]:
    """None when ``part`` passed in the ``world``-rank world (run on first request), else why it did not."""
    if world not in _outcomes:
        try:
            run_world(world, _both)
            _outcomes[world] = None
        except DistributedFailure as exc:
            _outcomes[world] = str(exc)
    failure = _outcomes[world]
    if failure is None:
        return None
    failed = next((p for p in reversed(PARTS) if _FUNCTIONS[p] in failure), PARTS[0])
    if part == failed:
        return failure
    if PARTS.index(part) < PARTS.index(failed):
        return None  # it ran to the end before the failing part started
    return f"not run: the {failed} part failed first in the same {world}-rank world:\n{failure}"
