"""The before/after table of an evaluation, one row per eval set (pure data; the CLI, the Prefect
summary and the README render it)."""

from __future__ import annotations

COLUMNS = ("set", "samples", "base", "tuned", "change (95% CI)", "vs champion (95% CI)", "guard", "kept of base-right")


def fmt(v: float | None, signed: bool = False) -> str:
    if v is None:
        return "n/a"
    return f"{v:+.3f}" if signed else f"{v:.3f}"


def change(c: dict | None, delta: float | None = None) -> str:
    """`+0.040 [-0.020, +0.100]` for a paired comparison; the bare delta without per-item records."""
    if c is None or "delta_low" not in c:
        return fmt(delta if c is None else c.get("delta", delta), signed=True)
    return f"{c['delta']:+.3f} [{c['delta_low']:+.3f}, {c['delta_high']:+.3f}]"


def set_rows(metrics: dict, champion: dict[str, dict] | None = None) -> list[dict]:
    """[{set, n, base, tuned, delta, change, champion, guard}] for an evaluate stage's metrics (and
    register's comparison with the champion, per set); one row ("val") without named sets.
    `base`/`delta` are None when the base model was not scored; `champion` is "" without a champion
    to compare with; `guard` is "" for an unguarded set, else "ok" or "failed" with its rule."""
    sets = metrics["sets"]
    rows = []
    for name, m in sets.items():
        base = m.get("base_accuracy")
        delta = None if base is None else m["accuracy"] - base
        vc = (champion or {}).get(name)
        guard = "" if "guard_ok" not in m else ("ok" if m["guard_ok"] else "failed")
        if guard:
            on = " on the 95% lower bound" if m.get("decided_on") == "interval" else ""
            guard += f" (max drop {m['max_drop']:g}{on})"
        rows.append({"set": name, "n": m.get("total"), "base": base, "tuned": m.get("accuracy"), "delta": delta,
                     "change": change(m.get("vs_base"), delta) if base is not None else "n/a",
                     "champion": "" if vc is None else f"v{vc['version']} {fmt(vc['accuracy'])}: {change(vc)}",
                     "guard": guard, "kept": kept(m.get("vs_base"))})
    return rows


def kept(c: dict | None) -> str:
    """`207/244 (0.848)`: of the items the base model got right, how many the tuned model kept (a
    diagnostic: a set selected on the base model's success can only lose, docs/evaluation.md)."""
    if not c or not c.get("reference_right"):
        return ""
    return f"{c['both_right']}/{c['reference_right']} ({c['kept']:.3f})"


def table_cells(metrics: dict, champion: dict[str, dict] | None = None) -> list[list[str]]:
    """`set_rows` as text cells in `COLUMNS` order: what the console and the markdown summary print."""
    return [[r["set"], str(r["n"]), fmt(r["base"]), fmt(r["tuned"]), r["change"], r["champion"] or "none", r["guard"],
             r["kept"]] for r in set_rows(metrics, champion)]
