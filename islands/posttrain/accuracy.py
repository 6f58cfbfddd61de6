"""How often a model is right: exact match of its answers and preference accuracy of its scores (evaluation).

Pure functions over plain values: the texts a model generated (decoded), the reference answers, and the scores a
model gives the chosen and the rejected answer of each preference pair (DPO's implicit reward, β times the log
probability ratio to the reference model, or any score where higher means preferred).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def answer_text(generated: str, stop: str) -> str:
    """The answer a generation holds: its text up to the stop text (a newline for the built-in tasks), without
    surrounding whitespace."""
    return generated.split(stop, 1)[0].strip()


def exact_matches(generated: Sequence[str], references: Sequence[str], stop: str) -> np.ndarray:
    """bool [N]: whether each generation's answer (`answer_text`) is its reference (stripped) exactly."""
    if len(generated) != len(references):
        raise ValueError(f"{len(generated)} generations for {len(references)} references")
    return np.array([answer_text(g, stop) == r.strip() for g, r in zip(generated, references, strict=True)], bool)


def exact_match(generated: Sequence[str], references: Sequence[str], stop: str) -> float:
    """The share of generations whose answer is exactly their reference (0.0 for no generations)."""
    matches = exact_matches(generated, references, stop)
    return float(matches.mean()) if matches.size else 0.0


def preference_accuracy(chosen_scores: Sequence[float], rejected_scores: Sequence[float]) -> float:
    """The share of pairs whose chosen answer scores strictly above the rejected one (a tie is not a preference;
    0.0 for no pairs)."""
    chosen = np.asarray(chosen_scores, np.float64)
    rejected = np.asarray(rejected_scores, np.float64)
    if chosen.shape != rejected.shape or chosen.ndim != 1:
        raise ValueError(f"chosen scores {chosen.shape} and rejected scores {rejected.shape} must be one per pair")
    return float((chosen > rejected).mean()) if chosen.size else 0.0
