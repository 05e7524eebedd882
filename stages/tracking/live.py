"""Live MLflow metrics: rank 0 sends every `metrics.jsonl` row to the MLflow run while training runs.

The run is created before torchrun starts (`stages/tracking/run.py`, `training_run`) and reaches the workers
as `MLFLOW_RUN_ID` + `MLFLOW_TRACKING_URI`; without `MLFLOW_RUN_ID` nothing here runs. Rank 0
queues each step's row; one background thread imports MLflow, starts system metrics
(`system/*`, needs psutil) and sends rows with `MlflowClient.log_batch`. The training loop never
waits on MLflow, and a failure prints one warning and ends live logging: training goes on and
the train stage sends the rest from `metrics.jsonl` when it ends.

Live logging starts once training looks at least `registry.live_after_seconds` long (elapsed,
or estimated from the steps so far), with the rows written until then: a run of a few seconds
is not worth importing MLflow into a worker, and the train stage logs its rows when it ends.

One point per step: a metric is only sent for steps after the last step the run already holds
for it, so a resumed run (SIGKILL, task retry) neither repeats nor skips a step.

`send` is the only place metrics leave for MLflow (live, the train stage's catch-up, register's
backfill and eval metrics). The thread is ours rather than MLflow's asynchronous logging
(`synchronous=False`) because importing MLflow and building its client take seconds in a
worker, and an unreachable server must cost the loop nothing; MLflow's own
`SystemMetricsMonitor` supplies the system metrics.
"""

from __future__ import annotations

import json
import os
import queue
import re
import sys
import threading
import time
from pathlib import Path

from stages.core.stats.scores import named_sets

__fingerprint__ = False  # observability only: what it sends never changes a stage folder

RUN_ID_ENV = "MLFLOW_RUN_ID"


def read_metrics_file(path: Path) -> list[dict]:
    """The rows of a `metrics.jsonl`; a torn last line (a kill mid-write) is left out."""
    path = Path(path)
    if not path.exists():
        return []
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    rows = []
    for i, line in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path}:{i + 1}: not a JSON row") from None
    return rows


def metric_name(key: str) -> str:
    """`loss` -> `train/loss`, `val_loss` -> `val/loss`."""
    return "val/" + key[4:] if key.startswith("val_") else "train/" + key


# MLflow draws one chart per metric key and groups the charts of a run into sections by the key's
# prefix, so `train/loss` and `val/loss` land eight charts apart; the two losses also go out as
# `loss/train` and `loss/val`, one section holding both curves side by side.
LOSS_SECTION = {"loss": "loss/train", "val_loss": "loss/val"}


def is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def row_metrics(row: dict) -> dict[str, float]:
    values = {k: float(v) for k, v in row.items() if k != "step" and is_number(v)}
    return {**{metric_name(k): v for k, v in values.items()},
            **{LOSS_SECTION[k]: v for k, v in values.items() if k in LOSS_SECTION}}


# The eval numbers worth a chart; register puts the rest (counts, token-level figures) in a table.
# evaluate's key -> the chart's name. `eval_loss` is the loss of the eval file's reference answers
# (often one word: "Paris"), not of whole replies like `val/loss`, hence its own name.
CHARTED_EVAL = {"accuracy": "accuracy", "base_accuracy": "base_accuracy", "eval_loss": "reference_loss",
                "delta": "delta", "delta_low": "delta_low", "delta_high": "delta_high"}
VS_BASE = ("wins", "losses", "p_value")  # the paired comparison with the base model (core/stats/paired.py)
VS_CHAMPION = ("accuracy", "delta", "delta_low", "delta_high", "wins", "losses", "p_value")


def eval_metric_values(eval_metrics: dict) -> dict[str, float]:
    """MLflow metric name -> value: `eval/<key>` for the primary set, `eval/<set>/<key>` for every
    named set; accuracy, base accuracy, loss, and the paired delta to the base model with its 95%
    interval and win/loss counts."""
    def charted(prefix: str, m: dict) -> dict[str, float]:
        out = {f"{prefix}/{name}": float(m[k]) for k, name in CHARTED_EVAL.items() if is_number(m.get(k))}
        out.update({f"{prefix}/{k}": float(m["vs_base"][k]) for k in VS_BASE
                    if is_number((m.get("vs_base") or {}).get(k))})
        return out
    out = charted("eval", eval_metrics)
    for name, m in named_sets(eval_metrics).items():
        out.update(charted(f"eval/{name}", m))
        out.update(lm_eval_metric_values(name, m.get("lm_eval") or {}))
    return out


def lm_eval_metric_values(set_name: str, numbers: dict) -> dict[str, float]:
    """A harness set's lm-eval numbers under lm-eval's names: `acc,none` -> `eval/<set>/lm_eval/acc`,
    `exact_match,strict-match` -> `eval/<set>/lm_eval/exact_match/strict-match` (MLflow allows no commas)."""
    out = {}
    for key, v in numbers.items():
        metric, _, filt = key.partition(",")
        name = metric if filt in ("", "none") else f"{metric}/{filt}"
        out[f"eval/{set_name}/lm_eval/" + re.sub(r"[^\w\-. /:]", "_", name)] = float(v)
    return out


def champion_metric_values(comparison: dict[str, dict]) -> dict[str, float]:
    """`eval/<set>/champion_<key>`: the champion's accuracy and the paired comparison with it, per set
    (register's `champion_comparison`)."""
    return {f"eval/{name}/champion_{k}": float(c[k]) for name, c in comparison.items() for k in VS_CHAMPION
            if is_number(c.get(k))}


def last_logged_steps(client, run_id: str) -> dict[str, int]:
    """Metric name -> the largest step the run holds for it."""
    data = client.get_run(run_id).data
    objs = getattr(data, "_metric_objs", None)  # the latest point of each metric, i.e. its largest step
    if objs is not None:
        return {m.key: int(m.step) for m in objs}
    return {k: max(m.step for m in client.get_metric_history(run_id, k)) for k in data.metrics}


def new_points(rows: list[dict], logged: dict[str, int], times_ms: list[int] | None = None) -> list:
    """MLflow `Metric`s for the (metric, step) pairs after `logged`'s steps; `logged` is not changed.
    `times_ms`: when each row was written (default: now)."""
    from mlflow.entities import Metric
    now = int(time.time() * 1000)
    last = dict(logged)
    out = []
    for i, row in enumerate(rows):
        step, ts = int(row["step"]), times_ms[i] if times_ms else now
        for name, value in row_metrics(row).items():
            if step > last.get(name, 0):
                out.append(Metric(name, value, ts, step))
                last[name] = step
    return out


def send(client, run_id: str, metrics: list) -> None:
    for i in range(0, len(metrics), 1000):  # log_batch's limit
        client.log_batch(run_id, metrics=metrics[i:i + 1000], synchronous=True)


def send_values(client, run_id: str, values: dict[str, float], step: int = 0) -> None:
    """One point per name (e.g. eval metrics)."""
    from mlflow.entities import Metric
    now = int(time.time() * 1000)
    send(client, run_id, [Metric(k, float(v), now, step) for k, v in values.items()])


def sync_rows(client, run_id: str, rows: list[dict]) -> int:
    """Logs the rows' points the run does not hold yet (register's backfill); returns how many."""
    metrics = new_points(rows, last_logged_steps(client, run_id))
    send(client, run_id, metrics)
    return len(metrics)


class LiveMetrics:
    """Rank 0's non-blocking metrics sender; `log(row)` queues, `close()` flushes (bounded wait)."""

    def __init__(self, run_id: str, tracking_uri: str | None = None, backlog: list[dict] | None = None,
                 system_metrics: bool = True):
        self.run_id, self.tracking_uri, self.system_metrics = run_id, tracking_uri, system_metrics
        self.sent = 0
        self.failed: str | None = None
        self._q: queue.Queue = queue.Queue()
        for row in backlog or []:  # rows of an earlier attempt that may not have reached the run
            self.log(row)
        self._thread = threading.Thread(target=self._run, name="sftflow-mlflow", daemon=True)
        self._thread.start()

    def log(self, row: dict) -> None:
        self._q.put((row, int(time.time() * 1000)))

    def close(self, timeout: float = 120.0) -> None:
        self._q.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._warn(f"still sending after {timeout:.0f} s; the train stage sends the rest when it ends")

    def _warn(self, msg: str) -> None:
        print(f"mlflow: live metrics: {msg}", file=sys.stderr, flush=True)

    def _run(self) -> None:
        monitor = None
        try:
            from mlflow.tracking import MlflowClient
            client = MlflowClient(self.tracking_uri)
            logged = last_logged_steps(client, self.run_id)
            if self.system_metrics:
                monitor = self._start_system_metrics()
        except Exception as e:  # noqa: BLE001 - logging must never stop training
            self.failed = f"{type(e).__name__}: {e}"
            self._warn(f"disabled ({self.failed}); training goes on, the train stage sends the metrics when it ends")
            return
        done = False
        while not done:
            rows = [self._q.get()]
            while True:  # whatever queued up meanwhile goes in the same request
                try:
                    rows.append(self._q.get_nowait())
                except queue.Empty:
                    break
            done = None in rows
            rows = [r for r in rows if r is not None]
            if self.failed or not rows:
                continue
            points = new_points([r for r, _ in rows], logged, [t for _, t in rows])
            try:
                send(client, self.run_id, points)
            except Exception as e:  # noqa: BLE001
                self.failed = f"{type(e).__name__}: {e}"
                self._warn(f"disabled after an error ({self.failed}); training goes on, the train stage sends the rest")
                continue
            self.sent += len(points)
            for p in points:
                logged[p.key] = p.step
        if monitor is not None:
            try:
                monitor.finish()
                last = monitor.aggregate_metrics()  # samples since the last interval: a short run has no other
                if last:
                    monitor.publish_metrics(last)
                    monitor.mlflow_logger.flush()
            except Exception:  # noqa: BLE001
                pass

    def _start_system_metrics(self):
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor
            monitor = SystemMetricsMonitor(self.run_id, resume_logging=True, tracking_uri=self.tracking_uri)
            monitor.start()
            return monitor
        except Exception as e:  # noqa: BLE001 - e.g. psutil missing
            self._warn(f"no system metrics ({type(e).__name__}: {e})")
            return None


class RankZeroMetrics:
    """What the worker's rank 0 calls after writing each row: starts `LiveMetrics` (with the rows
    already in metrics.jsonl as backlog) once training looks at least `after_seconds` long."""

    def __init__(self, metrics_path, start_step: int, total_steps: int, after_seconds: float):
        self.metrics_path, self.start_step, self.total_steps = metrics_path, start_step, total_steps
        self.after = after_seconds
        self.run_id = os.environ.get(RUN_ID_ENV)
        self.t0 = time.perf_counter()
        self.sender: LiveMetrics | None = None

    def log(self, row: dict) -> None:
        if self.sender is not None:
            self.sender.log(row)
            return
        if not self.run_id or self.after < 0:
            return
        elapsed, done = time.perf_counter() - self.t0, int(row["step"]) - self.start_step
        expected = elapsed / max(done, 1) * (self.total_steps - self.start_step)
        if max(elapsed, expected) >= self.after:
            self.sender = LiveMetrics(self.run_id, os.environ.get("MLFLOW_TRACKING_URI"),
                                      backlog=read_metrics_file(self.metrics_path))

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
