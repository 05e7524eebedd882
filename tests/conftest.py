import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck
from hypothesis import settings as hypothesis_settings

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "data" / "demo"
REALDATA = ROOT.parent / "shared" / "realdata"  # real ShareGPT rows; tests that read them skip without it
TEMPLATES = ROOT / "tests" / "fixtures" / "chat_templates"  # real vendor templates (MIT, see its README)

# Keep every test away from the project's own artifacts/ and from the network.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The suite runs two workers, each starting torch processes whose OpenMP threads assume the cores are
# theirs. libgomp's threads spin after each parallel region while waiting for work, which on shared cores
# burns the time another process needs: PASSIVE makes them sleep (the numbers are the same; measured
# on 4 torch-heavy files over 2 workers: 119-121 s of CPU against 137-146 s, 77 s wall against 84-90 s).
# Set before anything loads torch here; subprocesses and the warm CLI inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# A CLI call without PREFECT_API_URL gets a temporary server that dies with it, not one kept for
# minutes in the background (tests/test_kept_server.py covers that path).
os.environ["SFTFLOW_KEEP_SERVER"] = "0"
# A server of the developer's shell is none of the tests' business: tests that want one ask for
# `prefect_api` (the session's server, for that test only).
os.environ.pop("PREFECT_API_URL", None)
# `auto` on a CPU follows bf16's speed measured on the machine (stages/core/machine/bf16_speed.py): pinned to fp32's
# answer here so a test's precision is the same on every CI machine. tests/test_precision_rule.py (the rule)
# and the promises that must hold in what `auto` picks on the machine at hand (the demo's seed grid, the
# SmolLM2 quickstart) unset it.
os.environ["SFTFLOW_CPU_BF16_SPEEDUP"] = "0.5"
# The machine's ledger of cores (stages/core/machine/cores.py) would let the other pytest worker's trainings change
# this one's threads mid-run, and with them the order of float additions: each worker has a ledger of its
# own (tests/test_cores.py tests the shared one). Set in every worker, not by default: xdist's workers
# inherit the environment of the process that started them, which imported this file first.
_worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
os.environ["SFTFLOW_CORES_DIR"] = tempfile.mkdtemp(prefix=f"sftflow-cores-{_worker}-")
atexit.register(shutil.rmtree, os.environ["SFTFLOW_CORES_DIR"], True)  # a worker leaves no ledger in /tmp

# Hypothesis profiles (tests/test_masking.py, tests/test_shapes.py). `ci`: derandomized, so a CI run
# explores the same examples every time and a red build is the code's doing, never the draw's; no
# example database (nothing carries over between clean clones); a failure prints its reproduce blob.
# `dev` (the default): random exploration, so local runs keep finding new cases, and the database
# in .hypothesis/ replays what failed before. `ci` is loaded when CI is set (`.ci/run` sets CI=true;
# "", "0" and "false" count as unset) or HYPOTHESIS_PROFILE=ci; HYPOTHESIS_PROFILE names any profile.
# Both derive from Hypothesis' own defaults (`dev` must not inherit the `ci` settings Hypothesis
# loads by itself whenever a CI variable exists). Every property test sets deadline=None (a render
# or tokenizer call can stall on 2 shared cores): the profiles say so too, for tests that don't.
_defaults = hypothesis_settings.get_profile("default")
hypothesis_settings.register_profile("ci", _defaults, derandomize=True, database=None, print_blob=True, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])
hypothesis_settings.register_profile("dev", _defaults, deadline=None)
hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE")
                                 or ("ci" if os.environ.get("CI", "").lower() not in ("", "0", "false") else "dev"))


# The files that take minutes, longest first (pytest --durations, 2 cores). `make test` hands each file
# to one of two workers whole (--dist loadfile) in collection order (--no-loadscope-reorder; xdist would
# otherwise put the files with the most tests first, which left a 4-minute test starting last with the
# other worker idle): started first, they run beside the short files instead of after them.
LONG_FILES = ("test_flow.py", "test_real_model.py", "test_train_core.py", "test_demo.py", "test_cancel.py",
              "test_kept_server.py", "test_retrain_on_arrival.py", "test_memory_plan.py", "test_workpool.py",
              "test_schedule.py", "test_concurrency.py", "test_sweep.py", "test_newcomer.py", "test_your_data.py",
              "test_quantize.py", "test_adapters.py", "test_early_stopping.py", "test_validation_by_source.py")


def pytest_collection_modifyitems(items):
    first = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: first.get(item.path.name, len(LONG_FILES)))  # stable: the rest keep their order


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def demo_rows(name: str, n: int) -> list[dict]:
    lines = (DEMO / name).read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines[:n]]


# template file -> (special tokens the family's tokenizer has, end-of-turn text after each reply)
REAL_TEMPLATES = {
    "alpaca": ({"bos_token": "<s>", "eos_token": "</s>"}, "</s>"),
    "chatml": ({"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>"}, "<|im_end|>"),
    "qwen2.5-instruct": ({"eos_token": "<|im_end|>"}, "<|im_end|>"),
    "llama-2-chat": ({"bos_token": "<s>", "eos_token": "</s>"}, " </s>"),
    "llama-3-instruct": ({"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                          "additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>"]}, "<|eot_id|>"),
    "mistral-instruct": ({"bos_token": "<s>", "eos_token": "</s>"}, "</s>"),
    "gemma-it": ({"bos_token": "<bos>", "eos_token": "<eos>",
                  "additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]}, "<end_of_turn>"),
    "phi-3": ({"eos_token": "<|endoftext|>",
               "additional_special_tokens": ["<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]}, "<|end|>"),
    "zephyr": ({"eos_token": "</s>", "additional_special_tokens": ["<|user|>", "<|assistant|>", "<|system|>"]}, "</s>"),
    "vicuna": ({"bos_token": "<s>", "eos_token": "</s>"}, "</s>"),
}
# Facts about the templates, read off their source (not computed by sftflow): which put a single
# space between the header and the reply ("[/INST] I am", "ASSISTANT: I am"), and which keep a
# reply's surrounding whitespace instead of trimming it.
SPACE_BEFORE_REPLY = {"llama-2-chat", "mistral-instruct", "vicuna"}
KEEPS_WHITESPACE = {"qwen2.5-instruct", "builtin"}


def expected_run(name: str, reply: str) -> str:
    """What training one reply must decode to on template `name`: the reply as rendered and the end text."""
    end = REAL_TEMPLATES[name][1] if name in REAL_TEMPLATES else "<|im_end|>"
    lead = " " if name in SPACE_BEFORE_REPLY else ""
    return lead + (reply if name in KEEPS_WHITESPACE else reply.strip()) + end


MULTI_TURN = [
    [{"role": "user", "content": "Who are you?"}, {"role": "assistant", "content": "I am TinyChat."},
     {"role": "user", "content": "你是谁？"}, {"role": "assistant", "content": "我是 TinyChat。\n第二行"},
     {"role": "user", "content": "Say [INST] and ASSISTANT: please"},
     {"role": "assistant", "content": "[INST] ASSISTANT: <|im_start|> done"}],
    [{"role": "system", "content": "You are TinyChat."}, {"role": "user", "content": "Repeat after me: a b"},
     {"role": "assistant", "content": "You said: a b"}, {"role": "user", "content": "again"},
     {"role": "assistant", "content": "You said: again"}],
]


def family_tokenizer(base, name: str):
    """The builtin BPE tokenizer given a model family's special tokens and its real template,
    exactly as the file is written (indented; transformers renders it with trim/lstrip_blocks)."""
    tok = base.__class__.from_pretrained(base.name_or_path)
    specials, _ = REAL_TEMPLATES[name]
    tok.add_special_tokens(dict(specials))
    tok.chat_template = (TEMPLATES / f"{name}.jinja").read_text()
    return tok


def tiny_config_dict(tmp: Path, n_train: int = 96, n_val: int = 12, **sections) -> dict:
    """A config that runs the whole flow in well under a minute on 2 CPU cores."""
    train = write_jsonl(tmp / "train.jsonl", demo_rows("train.jsonl", n_train))
    val = write_jsonl(tmp / "val.jsonl", demo_rows("eval.jsonl", n_val))
    cfg = {
        "artifacts_dir": str(tmp / "artifacts"),
        "runner": {"max_epochs": 1, "max_steps": 4, "val_check_interval": 2, "save_interval": 2, "log_interval": 1,
                   "seed": 7},
        # one process, as `auto` is on CPU: tests of the flow, caching and servers don't need two ranks
        # (a torchrun of two costs twice the imports on 2 cores); tests of the distributed maths ask for 2
        # fp32 whatever the CPU: `auto` is bf16 on one with AMX (core/machine/precision.py), and these tests
        # compare with fp32 references to the bit on every CI machine; tests/test_precision*.py hold the bf16 paths
        "actor": {"nproc_per_node": 1, "micro_batch_size": 4, "global_batch_size": 16,
                  "optim": {"lr": 1e-3, "warmup": 1}, "precision": "fp32"},
        "data": {"train_data_paths": [str(train)], "val_data_paths": [str(val)], "format": "messages",
                 "max_length": 256},
        "eval": {"max_new_tokens": 8, "batch_size": 8, "precision": "fp32"},
        "registry": {"model_name": "test-model", "promote": "if_better"},
    }
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values) if isinstance(values, dict) else cfg.__setitem__(section, values)
    return cfg


def noisy_model(base: str, out: Path):
    """(model, tokenizer) of a model that says different things to different prompts and stops early on
    some, saved as a Hugging Face folder at `out`: the builtin model untrained repeats one token."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # scaled noise makes replies prompt-dependent
        for p in model.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        model.get_input_embeddings().weight[tok.pad_token_id] *= 3  # <|endoftext|> (a stop token) comes up sometimes
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return model, tok


def write_config(tmp: Path, cfg: dict, name: str = "config.yaml") -> Path:
    path = tmp / name
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


@pytest.fixture
def tiny_config(tmp_path) -> Path:
    return write_config(tmp_path, tiny_config_dict(tmp_path))


from flows.servers.prefect_server import _stop as stop_server, free_port, listening_port  # noqa: E402, F401  (the CLI's own)


@pytest.fixture
def closed_port():
    """A loopback port nothing answers on, for as long as the test runs: the socket is bound (so no
    other process can take the port meanwhile) but never listens, so a connection is refused."""
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


def live_processes_mentioning(text: str) -> list[str]:
    """Command lines of live processes that contain `text` (e.g. a stage folder path)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            cmd = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmd:
            found.append(cmd)
    return found


def wait_healthy(health_url: str, proc: subprocess.Popen, log: Path, timeout: float = 180) -> None:
    """Until a server we started answers its health check; its log's tail if it dies or never does."""
    import time
    import urllib.request
    deadline = time.time() + timeout
    while True:
        try:
            if urllib.request.urlopen(health_url, timeout=2).status == 200:
                return
        except OSError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise RuntimeError(f"server did not start ({health_url}):\n" + log.read_text()[-3000:])
        time.sleep(0.5)


@contextmanager
def mlflow_server(home: Path, workers: int = 1):
    """`mlflow server` on loopback (a free port, SQLite store and served artifacts under `home`, no
    job-runner processes); its URI while the block runs."""
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    proc, uri = start_server(
        [str(Path(sys.executable).with_name("mlflow")), "server", "--host", "127.0.0.1", "--port", "0",
         "--workers", str(workers), "--backend-store-uri", f"sqlite:///{home / 'mlflow.db'}",
         "--artifacts-destination", str(home / "artifacts")], home / "server.log", "/health", env=env)
    try:
        yield uri
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()


def start_server(cmd: list[str], log: Path, health_path: str, env: dict | None = None,
                 timeout: float = 180) -> tuple[subprocess.Popen, str]:
    """Starts a server told to listen on port 0 and waits until it answers; it and its
    base URL. The kernel picks the port as the server binds it, read back from the socket the
    server's process (or a child) listens on: a number picked beforehand and released could be
    taken by another process (5 agents, parallel CI jobs) before the server binds it."""
    import time
    proc = subprocess.Popen(cmd, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + timeout
    try:
        while (port := listening_port(proc.pid)) is None:
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"server did not start ({' '.join(cmd[:3])}):\n" + log.read_text()[-3000:])
            time.sleep(0.3)
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url + health_path, proc, log, timeout=max(deadline - time.time(), 1))
    except BaseException:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # its session: a server a launcher (make) started too
        except ProcessLookupError:
            pass
        proc.wait()
        raise
    return proc, url


# A new Prefect home's first server spends about half its start (4-5 s of 9-10 s on 2 cores) migrating
# an empty database and registering block types, and the suite gives each test a home of its own. So
# the homes of the suite's servers start from a copy of one database a real server built once per
# test run (shared by the xdist workers). tests/test_kept_server.py checks that copy against what a
# server builds on a new home, which is the road a user's first call takes: the CLI has no template.
PREFECT_DATABASE = "prefect.db"  # in a Prefect home: its local server's database (Prefect's default)
_run_folder: list[Path] = []


@pytest.fixture(scope="session", autouse=True)
def _shared_run_folder(tmp_path_factory):
    """This test run's folder that all its xdist workers share (each has its own basetemp under it)."""
    base = tmp_path_factory.getbasetemp()
    _run_folder[:] = [base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base]


def prefect_database() -> Path:
    """The empty, migrated database a real `prefect server start` built on a new home, made on first use
    in this test run (sqlite's online backup once the server answers: consistent while it writes)."""
    import sqlite3
    from contextlib import closing

    from filelock import FileLock
    folder = _run_folder[0] / "prefect-database"
    folder.mkdir(exist_ok=True)
    built = folder / PREFECT_DATABASE
    with FileLock(str(folder / "build.lock")):
        if not built.is_file():
            home = folder / "home"
            home.mkdir()
            env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_UI_ENABLED": "false"}
            env.pop("PREFECT_API_URL", None)
            proc, _ = start_server([str(Path(sys.executable).with_name("prefect")), "server", "start",
                                    "--host", "127.0.0.1", "--port", "0"], home / "server.log", "/api/health", env=env)
            try:
                with closing(sqlite3.connect(home / PREFECT_DATABASE)) as src, \
                        closing(sqlite3.connect(folder / "part.db")) as dst:
                    src.backup(dst)
                (folder / "part.db").replace(built)
            finally:
                stop_server(proc)
    return built


def seed_prefect_home(home: Path) -> Path:
    """`home`, made, with a copy of `prefect_database()` unless it has a database already; the copy."""
    home.mkdir(parents=True, exist_ok=True)
    db = home / PREFECT_DATABASE
    if not db.exists():
        part = home / f".{PREFECT_DATABASE}.{os.getpid()}"
        shutil.copyfile(prefect_database(), part)
        part.replace(db)
    return db


@contextmanager
def seeded_prefect_home(env: dict):
    """Around a CLI call with environment `env`: the Prefect home it names, when the call starts a
    server there (no PREFECT_API_URL) and the home is new, seeded (`seed_prefect_home`). A call that
    started none (a config refused first) finds its home as it left it: not there. Outside a test
    run (a bench script), nothing is seeded."""
    home = Path(env["PREFECT_HOME"]) if env.get("PREFECT_HOME") and not env.get("PREFECT_API_URL") else None
    if home is None or home.exists() or not _run_folder:
        yield
        return
    db = seed_prefect_home(home)
    copied = db.stat()
    try:
        yield
    finally:
        now = db.stat() if db.exists() else None
        if [p.name for p in home.iterdir()] == [PREFECT_DATABASE] and now is not None \
                and (now.st_size, now.st_mtime_ns) == (copied.st_size, copied.st_mtime_ns):
            db.unlink()
            home.rmdir()


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory) -> str:
    """One real `prefect server start` on loopback for the session (started once: ~6 s); its API URL.
    It changes no environment: a test runs on it by asking for `prefect_api` (or a module-scoped
    fixture for `prefect_api_module`)."""
    home = tmp_path_factory.mktemp("prefect-server")
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_UI_ENABLED": "false",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           # schedules become runs within seconds (default: a 60 s loop) so the schedule test is short
           "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "2"}
    env.pop("PREFECT_API_URL", None)
    prefect = Path(sys.executable).with_name("prefect")
    seed_prefect_home(home)
    proc, url = start_server([str(prefect), "server", "start", "--host", "127.0.0.1", "--port", "0"],
                             home / "server.log", "/api/health", env=env)
    yield f"{url}/api"
    stop_server(proc)


@contextmanager
def using_prefect_api(url: str):
    """PREFECT_API_URL is `url` inside the block, for child processes (the environment: CLI calls,
    workers) and for Prefect in this process, whose settings were built from the environment when
    it was imported (a change of os.environ alone does not reach them); both restored after."""
    from prefect.settings import PREFECT_API_URL, temporary_settings
    saved = os.environ.get("PREFECT_API_URL")
    os.environ["PREFECT_API_URL"] = url
    try:
        with temporary_settings(updates={PREFECT_API_URL: url}):
            yield url
    finally:
        if saved is None:
            os.environ.pop("PREFECT_API_URL", None)
        else:
            os.environ["PREFECT_API_URL"] = saved


@pytest.fixture
def prefect_api(prefect_server):
    """This test runs on the session's Prefect server: each CLI call skips the ~6 s temporary-server
    start it needs on its own (tests/test_demo.py still covers that path). Tests that don't ask see
    no PREFECT_API_URL, whatever ran before them."""
    with using_prefect_api(prefect_server) as url:
        yield url


@pytest.fixture(scope="module")
def prefect_api_module(prefect_server):
    """`prefect_api` for a module-scoped fixture (runs it makes once for the module's tests)."""
    with using_prefect_api(prefect_server) as url:
        yield url


def descendants(pid: int) -> list:
    """Every live descendant of `pid` (psutil processes)."""
    import psutil
    return psutil.Process(pid).children(recursive=True)


def left_alive(procs: list, seconds: float = 30) -> list[str]:
    """Waits up to `seconds` for `procs` to end; the command lines of those still running."""
    import psutil
    _, alive = psutil.wait_procs(procs, timeout=seconds)
    return [" ".join(p.cmdline()[:6]) for p in alive if p.status() != psutil.STATUS_ZOMBIE]


def flow_runs(api: str) -> list[dict]:
    """Every flow run in the database of the Prefect server at `api`."""
    import urllib.request
    req = urllib.request.Request(f"{api}/flow_runs/filter", data=b"{}", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


# Variables the CLI and what it imports read when they run, not when a library is imported: a call
# whose environment differs from the warm process's only in these can run as its fork.
# `_MLFLOW_` is MLflow's own telemetry session id, set in whichever process imports mlflow.
RUN_TIME_ENV = ("PREFECT_", "MLFLOW_", "_MLFLOW_", "SFTFLOW_", "PYTEST_", "COLUMNS", "LINES")


class _WarmCLI:
    """tests/cli_zygote.py, started on first use in this pytest process and ended with it (its stdin
    closes): `python -m flows.cli` minus the ~6 s of CPU importing torch, transformers and mlflow.
    Started again when this process's own environment has changed since (a library or a test set a
    variable and left it) or when it has ended."""

    def __init__(self):
        import threading
        self.proc = None
        self.env: dict = {}
        self.busy = threading.Lock()  # one call at a time; a concurrent one runs as a subprocess
        self.refused: list[str] = []  # why the last call ran from scratch
        self.child: int | None = None  # the pid of the last call's fork

    def _start(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()  # it exits once its input ends
            self.proc.wait(timeout=30)
        self.env = dict(os.environ)
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("cli_zygote.py"))],
                                     cwd=ROOT, env=self.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True, bufsize=1)

    @staticmethod
    def _import_time(env: dict) -> dict:
        return {k: v for k, v in env.items() if not k.startswith(RUN_TIME_ENV)}

    def accepts(self, env: dict) -> bool:
        if os.environ.get("SFTFLOW_TEST_FORK", "1") == "0":
            return False
        if self.proc is None or self.proc.poll() is not None or \
                self._import_time(os.environ) != self._import_time(self.env):
            self._start()
        mine, theirs = self._import_time(self.env), self._import_time(env)
        self.refused = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
        return not self.refused

    def _answer(self, key: str):
        line = self.proc.stdout.readline()
        if not line:  # the next call starts a new one (`accepts`)
            raise RuntimeError(f"the warm CLI process (tests/cli_zygote.py) ended during a call, "
                               f"exit status {self.proc.wait(timeout=30)}")
        return json.loads(line)[key]

    def run(self, args: tuple, cwd: Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
        import select
        import tempfile
        with tempfile.TemporaryDirectory() as tmp:
            out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
            self.proc.stdin.write(json.dumps({"argv": list(args), "cwd": str(cwd), "env": env,
                                              "stdout": str(out), "stderr": str(err)}) + "\n")
            pid = self.child = self._answer("pid")
            ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
            if not ready:  # as subprocess.run's timeout does: kill the child, wait, raise
                os.kill(pid, signal.SIGKILL)
            code = self._answer("returncode")
            read = {p: p.read_text(encoding="utf-8", errors="replace") if p.exists() else "" for p in (out, err)}
        argv = [sys.executable, "-m", "flows.cli", *args]
        if not ready:
            raise subprocess.TimeoutExpired(argv, timeout, output=read[out], stderr=read[err])
        return subprocess.CompletedProcess(argv, code, read[out], read[err])


_warm_cli = _WarmCLI()


def sftflow(*args: str, cwd: Path, env: dict | None = None, timeout: int = 600,
            fresh: bool = False) -> subprocess.CompletedProcess:
    """The CLI as a user runs it, with Prefect's home inside the test's folder; it talks to the
    session's Prefect server in a test that asks for `prefect_api`, else starts a temporary one (on a
    new home: from a copy of the run's Prefect database, `seeded_prefect_home`).
    It runs as a fork of a process that has the heavy libraries imported (tests/cli_zygote.py) when
    the call's environment allows; `fresh=True` always starts `python -m flows.cli` from scratch."""
    # COLUMNS/LINES come from the terminal pytest runs in (or a worker's): the CLI's output must not
    # depend on them
    full_env = {**os.environ, "PREFECT_HOME": str(cwd / ".prefect"), "COLUMNS": None, "LINES": None, **(env or {})}
    full_env = {k: v for k, v in full_env.items() if v is not None}  # env={"X": None} unsets X
    with seeded_prefect_home(full_env):
        if not fresh and _warm_cli.busy.acquire(blocking=False):
            try:
                if _warm_cli.accepts(full_env):
                    return _warm_cli.run(args, cwd, full_env, timeout)
            finally:
                _warm_cli.busy.release()
        return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=cwd, env=full_env,
                              capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def base_model(cfg) -> str:
    """The config's base model folder (the builtin is built on first use), as the stages get it."""
    from stages.models.base import resolve_model
    from stages.pipeline import plan
    return resolve_model(cfg, plan(cfg).fingerprints["models"])


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """The builtin tokenizer alone, as a local model folder (its tokenizer then never depends on the data)."""
    from transformers import AutoTokenizer

    from stages.core.config import load_config
    tmp = tmp_path_factory.mktemp("tok")
    AutoTokenizer.from_pretrained(base_model(load_config(write_config(tmp, tiny_config_dict(tmp))))).save_pretrained(
        tmp / "tokenizer")
    return tmp / "tokenizer"


def wait_for(predicate, timeout: float, what: str, proc, poll: float = 2):
    """`predicate()`'s first truthy value within `timeout` s, asserting meanwhile that `proc` (a server or
    `sftflow serve` the test started) still runs."""
    import time
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        assert proc.poll() is None, f"serve exited early: {proc.stdout.read()[-3000:]}"
        time.sleep(poll)
    raise AssertionError(f"timed out waiting for {what}")
