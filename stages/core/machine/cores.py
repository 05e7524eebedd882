"""The cores of one machine, shared by every sftflow run on it: a ledger of the ranks each launch runs.

Each launch gives its ranks `cores // ranks` OpenMP threads. Two runs on one machine (two Prefect
workers, `sweep --max-parallel`) did that without knowing of each other: two demo trainings on 2
cores ran about 3.5x slower together than one after the other. So every launch writes what it runs
into a folder all of this user's sftflow processes on the machine read, and the threads per rank
are `max(1, usable cores // live ranks of every run)`:

  * the folder: `SFTFLOW_CORES_DIR`, else `/dev/shm/sftflow-cores-<uid>` (memory; a reboot empties it),
    else `<tempdir>/sftflow-cores-<uid>`;
  * a claim: one small JSON file per launch (`claim`): the pid that holds it (the launcher, alive
    as long as its torchrun tree is: orphan_guard takes the tree down with it) and that pid's start
    time (a recycled pid is not the claimant), the number of ranks, when it was claimed. The file
    goes when the launch ends; a claim whose process is gone (SIGKILL) is ignored and removed by the
    next reader, so a killed run holds no cores;
  * the launcher takes its claim before its ranks start and gives them the share that includes its own
    ranks (`share`), with the folder and its claim in their environment; a training rank re-reads its
    share at most once a second between optimizer steps (`follow_threads`) and calls
    `torch.set_num_threads` when it changed, so the runs already going make room for a new one and
    take the cores back when it ends.

A user's own `OMP_NUM_THREADS` wins: that run's ranks keep it (its claim still counts for the
others). `SFTFLOW_CORES=off` turns the ledger off: each launch divides the cores among its own ranks,
as before. Torch-free: the launcher (stages/launch) and the training loop (stages/runtime) both use it.
Nothing here may fail a run: a folder that can't be written or read means no ledger.
"""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterator, Mapping

import psutil

__fingerprint__ = False  # how many threads a rank runs never changes what it computes (beyond rounding)

ENV_SWITCH = "SFTFLOW_CORES"        # "off": no ledger
ENV_DIR = "SFTFLOW_CORES_DIR"       # the ledger's folder (the launcher passes the one it used to its ranks)
ENV_CLAIM = "SFTFLOW_CORES_CLAIM"   # "<claim id>:<ranks>": the launcher's, when its ranks' threads follow the ledger
LOCK = ".lock"


def enabled(env: Mapping[str, str] | None = None) -> bool:
    env = os.environ if env is None else env
    return env.get(ENV_SWITCH, "").strip().lower() not in ("off", "0", "false", "no")


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity: a container's or taskset's limit), else all."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def ledger_dir(env: Mapping[str, str] | None = None) -> Path:
    """The ledger's folder (created, this user's only)."""
    env = os.environ if env is None else env
    if env.get(ENV_DIR):
        folder = Path(env[ENV_DIR])
    else:
        shm = Path("/dev/shm")
        base = shm if shm.is_dir() and os.access(shm, os.W_OK | os.X_OK) else Path(tempfile.gettempdir())
        folder = base / f"sftflow-cores-{os.getuid()}"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    return folder


@dataclass(frozen=True)
class Claim:
    folder: Path
    id: str
    ranks: int
    waited: float = 0.0  # seconds it queued before its ranks could start: not its run's work

    @property
    def path(self) -> Path:
        return self.folder / f"{self.id}.json"

    def env(self) -> dict[str, str]:
        """What a rank needs to follow the ledger (`follow_threads`)."""
        return {ENV_DIR: str(self.folder), ENV_CLAIM: f"{self.id}:{self.ranks}"}


@dataclass(frozen=True)
class Share:
    """The threads per rank now, and what they were computed from."""
    threads: int
    runs: int    # live sftflow launches on this machine (the asking one included)
    ranks: int   # their ranks, together
    cores: int   # usable cores

    def line(self, before: int) -> str:
        return (f"threads: {before} -> {self.threads} per rank ({self.runs} sftflow run{'s' * (self.runs != 1)}, "
                f"{self.ranks} rank{'s' * (self.ranks != 1)}, on {self.cores} core{'s' * (self.cores != 1)})")


@dataclass(frozen=True)
class Queue:
    """Why a claim waits: the runs going and their ranks, and the claims queued ahead of it (first come,
    first served: it waits for those too, even while nothing runs)."""
    running: int
    ranks: int
    ahead: int

    def line(self, ranks: int, cores: int) -> str:
        def n(count: int, what: str) -> str:
            return f"{count} {what}{'s' * (count != 1)}"
        return (f"cores: waiting behind {n(self.running, 'running sftflow run')} ({n(self.ranks, 'rank')}) and "
                f"{self.ahead} queued ahead on this machine's {n(cores, 'core')} before starting {n(ranks, 'rank')} "
                f"(SFTFLOW_CORES=off runs at once)")


def _process_start(pid: int) -> float | None:
    """When process `pid` started (psutil's create time); None when there is no such live process."""
    try:
        p = psutil.Process(pid)
        return None if p.status() == psutil.STATUS_ZOMBIE else p.create_time()
    except psutil.NoSuchProcess:
        return None
    except psutil.AccessDenied:  # someone else's process: alive, its start unknown
        return -1.0


def _alive(pid: int, started: float | None) -> bool:
    now = _process_start(pid)
    return now is not None and (started is None or now < 0 or abs(now - started) < 1.0)


def live_claims(folder: Path) -> list[dict]:
    """The claims in `folder` whose process lives; the others' files are removed."""
    found = []
    for name in os.listdir(folder):
        if name.startswith(".") or not name.endswith(".json"):
            continue
        path = folder / name
        try:
            data = json.loads(path.read_text())
            pid, ranks = int(data["pid"]), int(data["ranks"])
        except FileNotFoundError:  # released while we listed
            continue
        except (OSError, ValueError, KeyError, TypeError):  # not a claim of ours: ignored, left alone
            continue
        if ranks < 1:
            continue
        if not _alive(pid, data.get("pid_started")):
            path.unlink(missing_ok=True)
            continue
        found.append({**data, "id": name[:-len(".json")], "ranks": ranks})
    return found


def share(ranks: int = 0, claim_id: str | None = None, folder: Path | None = None,
          env: Mapping[str, str] | None = None) -> Share:
    """The threads per rank for a launch of `ranks` ranks (its claim `claim_id`, if it holds one, not
    counted twice) beside every other live claim; without the ledger, its own ranks alone."""
    cores, others = usable_cores(), []
    if enabled(env):
        try:
            others = [c for c in live_claims(folder or ledger_dir(env))
                      if c["id"] != claim_id and not c.get("waiting")]
        except OSError:
            others = []
    total = ranks + sum(c["ranks"] for c in others)
    return Share(max(1, cores // max(1, total)), len(others) + (1 if ranks else 0), total, cores)


@contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """This machine's launches write and sweep the ledger one at a time."""
    fd = os.open(folder / LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _write(made: Claim, record: dict) -> None:
    tmp = made.folder / f".{made.id}.tmp"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, made.path)  # a reader sees the whole claim or none


def _write_claim(ranks: int, pid: int | None, env: Mapping[str, str] | None) -> tuple[Claim, dict] | None:
    """A claim in the queue (`waiting`): counted by no one's share until `_admitted` lets it run."""
    if not enabled(env):
        return None
    pid = os.getpid() if pid is None else pid
    try:
        folder = ledger_dir(env)
        made = Claim(folder, f"{pid}-{uuid.uuid4().hex[:12]}", ranks)
        record = {"pid": pid, "pid_started": _process_start(pid), "ranks": ranks, "started": time.time(),
                  "waiting": True}
        with _locked(folder):
            live_claims(folder)  # sweeps the claims of dead processes
            _write(made, record)
        return made, record
    except OSError:
        return None


def _admitted(made: Claim, record: dict) -> Share | Queue:
    """Lets the claim run when its ranks fit beside the running ones (one thread per rank at least), or
    nothing runs; the queue is first come, first served. A `Queue`: not yet, and what it waits behind,
    read under the same lock as the decision (the message then names what kept it out)."""
    cores = usable_cores()
    with _locked(made.folder):
        others = [c for c in live_claims(made.folder) if c["id"] != made.id]
        going = [c for c in others if not c.get("waiting")]
        running = sum(c["ranks"] for c in going)
        ahead = [c for c in others if c.get("waiting") and (c["started"], c["id"]) < (record["started"], made.id)]
        if ahead or (running and running + made.ranks > cores):
            return Queue(len(going), running, len(ahead))
        record["waiting"] = False
        _write(made, record)
    return share(made.ranks, made.id, made.folder)


@contextmanager
def claim(ranks: int, pid: int | None = None, env: Mapping[str, str] | None = None,
          on_wait: Callable[[str], object] = print, stop: Callable[[], bool] = lambda: False,
          poll: float = 1.0, queue: bool = True) -> Iterator[Claim | None]:
    """`ranks` ranks on this machine for as long as the block runs, held by process `pid` (this one by
    default); None when the ledger is off or its folder can't be written (then nothing is shared).

    Runs queue when even one thread per rank would oversubscribe the cores (two demo trainings of 2
    processes each on 2 cores): the block starts when the ranks of the runs going and its own fit, or
    none is going, first come first served; `on_wait` hears once why it waits, and once how long it
    waited when it starts (the claim's `waited`: a stage's time queued is not its work). `stop()` true
    while waiting raises KeyboardInterrupt (the launcher's stop request). `queue=False` runs at once."""
    queued = _write_claim(ranks, pid, env)
    made = queued[0] if queued else None
    try:
        said, since = False, time.monotonic()
        while queued is not None:
            if not queue:
                queued[1]["waiting"] = False
                _write(*queued)
                break
            try:
                why = _admitted(*queued)
            except OSError:  # the ledger went away: run unshared
                break
            if not isinstance(why, Queue):
                break
            if stop():
                raise KeyboardInterrupt("stop requested")
            if not said:
                on_wait(why.line(ranks, usable_cores()))
                said = True
            time.sleep(poll)
        if said and made is not None:
            made = replace(made, waited=time.monotonic() - since)
            on_wait(f"cores: waited {made.waited:.1f} s for cores before starting {ranks} "
                    f"rank{'s' * (ranks != 1)}")
        yield made
    finally:
        if made is not None:
            made.path.unlink(missing_ok=True)


@contextmanager
def in_this_process(apply: Callable[[int], object], current: int, on_wait: Callable[[str], object] = print,
                    env: Mapping[str, str] | None = None) -> Iterator[int]:
    """One rank's work done in the calling process (an evaluation of one process, which runs in the
    stage's own process): claimed like a launch of one rank, queued like one, and run on
    `min(current, its share)` threads (`apply`: torch.set_num_threads), restored afterwards. Alone on the
    machine it keeps the threads it has. A user's OMP_NUM_THREADS wins; the ledger off changes nothing."""
    env = os.environ if env is None else env
    if "OMP_NUM_THREADS" in env or not enabled(env):
        yield current
        return
    with claim(1, on_wait=on_wait, env=env) as made:
        threads = min(current, share(1, made.id if made else None, env=env).threads)
        if threads != current:
            apply(threads)
        try:
            yield threads
        finally:
            if threads != current:
                apply(current)


class Follower:
    """A rank's threads, kept at its share of the machine: `poll` between optimizer steps re-reads the
    ledger at most every `min_interval` seconds and, when the share changed, applies it (`apply`:
    torch.set_num_threads) and says so (`say`); it returns the new count, else None."""

    def __init__(self, folder: Path, claim_id: str, ranks: int, threads: int, apply: Callable[[int], object],
                 say: Callable[[str], object], min_interval: float = 1.0, clock: Callable[[], float] = time.monotonic):
        self.folder, self.claim_id, self.ranks, self.threads = folder, claim_id, ranks, threads
        self.apply, self.say, self.min_interval, self.clock = apply, say, min_interval, clock
        self.last = clock()

    def poll(self) -> int | None:
        now = self.clock()
        if now - self.last < self.min_interval:
            return None
        self.last = now
        try:
            now_share = share(self.ranks, self.claim_id, self.folder)
        except Exception:  # noqa: BLE001 - the ledger never stops a training
            return None
        if now_share.threads == self.threads:
            return None
        before, self.threads = self.threads, now_share.threads
        self.apply(now_share.threads)
        self.say(now_share.line(before))
        return now_share.threads


class _Fixed:
    """The threads a rank was started with, kept (no ledger, or the user's OMP_NUM_THREADS)."""

    def poll(self) -> None:
        return None


def follow_threads(apply: Callable[[int], object], say: Callable[[str], object],
                   env: Mapping[str, str] | None = None, min_interval: float = 1.0,
                   clock: Callable[[], float] = time.monotonic) -> Follower | _Fixed:
    """A rank's follower when its launcher gave it threads from the ledger (`ENV_CLAIM`), else one that
    keeps the threads it has."""
    env = os.environ if env is None else env
    try:
        claim_id, _, ranks = env[ENV_CLAIM].rpartition(":")
        threads, folder = int(env["OMP_NUM_THREADS"]), Path(env[ENV_DIR])
        n = int(ranks)
    except (KeyError, ValueError):
        return _Fixed()
    if not enabled(env) or not claim_id or n < 1:
        return _Fixed()
    return Follower(folder, claim_id, n, threads, apply, say, min_interval, clock)
