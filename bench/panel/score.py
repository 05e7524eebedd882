"""The panel's scorer for references that say what a reply must hold and what it must not:
`eval.sets.<set>.scorer: bench.panel.score:has_and_lacks` (importable with the repository on PYTHONPATH).

A reference is one requirement a line: a plain line must occur in the reply as `contains` finds it
(normalized, whole words), a line starting with "!" must not. "14 hours\n!10 hours" is right for
"The Nova 3S lasts 14 hours" and wrong for "14 hours, or 10 hours on the Nova 3": a confusable fact
is only known when the other item's value is absent. A reference without a "!" line is `contains`.
"""

from __future__ import annotations

from stages.evaluate.scorers import contains


def requirements(reference: str) -> tuple[list[str], list[str]]:
    """(lines that must occur, lines that must not) of a reference; a reference with neither is an error,
    since it would accept every reply."""
    lines = [ln.strip() for ln in reference.splitlines() if ln.strip()]
    has = [ln for ln in lines if not ln.startswith("!")]
    lacks = [ln[1:].strip() for ln in lines if ln.startswith("!") and ln[1:].strip()]
    if not has and not lacks:
        raise ValueError(f"reference {reference!r} holds no requirement")
    return has, lacks


def has_and_lacks(prediction: str, reference: str) -> bool:
    has, lacks = requirements(reference)
    return all(contains(prediction, h) for h in has) and not any(contains(prediction, x) for x in lacks)
