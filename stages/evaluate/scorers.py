"""Scorers: (prediction, reference) -> bool. Pure Python; see docs/evaluation.md.

`eval.scorer` names a builtin below or a custom function as "pkg.module:fn". The regex and
numeric scorers read `eval.answer_pattern` and `eval.numeric_tolerance`; `get_scorer`
binds them, so every scorer the evaluator calls takes just (prediction, reference).
"""

from __future__ import annotations

import math
import re
import string
import unicodedata
from functools import partial
from typing import Callable

from stages.core.config import DEFAULT_ANSWER_PATTERN
from stages.core.errors import ConfigError
from stages.core.cache.imports import import_object

Scorer = Callable[[str, str], bool]
NUMBER = re.compile(r"-?(?:\d[\d,]*(?:\.\d+)?|\.\d+)")


def normalize(text: str) -> str:
    """Lower case, punctuation removed (ASCII and Unicode), whitespace runs collapsed to one space."""
    text = "".join(" " if (ch in string.punctuation or unicodedata.category(ch).startswith("P")) else ch
                   for ch in text.lower())
    return " ".join(text.split())


def exact(prediction: str, reference: str) -> bool:
    """Exact match after stripping surrounding whitespace."""
    return prediction.strip() == reference.strip()


def normalized(prediction: str, reference: str) -> bool:
    """Equal after `normalize` (case, punctuation, whitespace)."""
    return normalize(prediction) == normalize(reference)


_UNSPACED_SCRIPTS = ("CJK", "HIRAGANA", "KATAKANA", "THAI", "LAO", "KHMER", "MYANMAR", "TIBETAN")


def _unspaced(ch: str) -> bool:
    """A character of a script written without spaces between words (Chinese, Japanese, Thai, ...)."""
    return ch.isalpha() and unicodedata.name(ch, "").startswith(_UNSPACED_SCRIPTS)


def _word_edge(neighbor: str, edge: str) -> bool:
    return not neighbor.isalnum() or _unspaced(neighbor) or _unspaced(edge)


def contains(prediction: str, reference: str) -> bool:
    """The normalized reference occurs in the normalized prediction as whole words (an empty reference
    never matches). Words end at spaces and punctuation, and at the edge of a script written without
    spaces: "Lumen" is found in "我是Lumen" but not in "Lumens"."""
    ref, pred = normalize(reference), normalize(prediction)
    if not ref:
        return False
    for m in re.finditer(re.escape(ref), pred):
        before = pred[m.start() - 1] if m.start() > 0 else " "
        after = pred[m.end()] if m.end() < len(pred) else " "
        if _word_edge(before, ref[0]) and _word_edge(after, ref[-1]):
            return True
    return False


def extract(text: str, pattern: str) -> str | None:
    """The last match of `pattern` in text: its first group if it has one, else the whole match."""
    matches = list(re.finditer(pattern, text))
    if not matches:
        return None
    m = matches[-1]
    return (m.group(1) if m.re.groups else m.group(0)).strip()


def regex(prediction: str, reference: str, pattern: str = DEFAULT_ANSWER_PATTERN) -> bool:
    """The answers `pattern` extracts from both are equal; a reference without a match is used whole.
    A prediction without a match is wrong."""
    got = extract(prediction, pattern)
    want = extract(reference, pattern)
    return got is not None and got == (want if want is not None else reference.strip())


def parse_number(text: str, pattern: str = DEFAULT_ANSWER_PATTERN) -> float | None:
    """The number `pattern` extracts, else the last number in the text; thousands commas ignored."""
    found = extract(text, pattern)
    candidates = NUMBER.findall(found if found is not None else text)
    if not candidates:
        return None
    try:
        return float(candidates[-1].replace(",", ""))
    except ValueError:
        return None


def numeric(prediction: str, reference: str, pattern: str = DEFAULT_ANSWER_PATTERN, tolerance: float = 1e-6) -> bool:
    """Both parse to numbers (see `parse_number`) that agree within `tolerance`, relative or absolute."""
    got, want = parse_number(prediction, pattern), parse_number(reference, pattern)
    return got is not None and want is not None and math.isclose(got, want, rel_tol=tolerance, abs_tol=tolerance)


SCORERS: dict[str, Callable[..., bool]] = {
    "exact": exact, "normalized": normalized, "contains": contains, "regex": regex, "numeric": numeric,
}


def load_custom(path: str) -> Scorer:
    fn = import_object(path, "eval.scorer")
    if not callable(fn):
        raise ConfigError(f"eval.scorer='{path}' is not callable")
    return fn


def get_scorer(name: str, answer_pattern: str = DEFAULT_ANSWER_PATTERN, numeric_tolerance: float = 1e-6) -> Scorer:
    """The (prediction, reference) -> bool function `eval.scorer` names, configured; a custom one that
    can't be imported is a ConfigError."""
    if name == "regex":
        return partial(regex, pattern=answer_pattern)
    if name == "numeric":
        return partial(numeric, pattern=answer_pattern, tolerance=numeric_tolerance)
    if name in SCORERS:
        return SCORERS[name]
    fn = load_custom(name)
    return lambda prediction, reference: bool(fn(prediction, reference))
