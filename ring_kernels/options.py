"""Process-wide options of ring_kernels: one validated object, set in code, the environment only an override.

The options and their environment variables (the one place they are documented):

- ``transport`` (``RING_KERNELS_TRANSPORT``, default "nccl"): how ring steps move K/V between GPUs: "nccl"
  (NCCL/gloo P2P) or "copy_engine" (CUDA copy engines over symmetric memory). Off CUDA the ring always uses
  P2P (``transport.make_exchange``).
- ``copy_engine_signal`` (``RING_KERNELS_CE_SIGNAL``, default "barrier"): how copy-engine exchanges signal
  their peers: "barrier" (a one-block kernel, with a timeout) or "stream_memop" (no SM used, no timeout).
- ``fused_merge`` (``RING_KERNELS_FUSED_MERGE``, 0 or 1, default True): the Triton kernel for the LSE merges
  on CUDA (``merge``); False: eager PyTorch (the same formula).
- ``skip_rank_check`` (``RING_KERNELS_SKIP_RANK_CHECK``, 0 or 1, default False): skip the per-call cross-rank
  shape check (``validation.check_ranks_agree``: one small all_gather and a host sync per call); for
  benchmarks of a known-good setup only.
- ``forward_yield_us`` (``RING_KERNELS_FORWARD_YIELD_US``, 0 to 1000, default 25.0): microseconds the ring
  forward holds the CUDA compute stream after issuing its first K/V transfer, so that the transfer's kernel
  is resident before the first attention kernel fills every SM (``engine.yield_to_transfer``); 0 turns it off.

Which value is in effect (``get_options()``), most specific first:

1. the innermost ``with use_options(**changes):`` of this thread / async task (a ``contextvars`` scope);
2. the process-wide options, changed with ``set_options(**changes)`` (returns the previous ones);
3. the environment: a variable that is set and not blank overrides that field's default. The environment is
   read once, at the first ``get_options()`` (in practice the first kernel call), and again after
   ``reload_environment()``, which also drops what ``set_options`` changed. A bad value raises ``RingInputError``
   naming the variable, at every use until it is fixed (it is never cached);
4. the defaults above (``RingOptions()``).

Every value is validated when a ``RingOptions`` is built (by the constructor, ``set_options``, ``use_options``
or from the environment): a wrong type is a ``TypeError``, a wrong value a ``RingInputError`` (a ``ValueError``)
naming the field, the value and what is allowed.
"""
from __future__ import annotations

import contextvars
import dataclasses
import math
import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Mapping, Optional

from .errors import RingInputError

__all__ = ["RingOptions", "get_options", "set_options", "use_options", "reload_environment", "ENVIRONMENT"]

TRANSPORTS = ("nccl", "copy_engine")
SIGNALS = ("barrier", "stream_memop")
MAX_FORWARD_YIELD_US = 1000.0

# field -> environment variable that overrides its default
ENVIRONMENT = {
    "transport": "RING_KERNELS_TRANSPORT",
    "copy_engine_signal": "RING_KERNELS_CE_SIGNAL",
    "fused_merge": "RING_KERNELS_FUSED_MERGE",
    "skip_rank_check": "RING_KERNELS_SKIP_RANK_CHECK",
    "forward_yield_us": "RING_KERNELS_FORWARD_YIELD_US",
}


@dataclass(frozen=True)
class RingOptions:
    """The options of ring_kernels (see the module docstring for each field's meaning and variable)."""

    transport: str = "nccl"
    copy_engine_signal: str = "barrier"
    fused_merge: bool = True
    skip_rank_check: bool = False
    forward_yield_us: float = 25.0

    def __post_init__(self):
        _check_choice("transport", self.transport, TRANSPORTS)
        _check_choice("copy_engine_signal", self.copy_engine_signal, SIGNALS)
        for name in ("fused_merge", "skip_rank_check"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"RingOptions: {name}={getattr(self, name)!r} must be a bool (True or False)")
        us = self.forward_yield_us
        if isinstance(us, bool) or not isinstance(us, (int, float)):
            raise TypeError(f"RingOptions: forward_yield_us={us!r} must be a number of microseconds")
        if math.isnan(us) or not 0.0 <= us <= MAX_FORWARD_YIELD_US:
            raise RingInputError(f"RingOptions: forward_yield_us={us!r} must be between 0 and "
                                 f"{MAX_FORWARD_YIELD_US:g} microseconds (0 turns the pause off)",
                                 argument="forward_yield_us", value=us)
        object.__setattr__(self, "forward_yield_us", float(us))

    def replace(self, **changes) -> "RingOptions":
        """A copy with ``changes`` (validated); an unknown field name is a ``TypeError`` listing the fields."""
        unknown = sorted(set(changes) - set(ENVIRONMENT))
        if unknown:
            raise TypeError(f"RingOptions has no field {', '.join(map(repr, unknown))}; its fields are "
                            f"{', '.join(ENVIRONMENT)}")
        return dataclasses.replace(self, **changes)


def _check_choice(name: str, value, choices) -> None:
    if not isinstance(value, str):
        raise TypeError(f"RingOptions: {name}={value!r} must be a str, one of {choices}")
    if value not in choices:
        raise RingInputError(f"RingOptions: {name}={value!r} is not one of {choices}", argument=name, value=value)


def _parse(field: str, variable: str, raw: str, default):
    """The value of ``field`` given as ``raw`` in ``variable``; RingInputError naming the variable otherwise."""
    if isinstance(default, bool):
        if raw in ("0", "1"):
            return raw == "1"
        allowed = "0 or 1"
    elif isinstance(default, float):
        try:
            value = float(raw)
        except ValueError:
            value = None
        if value is not None and 0.0 <= value <= MAX_FORWARD_YIELD_US:
            return value
        allowed = f"a number of microseconds between 0 and {MAX_FORWARD_YIELD_US:g} (e.g. 20)"
    else:
        choices = TRANSPORTS if field == "transport" else SIGNALS
        if raw in choices:
            return raw
        allowed = f"one of {choices}"
    raise RingInputError(f"environment variable {variable}={raw!r} is not {allowed}; set it to one of them or "
                         f"unset it (default: {_shown(default)})", argument=variable, value=raw)


def _shown(default) -> str:
    return str(int(default)) if isinstance(default, bool) else f"{default:g}" if isinstance(default, float) \
        else str(default)


def from_environment(environ: Optional[Mapping[str, str]] = None) -> RingOptions:
    """The defaults with every variable of ``ENVIRONMENT`` that is set (and not blank) in ``environ``
    (default ``os.environ``) applied."""
    environ = os.environ if environ is None else environ
    defaults = RingOptions()
    changes = {}
    for field, variable in ENVIRONMENT.items():
        raw = environ.get(variable, "").strip()
        if raw:
            changes[field] = _parse(field, variable, raw, getattr(defaults, field))
    return defaults.replace(**changes) if changes else defaults


_PROCESS: Optional[RingOptions] = None          # None: not resolved yet (the environment is read at first use)
_SCOPED: contextvars.ContextVar[Optional[RingOptions]] = contextvars.ContextVar("ring_kernels_options",
                                                                               default=None)


def _process_wide() -> RingOptions:
    global _PROCESS
    if _PROCESS is None:
        _PROCESS = from_environment()               # raises on a bad value: nothing stored, raises again next use
    return _PROCESS


def get_options() -> RingOptions:
    """The options in effect here and now (cheap: read on every kernel call)."""
    scoped = _SCOPED.get()
    if scoped is not None:
        return scoped
    return _PROCESS if _PROCESS is not None else _process_wide()


def set_options(**changes) -> RingOptions:
    """Change the process-wide options (validated before anything changes); returns the previous ones, so that
    ``set_options(**dataclasses.asdict(previous))`` restores them. Scopes of ``use_options`` still win inside."""
    global _PROCESS
    previous = _process_wide()
    _PROCESS = previous.replace(**changes)
    return previous


@contextmanager
def use_options(**changes) -> Iterator[RingOptions]:
    """Within the block (this thread / async task only), the options in effect with ``changes`` applied."""
    token = _SCOPED.set(get_options().replace(**changes))
    try:
        yield _SCOPED.get()
    finally:
        _SCOPED.reset(token)


def reload_environment() -> None:
    """Forget the process-wide options (``set_options`` included): the next ``get_options()`` reads the
    environment over the defaults again."""
    global _PROCESS
    _PROCESS = None
