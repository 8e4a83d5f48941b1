"""The error every ring_kernels function raises for bad input (exported as ``ring_kernels.RingInputError``)."""
from __future__ import annotations

from typing import Optional

__all__ = ["RingInputError"]


class RingInputError(ValueError):
    """Bad input to a ring_kernels function (or a bad option); the message says what was given and what is
    required.

    ``argument`` names the offending argument (or metadata field, or environment variable) and ``value`` holds
    what was given, when the check knows them (None otherwise), so callers can react without parsing the message.
    """

    def __init__(self, message: str, *, argument: Optional[str] = None, value=None):
        super().__init__(message)
        self.argument = argument
        self.value = value
