"""What a loss reads from the logits of this rank's tokens, one fp32 number per token.

logits: (B, S_local, V) as the model returns them (any float dtype); labels: (B, S_local) already shifted (the
next token of each position, -100 = not scored). Every quantity is computed in fp32 from ``logits / temperature``
and is 0 where the label is -100. Memory: one fp32 copy of the logits while a quantity is computed (kept for the
backward when the logits require grad), the logits themselves being the forward's own.
"""
from __future__ import annotations

import torch

from hfpatch.inputs import IGNORE_INDEX

__all__ = ["token_log_probs", "token_entropy"]


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    logits = logits.float()
    return logits if temperature == 1 else logits / temperature


def token_log_probs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """(B, S_local) fp32 ``log p(label)`` under ``softmax(logits / temperature)``; 0 where the label is -100."""
    scaled = _scaled(logits, temperature)
    counted = labels != IGNORE_INDEX
    picked = scaled.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (picked - torch.logsumexp(scaled, dim=-1)) * counted


def token_entropy(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """(B, S_local) fp32 entropy of ``softmax(logits / temperature)`` at each scored position; 0 elsewhere."""
    log_p = torch.log_softmax(_scaled(logits, temperature), dim=-1)
    return -(log_p.exp() * log_p).sum(-1) * (labels != IGNORE_INDEX)
