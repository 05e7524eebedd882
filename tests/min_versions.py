"""The oldest versions pyproject.toml admits, as a pip constraints file (`make test-min-versions`).

Each direct runtime dependency's lower bound (`>=X`) becomes `==X`; an exact pin (`torch==2.13.0`)
stays; a dependency without a lower bound is left to the resolver. The dev extra's test tools are
pinned only where pyproject pins them (`==`): the bounds that matter to users are the runtime ones,
and pytest & co. may be whatever resolves beside them. Everything not named in pyproject.toml
(transitive dependencies) resolves to its newest compatible release, as for a user.

    python tests/min_versions.py --constraints OUT   # write the constraints file
    python tests/min_versions.py --check OUT         # the installed versions are exactly those
    python tests/min_versions.py --table             # the tested lower and installed versions (Markdown)

Runs on the interpreter of the venv it checks (standard library + `packaging`, which pip vendors).
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from importlib import metadata
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    from packaging.version import Version
except ImportError:  # a bare venv: pip's own copy
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name
    from pip._vendor.packaging.version import Version

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def requirements(pyproject: Path = PYPROJECT, extra: str = "dev") -> list[tuple[Requirement, bool]]:
    """(requirement, is a runtime dependency) for the project's dependencies, then the extra's."""
    project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
    extras = project.get("optional-dependencies", {})
    runtime = [(Requirement(r), True) for r in project["dependencies"]]
    dev = []
    for r in map(Requirement, extras.get(extra, [])):
        if canonicalize_name(r.name) == canonicalize_name(project["name"]):  # `sftflow[team]`: a user's extra,
            runtime += [(Requirement(x), True) for e in sorted(r.extras) for x in extras.get(e, [])]  # its bounds
        else:
            dev.append((r, False))
    names = {canonicalize_name(r.name) for r, _ in runtime}
    return runtime + [(r, False) for r, _ in dev if canonicalize_name(r.name) not in names]


def lowest(req: Requirement, runtime: bool) -> str | None:
    """The version to test `req` at: its exact pin, else (runtime only) its lower bound."""
    specs = list(req.specifier)
    pins = [s.version for s in specs if s.operator in ("==", "===") and "*" not in s.version]
    if pins:
        return pins[0]
    lower = [s.version for s in specs if s.operator == ">="]
    if runtime and lower:
        if len(lower) > 1:
            raise SystemExit(f"{req}: more than one lower bound")
        if not req.specifier.contains(lower[0], prereleases=True):
            raise SystemExit(f"{req}: its lower bound {lower[0]} is excluded by its own range")
        return lower[0]
    return None


def constraints(pyproject: Path = PYPROJECT) -> dict[str, str]:
    out = {}
    for req, runtime in requirements(pyproject):
        if req.marker is not None and not req.marker.evaluate():
            continue
        version = lowest(req, runtime)
        if version is not None:
            out[canonicalize_name(req.name)] = version
    return out


def read_constraints(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            out[canonicalize_name(name)] = version.strip()
    return out


def installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--constraints", type=Path, help="write the pip constraints file here")
    ap.add_argument("--check", type=Path, help="exit 1 unless the installed versions are this file's")
    ap.add_argument("--table", action="store_true", help="print each direct dependency's bound and installed version")
    args = ap.parse_args(argv)
    if not (args.constraints or args.check or args.table):
        ap.error("give --constraints OUT, --check FILE or --table")
    if args.constraints:
        pins = constraints()
        text = "# Written by tests/min_versions.py from pyproject.toml: each direct dependency's lower bound.\n"
        args.constraints.write_text(text + "".join(f"{n}=={v}\n" for n, v in pins.items()), encoding="utf-8")
        print(f"{args.constraints}: {len(pins)} pins: " + ", ".join(f"{n}=={v}" for n, v in pins.items()))
    if args.check:
        wrong = [f"{n}: wants {v}, installed {installed(n)}" for n, v in read_constraints(args.check).items()
                 if installed(n) is None or Version(Version(installed(n)).public) != Version(v)]
        if wrong:
            print("not the tested versions:\n  " + "\n  ".join(wrong), file=sys.stderr)
            return 1
        print(f"installed versions are {args.check}'s")
    if args.table:
        print("| dependency | declared | installed here |\n| --- | --- | --- |")
        for req, runtime in requirements():
            print(f"| {req.name}{'' if runtime else ' (dev)'} | `{req.specifier}` | {installed(req.name) or '-'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
