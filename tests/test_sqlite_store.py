"""A tracking store copied from the migrated template is the store MLflow creates itself.

The reference is MLflow's own `SqlAlchemyStore` on a new file; the copy must have the same schema,
the same Alembic revision and the same rows, timestamps aside, and work as a store (MLflow opens it
without migrating, runs and the registry write into it)."""

import sqlite3
import time
from contextlib import closing
from pathlib import Path

import pytest

from stages.tracking import sqlite_store
from stages.tracking.sqlite_store import create_sqlite_store

TIMES = {"creation_time", "last_update_time"}


def clauses(sql: str | None) -> list[str] | None:
    """A CREATE statement's clauses, sorted: MLflow's migrations write a table's CHECK constraints in
    an order that differs between two stores it creates itself (Alembic's batch mode)."""
    return None if sql is None else sorted(line.strip().rstrip(",") for line in sql.splitlines())


def dump(db: Path) -> tuple[list, dict]:
    with closing(sqlite3.connect(db)) as con:
        schema = sorted(((t, n, tbl, clauses(sql)) for t, n, tbl, sql in
                         con.execute("SELECT type, name, tbl_name, sql FROM sqlite_master")),
                        key=lambda r: (r[0], r[1]))
        rows = {}
        for (table,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'"):
            cur = con.execute(f'SELECT * FROM "{table}"')
            cols = [c[0] for c in cur.description]
            rows[table] = sorted(tuple((c, v) for c, v in zip(cols, r) if c not in TIMES) for r in cur.fetchall())
    return schema, rows


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("SFTFLOW_MLFLOW_TEMPLATE", raising=False)
    return tmp_path / "cache" / "sftflow"


def test_a_copied_store_equals_the_one_mlflow_creates(tmp_path, cache):
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore
    root = (tmp_path / "a" / "mlartifacts").as_uri()
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    SqlAlchemyStore(f"sqlite:///{tmp_path / 'a' / 'mlflow.db'}", root).engine.dispose()
    before = time.time() * 1000
    create_sqlite_store(tmp_path / "b" / "mlflow.db", root)
    assert sqlite_store.template_path().is_file() and sqlite_store.template_path().parent == cache
    mine, theirs = dump(tmp_path / "b" / "mlflow.db"), dump(tmp_path / "a" / "mlflow.db")
    assert mine == theirs
    assert theirs[1]["experiments"][0][0] == ("experiment_id", 0)  # the rows compared do hold "Default"
    assert (dict(theirs[1]["experiments"][0])["artifact_location"] == f"{root}/0")
    with closing(sqlite3.connect(tmp_path / "b" / "mlflow.db")) as con:  # its own time, not the template's
        created = con.execute("SELECT creation_time FROM experiments WHERE experiment_id = 0").fetchone()[0]
    assert created >= before - 1000
    assert not list((tmp_path / "b").glob(".*.part"))


def test_a_copied_store_is_used_as_mlflow_uses_its_own(tmp_path, cache):
    """The second store in a new folder is copied (the template exists): runs, metrics and a
    registered model go into it through MLflow's client."""
    from mlflow.tracking import MlflowClient
    for name in ("first", "second"):
        (tmp_path / name).mkdir()
        create_sqlite_store(tmp_path / name / "mlflow.db", (tmp_path / name / "mlartifacts").as_uri())
    client = MlflowClient(f"sqlite:///{tmp_path / 'second' / 'mlflow.db'}")
    exp = client.create_experiment("e", artifact_location=(tmp_path / "second" / "mlartifacts").as_uri())
    run = client.create_run(exp)
    client.log_metric(run.info.run_id, "loss", 0.5, step=1)
    client.create_registered_model("m")
    assert client.get_metric_history(run.info.run_id, "loss")[0].value == 0.5
    assert client.get_experiment("0").artifact_location == (tmp_path / "second" / "mlartifacts").as_uri() + "/0"
    assert [m.name for m in client.search_registered_models()] == ["m"]


def test_an_unusable_cache_falls_back_to_mlflow(tmp_path, monkeypatch):
    (tmp_path / "cache").write_text("a file where the cache folder would go")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    create_sqlite_store(tmp_path / "mlflow.db", (tmp_path / "mlartifacts").as_uri())
    from mlflow.tracking import MlflowClient
    assert MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_experiment("0").name == "Default"
