"""Tokens held to ``generate``'s up to a near-tie: where two ways' arithmetic rounds otherwise
(other attention kernels, other experts' sums), greedy tokens may part where two scores all
but tie, and after that each continues from its own token."""

from __future__ import annotations

from typing import Any


def parted_beyond_a_tie(out: Any, ref: Any, prompt: int, tie: float) -> str | None:
    """Where ``out``'s tokens first part from ``generate``'s (``ref``, returned with its
    scores), the row, step and how far below generate's best score ``out``'s token was, if by
    ``tie`` or more; None where each row's tokens are generate's up to a near-tie (nothing
    after a parting is compared)."""
    for row in range(out.shape[0]):
        parted = (out[row, prompt:] != ref.sequences[row, prompt:]).nonzero()
        if len(parted):
            step = int(parted[0])
            scores = ref.scores[step][row].float()
            below = float(scores.max() - scores[out[row, prompt + step]])
            if below >= tie:
                return f"row {row} parts from generate at step {step}, {below:.3f} below its best"
    return None
