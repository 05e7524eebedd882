"""A new SQLite tracking store (the default `<artifacts>/mlflow.db`), created from a migrated copy.

MLflow creates a store's tables by running every Alembic migration since its first release: 2-4 s
of one core on a 2-core machine, paid by the first run in every new artifacts folder (and by each of
the ~50 tests that run the flow in a fresh one). The result is the same file for every store of
one MLflow version except the "Default" experiment's artifact location and timestamps, so it is
built once per MLflow version in the user's cache (`$XDG_CACHE_HOME/sftflow`, else
`~/.cache/sftflow`) and copied, and those three fields are set as MLflow would set them.
tests/test_sqlite_store.py holds a copy equal to a store MLflow created itself, row by row.

Set `SFTFLOW_MLFLOW_TEMPLATE=0` to have MLflow create every store itself.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import tempfile
import time
from contextlib import closing
from pathlib import Path

from stages.core.cache.user_cache import cache_dir

__fingerprint__ = False  # how the tracking store is made never changes a stage folder

DEFAULT_EXPERIMENT_ID = 0  # MLflow's SqlAlchemyStore.DEFAULT_EXPERIMENT_ID


def template_path() -> Path:
    import mlflow
    return cache_dir() / f"mlflow-{mlflow.__version__}.db"


def _build_template(path: Path) -> None:
    """MLflow's own new store, written next to `path` and moved there whole (a concurrent builder
    or reader never sees half a file)."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        db = Path(tmp) / path.name
        store = SqlAlchemyStore(f"sqlite:///{db}", (Path(tmp) / "mlartifacts").as_uri())
        store.engine.dispose()
        os.replace(db, path)


def create_sqlite_store(db: Path, artifact_root: str) -> None:
    """A new, empty tracking store at `db` whose "Default" experiment keeps its artifacts under
    `artifact_root`, as `SqlAlchemyStore(f"sqlite:///{db}", artifact_root)` would create it."""
    db = Path(db)
    if os.environ.get("SFTFLOW_MLFLOW_TEMPLATE", "1") == "0":
        _mlflow_creates(db, artifact_root)
        return
    try:
        template = template_path()
        if not template.is_file():
            _build_template(template)
        part = db.with_name(f".{db.name}.{os.getpid()}.part")
        shutil.copyfile(template, part)
        now = int(time.time() * 1000)
        with closing(sqlite3.connect(part)) as con, con:
            con.execute("UPDATE experiments SET artifact_location = ?, creation_time = ?, last_update_time = ? "
                        "WHERE experiment_id = ?", (_default_location(artifact_root), now, now,
                                                    DEFAULT_EXPERIMENT_ID))
        os.replace(part, db)
    except (OSError, sqlite3.Error):  # an unwritable cache, a template of another schema: MLflow's way
        _mlflow_creates(db, artifact_root)


def _default_location(artifact_root: str) -> str:
    from mlflow.utils.uri import append_to_uri_path
    from mlflow.utils.uri import resolve_uri_if_local
    return append_to_uri_path(resolve_uri_if_local(artifact_root), str(DEFAULT_EXPERIMENT_ID))


def _mlflow_creates(db: Path, artifact_root: str) -> None:
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore
    SqlAlchemyStore(f"sqlite:///{db}", artifact_root).engine.dispose()
