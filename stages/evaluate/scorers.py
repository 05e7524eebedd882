"""Scorers: (prediction, reference) -> bool."""

from __future__ import annotations


def exact(prediction: str, reference: str) -> bool:
    """Exact match after stripping surrounding whitespace."""
    return prediction.strip() == reference.strip()


SCORERS = {"exact": exact}
