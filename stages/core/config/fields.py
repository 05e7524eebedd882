"""How a config field declares what fingerprints see: `unhashed(...)` for a field that never changes a
stage's output, `hashed_unless_default(...)` for one seen only once it leaves its default, and
`hashed(section)`, a section's values as fingerprints hash them; `_Section` is the base of every
section of the schema (unknown keys refused, assignments validated). The sections themselves are in
actor.py, data.py, eval.py and this package's __init__.py.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

# Its effect on results is the config values, which every fingerprint hashes as data; editing
# a description here must not retrain anything.
__fingerprint__ = False


def unhashed(default: Any = ..., **kw: Any) -> Any:
    """A field that never changes a stage's output: left out of every fingerprint."""
    return Field(default, json_schema_extra={"fingerprint": False}, **kw)


def hashed_unless_default(default: Any = None, **kw: Any) -> Any:
    """A field fingerprints see only when it is set to something else than its default: a key added
    later (a harness set's) leaves the fingerprints of configs that don't use it as they were."""
    return Field(default, json_schema_extra={"fingerprint": "unless_default"}, **kw)


def hashed(section: BaseModel) -> dict:
    """The section as fingerprints see it: JSON values without its `unhashed` fields (nor the
    `hashed_unless_default` ones that hold their default)."""
    out = {}
    for name, field in type(section).model_fields.items():
        rule = (field.json_schema_extra or {}).get("fingerprint")
        if rule is False:
            continue
        value = getattr(section, name)
        if rule == "unless_default" and value == field.default:
            continue
        if isinstance(value, BaseModel):
            out[name] = hashed(value)
        elif isinstance(value, dict) and value and all(isinstance(v, BaseModel) for v in value.values()):
            out[name] = {k: hashed(v) for k, v in value.items()}
        else:
            out[name] = section.model_dump(mode="json", include={name})[name]
    return out


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
