"""The before/after table of an evaluation, one row per eval set (pure data; the CLI, the Prefect
summary and the README render it)."""

from __future__ import annotations


def set_rows(metrics: dict) -> list[dict]:
    """[{set, n, base, tuned, delta, guard}] for an evaluate stage's metrics; one row ("val") without
    named sets. `base`/`delta` are None when the base model was not scored; `guard` is "" for an
    unguarded set, else "ok" or "failed"."""
    sets = metrics.get("sets") or {"val": metrics}
    rows = []
    for name, m in sets.items():
        base = m.get("base_accuracy")
        guard = "" if "guard_ok" not in m else ("ok" if m["guard_ok"] else "failed")
        rows.append({"set": name, "n": m.get("total"), "base": base, "tuned": m.get("accuracy"),
                     "delta": None if base is None else m["accuracy"] - base,
                     "guard": guard + (f" (max drop {m['max_drop']})" if guard else "")})
    return rows


def fmt(v: float | None, signed: bool = False) -> str:
    if v is None:
        return "n/a"
    return f"{v:+.3f}" if signed else f"{v:.3f}"
