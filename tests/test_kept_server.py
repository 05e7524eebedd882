"""The kept Prefect server (flows/servers/prefect_server.py): a CLI call without PREFECT_API_URL starts
one in the background, later calls on the same Prefect home run on it, and it stops by itself
once no call has used it for SFTFLOW_KEEP_SERVER seconds. Real processes, real servers on
loopback; the effects are checked in the server's database and with psutil. A test's Prefect home
starts from a copy of the test run's Prefect database (conftest `seed_prefect_home`), as the homes of
`sftflow(...)` calls do; the last test checks that copy against the database a user's first call builds."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest

from conftest import (PREFECT_DATABASE, descendants, flow_runs, left_alive, prefect_database, seed_prefect_home,
                      sftflow, tiny_config_dict, write_config)
from flows.servers.prefect_server import RUNNING_SERVER, healthy, lease, start_kept_server


pytestmark = pytest.mark.slow  # real Prefect servers


def _marker(home):
    return json.loads((home / RUNNING_SERVER).read_text())


def _tree(pid):
    """The keeper and its descendants (the server)."""
    return [psutil.Process(pid), *descendants(pid)]


def test_later_calls_run_on_the_kept_server_and_it_stops_once_unused(tmp_path):
    cfg_path = write_config(tmp_path, tiny_config_dict(tmp_path))
    home = tmp_path / ".prefect"
    env = {"PREFECT_API_URL": None, "SFTFLOW_KEEP_SERVER": "8"}
    seed_prefect_home(home)
    # the test holds the lease between the calls, as a third call would: on a loaded machine the gap
    # between two calls may exceed the 8 s idle time, which would (rightly) stop the server
    with lease(home):
        first = sftflow("stage", "prepare", "-c", str(cfg_path), cwd=tmp_path, env=env)
        assert first.returncode == 0, first.stderr[-3000:]
        kept = _marker(home)
        assert kept["kind"] == "kept" and healthy(kept["api"])
        tree = _tree(kept["pid"])  # the keeper outlived the call that started it, and so did its server
        assert len(tree) >= 2

        second = sftflow("stage", "prepare", "-c", str(cfg_path), cwd=tmp_path, env=env)
        assert second.returncode == 0, second.stderr[-3000:]
        assert _marker(home) == kept, "the second call started no server of its own"
        assert len(flow_runs(kept["api"])) == 2, "both calls' flow runs are in the kept server's database"
        assert not (home / "temporary-server.log").exists()

    assert left_alive(tree, 8 + 30) == [], "the keeper and its server stop once unused for SFTFLOW_KEEP_SERVER s"
    assert not (home / RUNNING_SERVER).exists() and not healthy(kept["api"])


def test_a_call_holding_the_lease_keeps_the_server_up(tmp_path):
    home = tmp_path / ".prefect"
    seed_prefect_home(home)
    with lease(home):
        api = start_kept_server(home, keep_s=1)
        tree = _tree(_marker(home)["pid"])
        time.sleep(4)  # four times the idle time, with a call still running on it
        assert healthy(api)
    assert left_alive(tree, 30) == []
    assert not (home / RUNNING_SERVER).exists()


def test_a_killed_keeper_takes_its_server_along_and_a_deleted_home_stops_one(tmp_path):
    home = tmp_path / ".prefect"
    seed_prefect_home(home)
    start_kept_server(home, keep_s=300)
    first = _marker(home)
    tree = _tree(first["pid"])
    os.kill(first["pid"], signal.SIGKILL)
    assert left_alive(tree, 30) == [], "the server dies with its keeper (parent-death signal)"

    api = start_kept_server(home, keep_s=300)  # the stale marker names a dead keeper: a new one starts
    second = _marker(home)
    assert second["pid"] != first["pid"] and api == second["api"] and healthy(api)
    tree = _tree(second["pid"])
    shutil.rmtree(home)
    assert left_alive(tree, 30) == [], "a keeper whose Prefect home was deleted stops"


def test_two_calls_started_together_share_one_kept_server(tmp_path):
    paths = [write_config(tmp_path, tiny_config_dict(tmp_path, n_train=n), name=f"c{n}.yaml") for n in (96, 80)]
    home = tmp_path / ".prefect"
    seed_prefect_home(home)
    env = {**{k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"},
           "PREFECT_HOME": str(home), "SFTFLOW_KEEP_SERVER": "8"}
    procs = [subprocess.Popen([sys.executable, "-m", "flows.cli", "stage", "prepare", "-c", str(p)], cwd=tmp_path,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              stdin=subprocess.DEVNULL) for p in paths]
    outs = [proc.communicate(timeout=300)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outs
    kept = _marker(home)
    assert len(flow_runs(kept["api"])) == 2
    assert (home / "kept-server.log").read_text().count("kept server http") == 1, "one server started, not two"
    assert left_alive(_tree(kept["pid"]), 8 + 30) == []


def _a_kept_server(tmp_path):
    """(config, Prefect home, its kept server's marker, the keeper's process tree)."""
    cfg_path = write_config(tmp_path, tiny_config_dict(tmp_path))
    home = tmp_path / ".prefect"
    seed_prefect_home(home)
    start_kept_server(home, keep_s=300)
    kept = _marker(home)
    return cfg_path, home, kept, _tree(kept["pid"])


def test_stop_server_stops_the_kept_server_now(tmp_path):
    cfg_path, home, kept, tree = _a_kept_server(tmp_path)
    proc = sftflow("stop-server", "-c", str(cfg_path), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert left_alive(tree, 5) == [], "the keeper and its server are gone when the command returns"
    assert not (home / RUNNING_SERVER).exists() and not healthy(kept["api"])
    again = sftflow("stop-server", "-c", str(cfg_path), cwd=tmp_path)
    assert again.returncode == 0 and "no kept Prefect server" in again.stdout


def test_stop_server_finds_the_kept_server_after_a_serve_start_server_came_and_went(tmp_path):
    """Issue 57: `serve --start-server` on the same home wrote its marker over the kept server's and
    removed it when it stopped; `stop-server` then said no kept server ran while it still listened."""
    from flows.servers.prefect_server import free_port, local_server
    cfg_path, home, kept, tree = _a_kept_server(tmp_path)
    with local_server("127.0.0.1", free_port(), home, home / "serve.log", shared=True) as api:  # serve's own
        assert _marker(home)["api"] == api != kept["api"]
    assert _marker(home) == kept, "the kept server is announced again once serve's server stops"
    (home / RUNNING_SERVER).unlink()  # and found without its marker (a serve that was SIGKILLed, a hand)
    assert healthy(kept["api"])
    proc = sftflow("stop-server", "-c", str(cfg_path), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert left_alive(tree, 5) == [], "the keeper and its server are gone when the command returns"
    assert not healthy(kept["api"]) and f"stopped the kept Prefect server at {kept['api']}" in proc.stdout


def test_links_printed_on_a_kept_server_open_while_it_runs_and_sftflow_ui_browses_the_history(tmp_path):
    """A run on the kept server prints a "View at" link that its UI serves (the kept server serves the
    UI); `sftflow ui -c CONFIG` prints the flow-run history of the same server, schedules nothing and
    holds the server until Ctrl-C. A temporary server (SFTFLOW_KEEP_SERVER=0) prints no link at all."""
    import re
    import urllib.request
    cfg_path = write_config(tmp_path, tiny_config_dict(tmp_path))
    home = tmp_path / ".prefect"
    env = {"PREFECT_API_URL": None, "SFTFLOW_KEEP_SERVER": "30"}
    run = sftflow("stage", "prepare", "-c", str(cfg_path), cwd=tmp_path, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    links = re.findall(r"View at (\S+)", run.stdout + run.stderr)
    kept = _marker(home)
    ui = kept["api"].removesuffix("/api")
    assert links and all(link.startswith(f"{ui}/runs/flow-run/") for link in links)
    def browse(url: str) -> str:  # as a browser asks (the UI answers page navigations, not bare GETs)
        return urllib.request.urlopen(urllib.request.Request(url, headers={"Accept": "text/html"}),
                                      timeout=30).read().decode()
    page = browse(links[0])
    assert page.lstrip().lower().startswith("<!doctype html>") and "/ico/" in page  # the UI's page, not a 404
    run_id = links[0].rsplit("/", 1)[-1]
    assert run_id in {r["id"] for r in flow_runs(kept["api"])}

    full_env = {**os.environ, "PREFECT_HOME": str(home), "SFTFLOW_KEEP_SERVER": "30"}
    full_env.pop("PREFECT_API_URL", None)
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "ui", "-c", str(cfg_path)], cwd=tmp_path, env=full_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith(f"Prefect UI: {ui}/runs"), line + proc.stderr.read() if proc.poll() is not None else line
        assert browse(f"{ui}/runs").lstrip().lower().startswith("<!doctype html>")
        assert _marker(home)["pid"] == kept["pid"]  # the same server
        deployments = json.loads(urllib.request.urlopen(urllib.request.Request(
            f"{kept['api']}/deployments/filter", data=b"{}", headers={"Content-Type": "application/json"}),
            timeout=30).read())
        assert deployments == []  # browsing schedules nothing
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) in (0, 130)

    temp = sftflow("stage", "prepare", "-c", str(cfg_path), "--force", cwd=tmp_path,
                   env={"PREFECT_API_URL": None, "SFTFLOW_KEEP_SERVER": "0", "PREFECT_HOME": str(tmp_path / ".other")})
    assert temp.returncode == 0, temp.stderr[-3000:]
    assert "View at" not in temp.stdout + temp.stderr  # its server is gone once the call ends


def test_listening_port_reads_the_port_a_child_bound_to_port_0():
    """The port `listening_port` reads from a process's sockets is the one the process itself
    reports (getsockname in the child): how servers started with `--port 0` are found."""
    from flows.servers.prefect_server import listening_port
    child = subprocess.Popen([sys.executable, "-c", "import socket, sys, time\n"
                              "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
                              "print(s.getsockname()[1], flush=True); time.sleep(60)"],
                             stdout=subprocess.PIPE, text=True)
    try:
        reported = int(child.stdout.readline())
        assert listening_port(child.pid) == reported
        assert listening_port(child.pid, host="127.0.0.2") is None  # only a socket on the host asked for
    finally:
        child.kill()
        child.wait()


def test_a_kept_server_whose_port_was_taken_starts_on_another_and_its_ui_calls_that_one(tmp_path):
    """The kept server's port is picked before it starts (its UI is told its API URL then), so another
    process can take it first: the server is started again on a free port, and the UI's settings
    name the port the server's process really listens on, never the taken one."""
    import socket
    import urllib.request
    from flows.servers.prefect_server import _start_ui_server, _stop, listening_port
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        home = tmp_path / ".prefect"
        seed_prefect_home(home)
        proc, api = _start_ui_server(home, port, time.time() + 180)
        try:
            served = listening_port(proc.pid)
            assert served != port and api == f"http://127.0.0.1:{served}/api" and healthy(api)
            settings = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{served}/ui-settings", timeout=10).read())
            assert settings["api_url"] == api
        finally:
            _stop(proc)


def test_prefect_api_points_this_test_and_prefect_in_process_at_the_session_server(prefect_api):
    from prefect.settings import PREFECT_API_URL
    assert os.environ["PREFECT_API_URL"] == prefect_api == PREFECT_API_URL.value() and healthy(prefect_api)


def test_a_test_that_does_not_ask_for_the_server_sees_none_of_it(prefect_server):
    """After the test above (file order) or any other: the CLI calls of a test that does not ask for
    `prefect_api` start their own server, in every order the tests run in."""
    from prefect.settings import PREFECT_API_URL
    assert "PREFECT_API_URL" not in os.environ and PREFECT_API_URL.value() != prefect_server


def _schema(db) -> tuple[set, list]:
    import sqlite3
    from contextlib import closing
    def lines(sql):  # Prefect's own builds differ in the order of a table's constraints
        return frozenset(line.strip().rstrip(",") for line in (sql or "").splitlines())
    with closing(sqlite3.connect(db)) as conn:
        objects = conn.execute("SELECT type, name, sql FROM sqlite_master").fetchall()
        return ({(kind, name, lines(sql)) for kind, name, sql in objects},
                conn.execute("SELECT version_num FROM alembic_version").fetchall())


def _block_type_ids(db) -> set:
    """Made at random when a server registers the block types: a copy has the same, a rebuild new ones."""
    import sqlite3
    from contextlib import closing
    with closing(sqlite3.connect(db)) as conn:
        return {row[0] for row in conn.execute("SELECT id FROM block_type")}


def _flow_run_count(db) -> int:
    import sqlite3
    from contextlib import closing
    with closing(sqlite3.connect(db)) as conn:
        return conn.execute("SELECT count(*) FROM flow_run").fetchone()[0]


def test_a_users_first_call_builds_the_database_that_test_homes_start_from(tmp_path):
    """A call on the config's own Prefect home on a machine with no copy yet (a user's very first call:
    nothing seeds it) has its server build the database, block types included, and leaves a copy in the
    user's cache (flows/servers/prefect_database.py); its schema and migration are those of the copy the suite's
    homes start from, so tests run on the database users get. A call in a new artifacts folder then
    starts from the cache's copy (its block types, not new ones), and a seeded test home's server from
    the suite's; each records its run in it."""
    from flows.servers.prefect_database import DATABASE
    cache = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    cfg_path = write_config(tmp_path, tiny_config_dict(tmp_path))
    first = sftflow("stage", "prepare", "-c", str(cfg_path), cwd=tmp_path, env={"PREFECT_HOME": None, **cache})
    assert first.returncode == 0, first.stderr[-3000:]
    built = tmp_path / "artifacts" / ".prefect" / PREFECT_DATABASE
    assert _schema(built) == _schema(prefect_database()) and _flow_run_count(built) == 1
    assert _block_type_ids(built) and _block_type_ids(built).isdisjoint(_block_type_ids(prefect_database())), \
        "built by its own server, not a copy"
    kept = list((tmp_path / "cache" / "sftflow").glob("prefect-*.db"))
    assert len(kept) == 1 and _block_type_ids(kept[0]) == _block_type_ids(built) and _flow_run_count(kept[0]) == 0

    other = tmp_path / "other"
    other.mkdir()
    cfg_other = write_config(other, tiny_config_dict(other))
    copied = sftflow("stage", "prepare", "-c", str(cfg_other), cwd=other, env={"PREFECT_HOME": None, **cache})
    assert copied.returncode == 0, copied.stderr[-3000:]
    db = other / "artifacts" / ".prefect" / DATABASE
    assert _block_type_ids(db) == _block_type_ids(built) and _flow_run_count(db) == 1
    assert _flow_run_count(kept[0]) == 0  # the copy's run went into the copy

    again = sftflow("stage", "prepare", "-c", str(cfg_path), "--force", cwd=tmp_path)  # a new home: seeded
    assert again.returncode == 0, again.stderr[-3000:]
    seeded = tmp_path / ".prefect" / PREFECT_DATABASE
    assert _block_type_ids(seeded) == _block_type_ids(prefect_database()) and _flow_run_count(seeded) == 1
