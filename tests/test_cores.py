"""Runs that share a machine share its cores (stages/core/machine/cores.py): the launcher claims its ranks in a
ledger, gives them `usable cores // every live run's ranks` threads each, and its ranks follow the
ledger while they train. Each test has a ledger of its own (SFTFLOW_CORES_DIR in tmp_path)."""

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from stages.core.cache import artifacts
from stages.core.machine import cores
from stages.core.errors import StageError
from stages.launch.launcher import run_torchrun, worker_env


@pytest.fixture
def ledger(tmp_path, monkeypatch) -> Path:
    """A ledger of this test's own on a machine of 4 usable cores; no OMP_NUM_THREADS of the caller's."""
    folder = tmp_path / "cores"
    monkeypatch.setenv(cores.ENV_DIR, str(folder))
    monkeypatch.delenv(cores.ENV_SWITCH, raising=False)
    monkeypatch.delenv(cores.ENV_CLAIM, raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cores, "usable_cores", lambda: 4)
    return folder


def claims(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("*.json"))


def test_two_claims_at_once_split_the_cores(ledger):
    assert cores.share(1).threads == 4  # alone
    with cores.claim(1) as first:
        assert first is not None and len(claims(ledger)) == 1
        assert cores.share(1, first.id) == cores.Share(threads=4, runs=1, ranks=1, cores=4)
        with cores.claim(2) as second:
            assert cores.share(1, first.id) == cores.Share(threads=1, runs=2, ranks=3, cores=4)
            assert cores.share(2, second.id).threads == 1
        assert cores.share(1, first.id).threads == 4  # the second one's cores come back
    assert claims(ledger) == []


def _claim_in_thread(ranks: int, events: list, **kw) -> threading.Thread:
    """claim(ranks) in a thread that records when it was let in and holds it until `events` gets "release"."""
    def body():
        try:
            with cores.claim(ranks, on_wait=lambda line: events.append(("waits", ranks, line)), poll=0.02, **kw) as c:
                running = sorted(x["ranks"] for x in cores.live_claims(c.folder) if x["id"] != c.id
                                 and not x.get("waiting"))
                events.append(("runs", ranks))
                events.append(("beside", ranks, running))  # the other runs going when it was let in
                while ("release", ranks) not in events:
                    time.sleep(0.01)
        except KeyboardInterrupt:
            events.append(("stopped", ranks))
    t = threading.Thread(target=body, daemon=True)
    t.start()
    return t


def _until(condition, seconds: float = 20) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_runs_that_would_oversubscribe_queue_first_come_first_served(ledger):
    """4 cores: 3 ranks running; a run of 2 waits (3 + 2 > 4, one thread per rank at least); a run of 1
    that would fit waits behind it; each starts when its turn comes and its ranks fit."""
    events: list = []
    with cores.claim(3) as big:
        two = _claim_in_thread(2, events)
        _until(lambda: ("waits", 2) in [e[:2] for e in events])
        time.sleep(0.05)
        one = _claim_in_thread(1, events)
        _until(lambda: ("waits", 1) in [e[:2] for e in events])
        time.sleep(0.2)
        assert ("runs", 2) not in events and ("runs", 1) not in events
        waits = [e[2] for e in events if e[0] == "waits"]
        assert waits == ["cores: waiting behind 1 running sftflow run (3 ranks) and 0 queued ahead on this "
                         "machine's 4 cores before starting 2 ranks (SFTFLOW_CORES=off runs at once)",
                         "cores: waiting behind 1 running sftflow run (3 ranks) and 1 queued ahead on this "
                         "machine's 4 cores before starting 1 rank (SFTFLOW_CORES=off runs at once)"]
        assert cores.share(3, big.id).threads == 1  # queued claims take no one's cores
    _until(lambda: ("runs", 2) in events and ("runs", 1) in events)
    # each says, once it starts, how long it queued
    assert sorted(e[1] for e in events if e[0] == "waits" and e[2].startswith("cores: waited ")) == [1, 2]
    beside = {e[1]: e[2] for e in events if e[0] == "beside"}
    # the run of 2 was let in first (the 3 had ended), the 1 only beside it: the 1 saw the 2 running. The 2
    # reports who runs beside it after it is in, when the 1 may already have followed it in.
    assert beside[1] == [2] and beside[2] in ([], [1]), events
    assert cores.share(0).ranks == 3  # 2 + 1 running together
    events += [("release", 2), ("release", 1)]
    two.join(10)
    one.join(10)
    assert claims(ledger) == []


def test_a_run_queued_behind_queued_runs_counts_them_while_nothing_runs(ledger):
    """First come, first served: two claims queued ahead keep a third out even while no run is going, and
    its message counts them (it read "waiting for 0 rank(s) of 0 other sftflow run(s)")."""
    ledger.mkdir(parents=True)
    me = cores._process_start(os.getpid())
    for n, ranks in enumerate((2, 1)):  # queued ahead, never let in: no process polls for them
        ledger.joinpath(f"ahead{n}.json").write_text(json.dumps(
            {"pid": os.getpid(), "pid_started": me, "ranks": ranks, "started": time.time() - 60 + n, "waiting": True}))
    said: list[str] = []
    with pytest.raises(KeyboardInterrupt):
        with cores.claim(1, on_wait=said.append, stop=lambda: bool(said), poll=0.01):
            pytest.fail("let in ahead of the queue")
    assert said == ["cores: waiting behind 0 running sftflow runs (0 ranks) and 2 queued ahead on this machine's "
                    "4 cores before starting 1 rank (SFTFLOW_CORES=off runs at once)"]
    assert claims(ledger) == ["ahead0.json", "ahead1.json"]  # its own claim went with it


def test_a_run_larger_than_the_machine_runs_when_it_is_alone_and_queue_false_never_waits(ledger):
    with cores.claim(8, on_wait=pytest.fail) as alone:
        assert alone is not None and cores.share(8, alone.id).threads == 1 and alone.waited == 0
        with cores.claim(2, on_wait=pytest.fail, queue=False) as node:  # a node of a multi-machine run
            assert cores.share(2, node.id).ranks == 10


def test_a_stop_request_while_queued_ends_the_wait_and_the_claim(ledger):
    events: list = []
    stop = threading.Event()
    with cores.claim(4):
        waiter = _claim_in_thread(1, events, stop=stop.is_set)
        _until(lambda: ("waits", 1) in [e[:2] for e in events])
        assert len(claims(ledger)) == 2
        stop.set()
        waiter.join(10)
        assert ("stopped", 1) in events and ("runs", 1) not in events
        assert len(claims(ledger)) == 1


def test_a_claim_of_a_dead_process_is_ignored_and_removed(ledger):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    started = cores._process_start(dead.pid)
    dead.wait()
    ledger.mkdir(parents=True, exist_ok=True)
    ledger.joinpath("gone.json").write_text(json.dumps({"pid": dead.pid, "pid_started": started, "ranks": 3}))
    assert cores.share(1) == cores.Share(threads=4, runs=1, ranks=1, cores=4)
    assert claims(ledger) == []  # the reader swept it
    # a recycled pid is not the claimant: a live pid whose start differs
    ledger.joinpath("recycled.json").write_text(json.dumps({"pid": os.getpid(), "pid_started": 1.0, "ranks": 2}))
    assert cores.share(1).threads == 4 and claims(ledger) == []


def test_a_file_that_is_no_claim_is_left_alone(ledger):
    ledger.mkdir(parents=True)
    ledger.joinpath("notes.json").write_text("not json")
    assert cores.share(2).threads == 2 and claims(ledger) == ["notes.json"]


def test_the_launch_environment_carries_the_ledgers_threads(ledger):
    with cores.claim(3):  # another run: 3 ranks
        assert worker_env(1)["OMP_NUM_THREADS"] == "1"  # 4 cores // 4 ranks
    with cores.claim(1):  # another run: 1 rank
        assert worker_env(1)["OMP_NUM_THREADS"] == "2"
        with cores.claim(1) as mine:
            env = worker_env(1, mine)
            assert env["OMP_NUM_THREADS"] == "2"  # its own claim counted once (twice: 4 // 3 = 1)
            assert env[cores.ENV_CLAIM] == f"{mine.id}:1" and env[cores.ENV_DIR] == str(ledger)
    with cores.claim(2) as alone:
        env = worker_env(2, alone)
        assert env["OMP_NUM_THREADS"] == "2"
    assert cores.ENV_CLAIM not in worker_env(2)  # no claim: nothing to follow


def test_an_explicit_omp_num_threads_wins(ledger, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    with cores.claim(1), cores.claim(2) as mine:
        env = worker_env(2, mine)
        assert env["OMP_NUM_THREADS"] == "3" and cores.ENV_CLAIM not in env
        assert isinstance(cores.follow_threads(print, print, env), cores._Fixed)
        assert len(claims(ledger)) == 2  # its ranks still count for the others


def test_off_switch_divides_among_the_launchs_own_ranks(ledger, monkeypatch):
    monkeypatch.setenv(cores.ENV_SWITCH, "off")
    with cores.claim(2) as none:
        assert none is None and not ledger.exists()
        assert worker_env(2)["OMP_NUM_THREADS"] == "2"
        assert cores.ENV_CLAIM not in worker_env(2)


def test_a_rank_follows_its_share_as_runs_come_and_go(ledger):
    applied, said = [], []
    with cores.claim(2) as mine:
        env = worker_env(2, mine)
        assert env["OMP_NUM_THREADS"] == "2"
        follower = cores.follow_threads(applied.append, said.append, env, min_interval=0)
        assert follower.poll() is None and applied == []
        with cores.claim(2):
            assert follower.poll() == 1
            assert said == ["threads: 2 -> 1 per rank (2 sftflow runs, 4 ranks, on 4 cores)"]
            assert follower.poll() is None  # unchanged: nothing applied again
        assert follower.poll() == 2
    assert applied == [1, 2]
    assert said[-1] == "threads: 1 -> 2 per rank (1 sftflow run, 2 ranks, on 4 cores)"


def test_a_follower_reads_the_ledger_at_most_once_per_interval(ledger):
    now = [0.0]
    with cores.claim(1) as mine:
        follower = cores.follow_threads(lambda n: None, lambda s: None, worker_env(1, mine), min_interval=1.0,
                                        clock=lambda: now[0])
        with cores.claim(1):
            now[0] = 0.5
            assert follower.poll() is None  # too soon: not read
            now[0] = 1.0
            assert follower.poll() == 2


def test_a_launch_holds_its_claim_while_its_tree_runs(ledger):
    probe = [sys.executable, "-c",
             "import json, os; d = os.environ['SFTFLOW_CORES_DIR']; "
             "print(json.dumps([os.environ['OMP_NUM_THREADS'], os.environ['SFTFLOW_CORES_CLAIM'], "
             "sorted(f for f in os.listdir(d) if f.endswith('.json'))]))"]
    lines: list[str] = []
    with cores.claim(1):
        run_torchrun(probe, ledger.parent / "probe.log", StageError, "probe", lines.append, nproc_per_node=1)
    threads, claim, seen = json.loads(lines[-1])
    assert threads == "2" and f"{claim.split(':')[0]}.json" in seen and len(seen) == 2
    assert claims(ledger) == []  # released when the tree ended


def test_a_launch_that_queued_says_how_long_and_its_stage_keeps_that_out_of_its_seconds(ledger, monkeypatch):
    """The time a launch queued for the cores is logged apart from its work: train.log says "waited N s for
    cores", run_torchrun returns it, and the stage's manifest records it beside `seconds`, which leave it out
    (a stage's seconds are its work; the table of stages shows them)."""
    log = ledger.parent / "train.log"
    out: dict = {}
    said: list[str] = []
    with cores.claim(4):  # the whole machine: a launch of one rank queues
        launch = threading.Thread(target=lambda: out.update(waited=run_torchrun(
            [sys.executable, "-c", "print('ranks ran')"], log, StageError, "probe", said.append)))
        launch.start()
        _until(lambda: said)
        assert launch.is_alive()
    launch.join(60)
    lines = log.read_text().splitlines()
    assert said == lines  # the task's log hears what train.log holds
    assert lines[0].startswith("cores: waiting behind 1 running sftflow run (4 ranks) and 0 queued ahead")
    assert re.fullmatch(r"cores: waited \d+\.\d s for cores before starting 1 rank", lines[1]), lines
    assert lines[2:] == ["ranks ran"]
    assert out["waited"] > 0 and lines[1] == f"cores: waited {out['waited']:.1f} s for cores before starting 1 rank"

    clock = iter([100.0, 130.0])  # the folder made at 100 s, committed at 130 s after queuing 20 s of them
    monkeypatch.setattr(artifacts, "time", SimpleNamespace(time=lambda: next(clock), strftime=time.strftime))
    build = artifacts.StageBuild(ledger.parent / "artifacts", "train", "f" * 16)
    manifest = artifacts.read_manifest(build.commit({"metrics": {}}, waited=20.0))
    assert manifest["seconds"] == 10.0 and manifest[artifacts.WAITED] == 20.0


FOLLOWING_RANK = r"""
import json, os, sys, time
from pathlib import Path
import torch
from stages.core.machine import cores
said = []
follower = cores.follow_threads(torch.set_num_threads, said.append, min_interval=0)
me = os.environ[cores.ENV_CLAIM].split(":")[0]
Path(sys.argv[1]).touch()  # started: OMP_NUM_THREADS is fixed
deadline = time.monotonic() + 120
while cores.share(1, me).runs < 2 and time.monotonic() < deadline:  # the other run is in the ledger
    time.sleep(0.05)
follower.poll()
print(json.dumps({"threads": torch.get_num_threads(), "started": int(os.environ["OMP_NUM_THREADS"]), "said": said}))
sys.stdout.flush()
Path(sys.argv[2]).touch()
while not all(Path(p).exists() for p in sys.argv[3:]) and time.monotonic() < deadline:  # both have looked
    time.sleep(0.05)
"""


@pytest.mark.slow
def test_two_real_launches_at_once_each_get_their_share(tmp_path, monkeypatch):
    """Two torchrun launches of one rank each through the launcher, with the machine's real cores."""
    monkeypatch.setenv(cores.ENV_DIR, str(tmp_path / "cores"))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv(cores.ENV_SWITCH, raising=False)
    n = cores.usable_cores()
    if n < 2:
        pytest.skip("two runs of one rank each queue on one core")
    marks = [str(tmp_path / "a.seen"), str(tmp_path / "b.seen")]
    out: dict[str, list[str]] = {"a": [], "b": []}
    errors = []

    def launch(name: str, mark: str) -> None:
        try:
            run_torchrun([sys.executable, "-c", FOLLOWING_RANK, str(tmp_path / f"{name}.began"), mark, *marks],
                         tmp_path / f"{name}.log", StageError, name, out[name].append, nproc_per_node=1)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    first = threading.Thread(target=launch, args=("a", marks[0]))
    first.start()
    # the first one's rank has started, so its threads were set before the second claims (waiting for
    # the claim file alone let the second claim land between the first's claim and its share: CI saw 1 == 2)
    while not (tmp_path / "a.began").exists():
        assert first.is_alive(), out
        time.sleep(0.05)
    second = threading.Thread(target=launch, args=("b", marks[1]))
    second.start()
    first.join(300)
    second.join(300)
    assert not errors, errors
    a, b = (json.loads(out[k][-1]) for k in ("a", "b"))
    assert a["threads"] == b["threads"] == max(1, n // 2)
    assert b["started"] == max(1, n // 2)  # the second launch started with its share
    if max(1, n // 2) != n:  # the first one started with the whole machine and made room
        assert a["started"] == n
        assert a["said"] == [f"threads: {n} -> {max(1, n // 2)} per rank (2 sftflow runs, 2 ranks, on {n} cores)"]
    assert list((tmp_path / "cores").glob("*.json")) == []


def test_an_evaluation_in_this_process_claims_one_rank_and_takes_its_share(ledger, monkeypatch):
    """Evaluation with one process runs in the stage's own process: it claims like a launch of one rank,
    runs on min(its threads, its share) and gives its threads back; alone it keeps what it has."""
    calls: list[int] = []
    with cores.in_this_process(calls.append, 4) as threads:
        assert threads == 4 and calls == [] and len(claims(ledger)) == 1  # alone: unchanged
    assert claims(ledger) == []
    with cores.claim(1):
        with cores.in_this_process(calls.append, 4) as threads:
            assert threads == 2 and calls == [2] and len(claims(ledger)) == 2
        assert calls == [2, 4]  # restored
        with cores.in_this_process(calls.append, 1) as threads:  # never more than it had
            assert threads == 1 and calls == [2, 4]
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    with cores.claim(1), cores.in_this_process(calls.append, 4) as threads:
        assert threads == 4 and calls == [2, 4] and len(claims(ledger)) == 1  # the user's count: no claim
