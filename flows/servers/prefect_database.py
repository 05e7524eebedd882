"""A new Prefect home's database, copied from one a server of this Prefect version already built.

Prefect's home lives in the config's artifacts folder, so the first run in every new artifacts folder
started a server on an empty database, which then ran every migration since Prefect 2.0 and registered
its block types: 8-10 s of a first run's ~35 s of fixed cost on 2 cores (docs/benchmarks.md, "A run's
fixed cost"). The first server that builds a database on this machine leaves a copy of it, made as
soon as it answers (SQLite's online backup: consistent while the server writes), in the user's cache
(`$XDG_CACHE_HOME/sftflow`, else `~/.cache/sftflow`), one per Prefect version; a server on a new home
then starts from a copy. Nothing in that database names its home. The test suite seeds its homes
the same way (tests/conftest.py) and tests/test_kept_server.py holds the two roads equal.

Only Prefect's default database (SQLite in the home) is copied: a home whose server is told another
database (`PREFECT_API_DATABASE_CONNECTION_URL` or `PREFECT_SERVER_DATABASE_CONNECTION_URL`) is left
to Prefect. `SFTFLOW_PREFECT_TEMPLATE=0` leaves every new database to Prefect too.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
from contextlib import closing
from importlib.metadata import version
from pathlib import Path
from typing import Mapping

from stages.core.cache.user_cache import cache_dir

DATABASE = "prefect.db"  # in a Prefect home: its local server's database (Prefect's default)
SWITCH = "SFTFLOW_PREFECT_TEMPLATE"
_OTHER_DATABASE = ("PREFECT_API_DATABASE_CONNECTION_URL", "PREFECT_SERVER_DATABASE_CONNECTION_URL")


def template_path() -> Path:
    return cache_dir() / f"prefect-{version('prefect')}.db"


def applies(env: Mapping[str, str]) -> bool:
    return env.get(SWITCH, "1") != "0" and not any(env.get(k) for k in _OTHER_DATABASE)


def seed(home: Path, env: Mapping[str, str]) -> bool:
    """Copies the template into `home` when it has no database yet; True when it did (the caller starts
    its server under the home's start lock, so no server of this home runs meanwhile)."""
    db = home / DATABASE
    if not applies(env) or db.exists():
        return False
    try:
        template = template_path()
        if not template.is_file():
            return False
        part = home / f".{DATABASE}.{os.getpid()}.part"
        shutil.copyfile(template, part)
        os.replace(part, db)
        return True
    except OSError:  # an unreadable cache: the server builds the database itself
        return False


def keep_template(home: Path, env: Mapping[str, str]) -> None:
    """After a server built `home`'s database from nothing and answers: a copy of it as the template,
    unless one exists. Never fails the call that built it."""
    if not applies(env):
        return
    try:
        template = template_path()
        if template.is_file() or not (home / DATABASE).is_file():
            return
        template.parent.mkdir(parents=True, exist_ok=True)
        part = template.with_name(f".{template.name}.{os.getpid()}.part")
        with closing(sqlite3.connect(home / DATABASE)) as src, closing(sqlite3.connect(part)) as dst:
            src.backup(dst)
        if _runs(part):  # built by a server that already ran something: not a new database
            part.unlink()
            return
        os.replace(part, template)
    except (OSError, sqlite3.Error):
        pass


def _runs(db: Path) -> int:
    with closing(sqlite3.connect(db)) as con:
        try:
            return con.execute("SELECT count(*) FROM flow_run").fetchone()[0]
        except sqlite3.Error:
            return 0
