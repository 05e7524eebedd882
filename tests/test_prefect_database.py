"""A new Prefect home's database is a copy of one a server built (flows/servers/prefect_database.py): when it is
copied, when it is kept as the template, and when Prefect is left to build it. The servers themselves
are in tests/test_kept_server.py (a user's first call builds and keeps it, the next new home copies it)."""

import sqlite3
from contextlib import closing

import pytest

from flows.servers import prefect_database as pdb


def database(path, runs: int = 0):
    with closing(sqlite3.connect(path)) as con, con:
        con.execute("CREATE TABLE flow_run (id TEXT)")
        con.execute("CREATE TABLE block_type (id TEXT)")
        con.execute("INSERT INTO block_type VALUES ('b1')")
        con.executemany("INSERT INTO flow_run VALUES (?)", [(str(i),) for i in range(runs)])
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "sftflow"


def test_a_new_home_gets_the_template_and_a_home_with_a_database_keeps_its_own(tmp_path, cache):
    home = tmp_path / "home"
    home.mkdir()
    assert not pdb.seed(home, {})  # no template yet: the server builds it
    cache.mkdir(parents=True)
    database(pdb.template_path())
    assert pdb.seed(home, {}) and (home / pdb.DATABASE).read_bytes() == pdb.template_path().read_bytes()
    (home / pdb.DATABASE).write_bytes(b"its own")
    assert not pdb.seed(home, {}) and (home / pdb.DATABASE).read_bytes() == b"its own"
    assert not list(home.glob(".*.part"))


@pytest.mark.parametrize("env", [{"SFTFLOW_PREFECT_TEMPLATE": "0"},
                                 {"PREFECT_API_DATABASE_CONNECTION_URL": "postgresql+asyncpg://x/y"},
                                 {"PREFECT_SERVER_DATABASE_CONNECTION_URL": "postgresql+asyncpg://x/y"}])
def test_another_database_or_the_switch_leaves_it_to_prefect(tmp_path, cache, env):
    cache.mkdir(parents=True)
    database(pdb.template_path())
    home = tmp_path / "home"
    home.mkdir()
    assert not pdb.seed(home, env) and not (home / pdb.DATABASE).exists()
    database(home / pdb.DATABASE)
    pdb.template_path().unlink()
    pdb.keep_template(home, env)
    assert not pdb.template_path().exists()


def test_a_built_database_becomes_the_template_once_and_only_before_any_run(tmp_path, cache):
    home = tmp_path / "home"
    home.mkdir()
    database(home / pdb.DATABASE, runs=1)
    pdb.keep_template(home, {})
    assert not pdb.template_path().exists()  # it ran something already: not a new database
    (home / pdb.DATABASE).unlink()
    database(home / pdb.DATABASE)
    pdb.keep_template(home, {})
    with closing(sqlite3.connect(pdb.template_path())) as con:
        assert con.execute("SELECT id FROM block_type").fetchall() == [("b1",)]
    first = pdb.template_path().stat().st_mtime_ns
    pdb.keep_template(home, {})  # one exists: left as it is
    assert pdb.template_path().stat().st_mtime_ns == first
