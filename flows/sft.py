"""The Prefect flows: thin tasks around `stages.pipeline.run_stage`, one per stage of the plan
(prepare, the reference stages baseline and champion, train, evaluate, register).

The flow validates the config and plans once (or takes the CLI's plan); every task gets that
plan. The stage folder's manifest is the only cache: a task whose folder is complete returns
at once in a `Cached` state, so the Prefect UI shows what ran and what was reused, and
Prefect keeps no result store of its own.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable

from prefect import flow, get_run_logger, task
from prefect.artifacts import (create_markdown_artifact, create_progress_artifact, create_table_artifact,
                               update_progress_artifact)
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run
from prefect.states import Completed

from flows.servers.prefect_server import TEMPORARY_SERVER_ENV
from stages.core.quarantine import note as quarantine_note
from stages.core.config import check_overrides_allowed, load_config
from stages.core.errors import ConfigError, DataError
from stages.core.machine.process_env import apply_process_policy, exit_without_full_collections
from stages.evaluate.report import COLUMNS, table_cells
from stages.launch.launcher import request_stop
from stages.pipeline import KEY_METRIC, STAGES, UPSTREAM, Plan, launch_ahead, plan, requires, run_stage, upstream


def tell_torchrun_on_sigterm() -> None:
    """While a flow runs, Prefect's SIGTERM handler (not the CLI's) is installed: it raises
    TerminationSignal, and an exception raised while a finalizer runs is lost ("Exception ignored in
    ...", seen in CI: the CLI then waited on a training nobody stopped). So SIGTERM also tells every
    torchrun tree to stop, as the CLI's handler does.

    Prefect has no public hook for it, and a handler of our own over Prefect's is no answer: a served
    run's cancel is acknowledged only while the installed handler *is* Prefect's
    `prefect.utilities.engine._prefect_sigterm_handler` (`can_ack_control_intent`, by identity), and
    Prefect installs it by that name (`capture_sigterm`) before the flow's body runs. So ours takes
    that name and, once, the handler's place in the signal table. tests/test_lost_interrupt.py fails
    when Prefect renames it; until then a Prefect without the name gets our handler chained in front
    of whatever is installed."""
    import prefect.utilities.engine as engine
    bridge = getattr(engine, "_prefect_sigterm_handler", None)
    if bridge is None:
        _chain_sigterm()
        return
    if getattr(bridge, "tells_torchrun", False):  # an earlier flow in this process: installed as ours
        return

    def handler(sig_num: int, *args: object):
        request_stop()
        return bridge(sig_num, *args)
    handler.tells_torchrun = True
    # under Prefect's own lock, so that its identity check never sees the name and the table disagree
    with getattr(engine, "_prefect_sigterm_bridge_lock", None) or nullcontext():
        engine._prefect_sigterm_handler = handler
        try:
            if signal.getsignal(signal.SIGTERM) is bridge:
                signal.signal(signal.SIGTERM, handler)
        except ValueError:  # not the main thread: no handler of this process to swap
            pass


def _chain_sigterm() -> None:
    """Our own SIGTERM handler in front of the installed one (Prefect's, whatever its name)."""
    try:
        previous = signal.getsignal(signal.SIGTERM)
    except ValueError:
        return
    if getattr(previous, "tells_torchrun", False):
        return

    def handler(sig_num: int, frame) -> None:
        request_stop()
        if callable(previous):
            previous(sig_num, frame)
        elif previous == signal.SIG_DFL:  # end as the default would have
            signal.signal(sig_num, signal.SIG_DFL)
            os.kill(os.getpid(), sig_num)
    handler.tells_torchrun = True
    signal.signal(signal.SIGTERM, handler)


STEP_LINE = re.compile(r"^step (\d+)/(\d+)\b")
# MLflow's own logging ("2026/12/01 06:45:02 INFO mlflow.system_metrics...: ..."), timestamped by
# itself: it stays in train.log, out of the task log that a person reads for the training lines.
MLFLOW_LOG_LINE = re.compile(r"^\d{4}/\d{2}/\d{2} \d{2}:\d{2}:\d{2} [A-Z]+ mlflow[\w.]*:")


class _UsageErrorsWithoutTraceback(logging.Filter):
    """A bad config or bad data is reported as its one line (the CLI prints it once more, last);
    Prefect's traceback would only bury it. Every other failure keeps its traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], ConfigError):
            record.exc_info, record.exc_text = None, None
        return True


def at_flow_start() -> None:
    """What a flow run needs of its process, done as each flow starts: a deployment's run starts in a
    process of its own that no CLI entry prepared, and importing this module changes nothing."""
    apply_process_policy(os.environ)
    exit_without_full_collections()
    tell_torchrun_on_sigterm()
    for name in ("prefect.task_runs", "prefect.flow_runs"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _UsageErrorsWithoutTraceback) for f in logger.filters):
            logger.addFilter(_UsageErrorsWithoutTraceback())


def _worth_retrying(task, task_run, state) -> bool:
    """`flow.retries` is for what a second attempt can fix (a killed worker); bad input stays bad."""
    return not isinstance(state.result(raise_on_failure=False), ConfigError)


def _eta(seconds: float) -> str:
    m, sec = divmod(int(round(seconds)), 60)
    return f"{m // 60}:{m % 60:02d}:{sec:02d}" if m >= 60 else f"{m}:{sec:02d}"


def _training_progress(logger) -> Callable[[str], None]:
    """Forwards torchrun's lines to the task log (MLflow's own logging left in train.log) and mirrors
    `step k/N` into a progress artifact whose description says the step and the time left."""
    state: dict[str, Any] = {"id": None, "last": -1.0, "first": None}

    def on_line(line: str) -> None:
        if MLFLOW_LOG_LINE.match(line):
            return
        logger.info(line)
        m = STEP_LINE.match(line)
        if not m:
            return
        k, n = int(m.group(1)), max(int(m.group(2)), 1)
        pct = 100.0 * k / n
        if state["first"] is None:  # the pace from the first step seen (a resumed run starts past 1)
            state["first"] = (k, time.time())
        k0, t0 = state["first"]
        eta = f", {_eta((time.time() - t0) / (k - k0) * (n - k))} left" if k > k0 and k < n else ""
        description = f"training: step {k}/{n}{eta}" if k < n else f"training: step {n}/{n}, done"
        if state["id"] is None:
            state["id"] = create_progress_artifact(pct, key="sftflow-training", description=description)
        elif pct - state["last"] >= 1 or k == n:
            update_progress_artifact(state["id"], pct, description=description)
        else:
            return
        state["last"] = pct
    return on_line


def _fresh(value: dict) -> dict:
    """A copy that shares no object with the plan. Prefect links a task's result and the items in it to
    the task run by identity, and the plan every later task gets holds the same fingerprint strings:
    a shared one would draw an edge from this task to every task after it."""
    return json.loads(json.dumps(value))


# The stage folders are the cache (see stages/core/cache/artifacts.py); Prefect keeps none.
_opts = dict(cache_policy=NO_CACHE, persist_result=False, retry_condition_fn=_worth_retrying)


REJECTED = "rejected"  # the folder beside a drop that the gate stopped, in a served run


def _set_aside(file: Path) -> Path:
    """`<folder>/rejected/<name>.rejected` (`.rejected.2`, ... when taken): under a folder of its own and with
    a suffix of its own, so that neither `drops/*.jsonl` nor `drops/**/*.jsonl` finds it again."""
    folder = file.parent / REJECTED
    folder.mkdir(exist_ok=True)
    dest, k = folder / f"{file.name}.rejected", 1
    while dest.exists():
        k += 1
        dest = folder / f"{file.name}.rejected.{k}"
    file.rename(dest)
    return dest


def _gate_stopped(p: Plan, e: DataError, logger) -> DataError:
    """A drop the data gate stopped: recorded in MLflow (a failed run `rejected <file>`, tag
    `sftflow.gate=rejected`) and, in a served run (`serve`, `serve --on-data`: a loop that retrains on
    arrival), its training file moved to `<folder>/rejected/`, so later runs go on without it instead of
    failing on it until a person moves it. A run a person starts (`sftflow run`) leaves their files where
    they are. The error to raise: the gate's line, plus where the file went."""
    gate = e.gate
    file = Path(gate["what"])
    moved = None
    if os.environ.get(SERVED_CONFIG_ENV) and gate["stage"] == "prepare" and file.is_file():
        try:
            moved = _set_aside(file)
        except OSError as err:
            logger.warning(f"could not move {file} aside: {err}")
    line = str(e) + (f"; moved {file} to {moved}, later runs go on without it" if moved else "")
    try:
        from stages.tracking.gate import record_rejected
        url = flow_run_url()
        run_id = record_rejected(p.cfg, gate, line, str(moved) if moved else None,
                                 {"prefect.flow_run_id": str(flow_run.id or ""), "prefect.flow_run_url": url or ""})
        logger.info(f"mlflow: the rejected drop is run {run_id} (tag sftflow.gate=rejected) in experiment "
                    f"'{p.cfg.registry.experiment}'")
    except Exception as err:  # noqa: BLE001 - the gate's stop stands whether or not MLflow hears of it
        logger.warning(f"mlflow: could not record the rejected drop ({type(err).__name__}: {err})")
    error = DataError(line)
    error.gate = {**gate, "moved_to": str(moved) if moved else None}
    return error


def _stage_task(stage: str):
    """The Prefect task of `stage`: runs it with `run_stage` (its folder is the cache) and logs to the
    task run; a reused folder ends as a `Cached` state. `tags` (train, register): the MLflow run's."""
    def task_fn(p: Plan, force: bool = False, tags: dict | None = None):
        logger = get_run_logger()
        on_line = _training_progress(logger) if stage == "train" else logger.info
        try:
            result = run_stage(p, stage, force=force, on_line=on_line, tags=tags)
        except DataError as e:
            if getattr(e, "gate", None) is None:
                raise
            raise _gate_stopped(p, e, logger) from None
        logger.info(f"{stage} {'reused' if result.cached else 'done'} -> {result.path}")
        if stage == "register":
            m = result.metrics
            logger.info(f"model version {m['version']}, aliases {', '.join(m['aliases']) or 'none'}"
                        + (f"; {m['alias_reason']}" if m.get("alias_reason") else ""))
        if result.cached:
            return Completed(name="Cached", message=f"stage folder {result.path} is complete",
                             data=_fresh(result.to_dict()))
        return _fresh(result.to_dict())
    # Prefect keys a task by its function's name and code: one name per stage keeps them apart
    task_fn.__name__ = task_fn.__qualname__ = f"{stage}_task"
    return task(name=stage, **_opts)(task_fn)


TASKS = {stage: _stage_task(stage) for stage in STAGES}


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                              cwd=Path(__file__).resolve().parent).stdout.strip() or "unknown"
    except Exception:  # noqa: BLE001 - no git, not a repository: the commit is just unknown
        return "unknown"


def flow_run_url() -> str | None:
    """This flow run's page in the Prefect UI, when a UI will be there to show it."""
    if os.environ.get(TEMPORARY_SERVER_ENV):
        return None
    return flow_run.ui_url or None


def configured_task(stage: str, p: Plan, force: bool, label: str | None = None):
    """(the stage's task with the config's retries and timeout, its keyword arguments); `label` names
    the task run (a sweep's trial)."""
    f = p.cfg.flow
    # A retried train finds its partial folder and resumes from the newest checkpoint.
    t = TASKS[stage].with_options(retries=f.retries, retry_delay_seconds=f.retry_delay_seconds,
                                  timeout_seconds=f.timeout_seconds,
                                  **({"task_run_name": f"{stage} [{label}]"} if label else {}))
    kwargs: dict[str, Any] = dict(p=p, force=force)
    if stage in ("train", "register"):  # tags of the MLflow run (opened by train, finished by register)
        url = flow_run_url()
        kwargs["tags"] = {"sftflow.git_commit": _git_commit(), "prefect.flow_run_id": str(flow_run.id or ""),
                          **({"prefect.flow_run_url": url} if url else {})}
    return t, kwargs


def run_stage_task(stage: str, p: Plan, force: bool, states: dict, label: str | None = None) -> dict:
    """Runs `stage` after the upstream stages of this flow run (`states`: stage -> its final state),
    which become its inputs in Prefect, so the run graph draws the pipeline's edges."""
    t, kwargs = configured_task(stage, p, force, label)
    t0 = time.time()
    # the state, not the value: a task that returns a `Cached` state would hand back that state
    states[stage] = t(return_state=True, wait_for=[states[u] for u in upstream(p, stage) if u in states], **kwargs)
    result = dict(states[stage].result())
    # the task's whole time, Prefect's share included, but what it queued for the machine's cores (the stage
    # said how long, in its log)
    result["seconds"] = round(time.time() - t0 - result.get("waited", 0.0), 2)
    return result


def update_flow_run(**fields) -> None:
    """Renames or tags this flow run; the run itself never fails over how it is labelled."""
    if flow_run.id is None:
        return
    try:
        from prefect.client.orchestration import get_client
        with get_client(sync_client=True) as client:
            client.update_flow_run(flow_run.id, **fields)
    except Exception as e:  # noqa: BLE001
        get_run_logger().warning(f"could not label the flow run: {e}")


def flow_run_name(config_path: str | None, fingerprints: dict | None, stage: str | None = None) -> str:
    """`<config>-<train fingerprint>`, or `<config>-<stage>-<its fingerprint>` for `sft_stage`: the same
    work has the same name in every run, and a random name says nothing."""
    fp = (fingerprints or {}).get(stage or "train", "")[:8]
    return "-".join(x for x in (Path(config_path).stem if config_path else "sftflow", stage, fp) if x)


def _initial_name() -> str:
    """The name a run starts with and keeps: `<config>-<fingerprint>` when the CLI passed its plan, the
    config's name for a deployment's run (its fingerprint becomes a tag, `_name_flow_run`)."""
    params = flow_run.parameters
    return flow_run_name(params.get("config_path"), (params.get("planned") or {}).get("fingerprints"),
                         params.get("stage"))


def _name_flow_run(p: Plan, config_path: str | None, stage: str | None = None) -> None:
    """A run started with its plan (the CLI) is named after its work from the start. A deployment's run
    plans only once it runs: it keeps the name it started with (renaming it made the UI's run list
    show one run under two names) and gets its fingerprint as a tag instead."""
    if flow_run.id is None or flow_run.name == flow_run_name(config_path, p.fingerprints, stage):
        return
    tag = f"fingerprint:{p.fingerprints[stage or 'train'][:8]}"
    update_flow_run(tags=[tag, *(t for t in (flow_run.tags or []) if t != tag)])


def run_tags(results: list[dict]) -> list[str]:
    """What a run did, as tags to filter runs by, most telling first: `trained` (or `cached` when every
    stage was reused, or `ran:<stage>` per stage that ran when training did not), `version:<n>` and
    `alias:<alias>` when registered."""
    ran = [r["stage"] for r in results if not r["cached"]]
    tags = ["cached"] if not ran else ["trained"] if "train" in ran else [f"ran:{s}" for s in ran]
    reg = next((r for r in results if r["stage"] == "register"), None)
    if reg:
        m = reg["metrics"]
        tags.append(f"version:{m['version']}")
        tags += [f"alias:{a}" for a in m.get("aliases", [])]
    return tags


def _tag_flow_run(p: Plan, results: list[dict], config_path: str | None = None, stage: str | None = None) -> None:
    new = run_tags(results) + [f"model:{p.cfg.registry.model_name}"]
    if flow_run.name != flow_run_name(config_path, p.fingerprints, stage):  # a deployment's run: see _name_flow_run
        new.append(f"fingerprint:{p.fingerprints[stage or 'train'][:8]}")
    update_flow_run(tags=new + [t for t in (flow_run.tags or []) if t not in new])


PROTECTED_ENV, SERVED_CONFIG_ENV = "SFTFLOW_PROTECTED_KEYS", "SFTFLOW_SERVED_CONFIG"


def _plan_from(config_path: str | None, overrides: list[str] | None, planned: dict | None) -> Plan:
    """The CLI plans before the flow starts (its errors exit 2); a deployment run plans here. Runs of a
    served deployment (`sftflow serve` sets the variables, which the Prefect API can't) must use its
    config, and may override only unprotected keys."""
    served = os.environ.get(SERVED_CONFIG_ENV)
    if served:
        if planned is not None or config_path is None or Path(config_path).resolve() != Path(served):
            raise ConfigError(f"runs of this deployment use its config {served}; only `overrides` may change")
        check_overrides_allowed(overrides or [], [k for k in os.environ.get(PROTECTED_ENV, "").split(",") if k])
    if planned is not None:
        return Plan.from_dict(planned)
    if config_path is None:
        raise ValueError("sft_pipeline needs config_path (or a plan)")
    return plan(load_config(config_path, overrides or []))


def shown(v) -> str:
    """A metric as the flow's summaries print it (also the sweep's)."""
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.4g}"
    return "n/a" if v is None else str(v)


def _clip(text: str, n: int = 2000) -> str:
    return text if len(text) <= n else text[:n] + "…"


def _prompt_text(prompt) -> str:
    """The last message of a chat prompt; a harness set's document (a dict) as JSON."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[-1], dict) and "content" in prompt[-1]:
        return str(prompt[-1]["content"])
    return prompt if isinstance(prompt, str) else json.dumps(prompt, ensure_ascii=False)


def _publish_predictions(preds: Path) -> None:
    """Every prediction, wrong answers first (they are what a person looks for), `correct` as the first
    column; texts are cut only past 2,000 characters (the file in the evaluate folder has them whole)."""
    rows = [json.loads(line) for line in preds.read_text(encoding="utf-8").splitlines() if line.strip()]
    wrong = [r for r in rows if not r["correct"]]
    ordered = wrong + [r for r in rows if r["correct"]]
    sets = any("set" in r for r in rows)
    create_table_artifact(
        [{"correct": "yes" if r["correct"] else "no", **({"set": r.get("set", "val")} if sets else {}),
          "prompt": _clip(_prompt_text(r["prompt"])), "reference": _clip(str(r["reference"])),
          "prediction": _clip(r["prediction"])} for r in ordered],
        key="sftflow-eval-predictions",
        description=f"all {len(rows)} held-out predictions, wrong answers first ({len(wrong)} wrong); "
                    f"file: {preds}")


def _link(text: str, url: str | None) -> str:
    return f"[{text}]({url})" if url else f"`{text}`"


def _publish_summary(results: list[dict]) -> None:
    """A markdown run summary (with links to the MLflow run and model version) and a table of eval
    predictions, visible on the flow run's page."""
    lines = ["| stage | fingerprint | cached | seconds | key metric |", "|---|---|---|---|---|"]
    for r in results:
        key, label = KEY_METRIC[r["stage"]]
        lines.append(f"| {r['stage']} | `{r['fingerprint']}` | {'yes' if r['cached'] else 'no'} | "
                     f"{r['seconds']:.1f} | {label} {shown(r['metrics'].get(key))} |")
    by_stage = {r["stage"]: r for r in results}
    for stage in ("prepare", "prepare_eval"):
        left_out = quarantine_note(by_stage[stage]["path"]) if by_stage.get(stage, {}).get("path") else None
        if left_out:
            lines += ["", f"**{stage}**: {left_out}"]
    if "evaluate" in by_stage:
        m = by_stage["evaluate"]["metrics"]
        lines += ["", f"**Held-out accuracy**: base {shown(m.get('base_accuracy'))} → tuned {shown(m['accuracy'])} "
                      f"({m['correct']}/{m['total']}), eval loss {shown(m.get('eval_loss'))}", "",
                  "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
        versus = by_stage["register"]["metrics"].get("vs_champion") if "register" in by_stage else None
        lines += ["| " + " | ".join(cells) + " |" for cells in table_cells(m, versus)]
        preds = Path(by_stage["evaluate"]["path"]) / "predictions.jsonl"
        if preds.is_file():
            _publish_predictions(preds)
    if "register" in by_stage:
        reg = json.loads((Path(by_stage["register"]["path"]) / "registration.json").read_text())
        lines += ["", f"**MLflow**: run {_link(reg['run_id'], reg.get('run_url'))}, model version "
                      f"{_link(reg['model_uri'], reg.get('version_url'))} "
                      f"(aliases: {', '.join(by_stage['register']['metrics']['aliases']) or 'none'}), "
                      f"tracking at `{reg['tracking_uri']}`"]
        why = by_stage["register"]["metrics"].get("alias_reason")
        if why:
            lines += ["", f"**Why these aliases**: {why}"]
    elif "train" in by_stage:
        train = json.loads((Path(by_stage["train"]["path"]) / "manifest.json").read_text())
        run_id = train.get("mlflow_run_id")
        lines += ["", f"**MLflow**: run `{run_id}` holds this training's metrics; register logs the model into it"
                  if run_id else "**MLflow**: training ran without an MLflow run; register logs its metrics"]
    create_markdown_artifact("\n".join(lines), key="sftflow-summary", description="sftflow run summary")


def _registered(results: list[dict]) -> bool:
    """Whether this run registered a version (its register stage ran, not reused)."""
    return any(r["stage"] == "register" and not r["cached"] for r in results)


def _publish_versions(p: Plan, results: list[dict]) -> None:
    """After a run that registered: every version of the config's model as `sftflow models` shows it (the
    day, the data it added, tokens trained, the decision and why, the disk), the month at a glance on the
    flow run's page. The run never fails over it: MLflow may be unreachable by now. A reused register
    registered nothing, so the table is the one an earlier run published, and reading it would cost a
    cached run most of its time (importing MLflow and opening its store: ~2 s of CPU)."""
    if not _registered(results):
        return
    from stages.tracking.registry import VERSION_COLUMNS, list_versions, version_cells
    name = p.cfg.registry.model_name
    try:
        versions = list_versions(p.cfg.resolved_tracking_uri, name, p.cfg.artifacts_path)
    except Exception as e:  # noqa: BLE001 - the table is a view; the run's outcome is already decided
        get_run_logger().warning(f"could not list the versions of {name}: {e}")
        return
    lines = ["| " + " | ".join(VERSION_COLUMNS) + " |", "|" + "---|" * len(VERSION_COLUMNS)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in version_cells(v)) + " |" for v in versions]
    create_markdown_artifact("\n".join(lines), key="sftflow-versions",
                             description=f"the versions of {name} (as `sftflow models` shows them)")


@flow(name="sft_pipeline", log_prints=True, flow_run_name=_initial_name)
def sft_pipeline(config_path: str | None = None, overrides: list[str] | None = None, force: list[str] | None = None,
                 planned: dict | None = None, workdir: str | None = None) -> list[dict]:
    """prepare -> train -> evaluate -> register; `force` names stages to redo (and so everything after them).
    `planned`: a `Plan.to_dict()` made by the caller, used instead of loading `config_path` again.
    `workdir`: where the config's relative paths start (a work-pool deployment's runs start elsewhere)."""
    at_flow_start()
    if workdir:
        os.chdir(workdir)  # a worker runs each flow run in a process of its own
    p = _plan_from(config_path, overrides, planned)
    _name_flow_run(p, config_path)
    forced = set(force or [])
    results, states = [], {}
    with launch_ahead(p, forced=set(forced)):
        for stage in p.stages:
            # forcing a stage changes nothing upstream but redoes everything downstream of it
            redo = stage in forced or any(u in forced for u in UPSTREAM[stage])
            results.append(run_stage_task(stage, p, redo, states))
            if redo:
                forced.add(stage)
    _publish_summary(results)
    _publish_versions(p, results)
    _tag_flow_run(p, results, config_path)
    _apply_retention(p, results)
    return results


def _apply_retention(p: Plan, results: list[dict] | None = None) -> None:
    """`retention.auto`: the disk policy after a run (stages/retention.py), keeping this run's folders,
    so that `serve` keeps itself tidy. Tidying is not the run's result: a failure is said, not raised.
    `results`: the run's stages; when register ran from cache, the registry holds no new version."""
    if not p.cfg.retention.auto:
        return
    from stages.retention import collect
    added = results is None or _registered(results)
    try:
        collect(p.cfg, protect=dict(p.fingerprints), delete=True, on_line=print, used=True, versions_added=added)
    except Exception as e:  # noqa: BLE001 - the run trained and registered; only the tidying failed
        print(f"retention: not applied ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")


@flow(name="sft_stage", log_prints=True, flow_run_name=_initial_name)
def sft_stage(stage: str, config_path: str | None = None, overrides: list[str] | None = None, force: bool = False,
              with_upstream: bool = False, planned: dict | None = None) -> list[dict]:
    """One stage. Upstream stages come from their completed folders; with `with_upstream`, the
    missing ones run first (complete ones are reused)."""
    at_flow_start()
    p = _plan_from(config_path, overrides, planned)
    if stage not in p.stages:
        raise ConfigError(f"this config has no {stage} stage (stages: {', '.join(p.stages)})")
    _name_flow_run(p, config_path, stage)
    results, states = [], {}
    needed = requires(p, stage) if with_upstream else set()  # evaluate --model needs no training
    with launch_ahead(p, runs=needed | {stage}, forced={stage} if force else set()):
        for up in (s for s in p.stages if s in needed):
            results.append(run_stage_task(up, p, False, states))
        results.append(run_stage_task(stage, p, force, states))
    _publish_summary(results)
    _publish_versions(p, results)
    _tag_flow_run(p, results, config_path, stage)
    return results
