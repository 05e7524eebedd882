"""The Prefect flows: four thin tasks around `stages.pipeline.run_stage`.

Each task's cache key is its stage fingerprint (see `StageFingerprint`). A Prefect cache
record only counts while the stage folder is complete: the flow looks at the folder first
and refreshes the cache when the manifest is gone, so a deleted folder re-runs its stage.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_progress_artifact, create_table_artifact, update_progress_artifact
from prefect.cache_policies import CachePolicy
from prefect.runtime import flow_run

from stages.config import SFTConfig, load_config
from stages.pipeline import KEY_METRIC, STAGES, UPSTREAM, StageError, plan, run_stage, upstream

STEP_LINE = re.compile(r"^step (\d+)/(\d+)\b")


@dataclass
class StageFingerprint(CachePolicy):
    """Cache key = the stage fingerprint (config slice, upstream fingerprints, input contents, code)."""

    def compute_key(self, task_ctx, inputs: dict[str, Any], flow_parameters: dict[str, Any], **kwargs) -> str | None:
        root = inputs["config"].get("artifacts_dir", "artifacts")
        scope = hashlib.sha256(str(Path(root).resolve()).encode()).hexdigest()[:8]
        return f"sftflow-{inputs['fingerprint']}-{scope}"


def _training_progress(logger) -> Callable[[str], None]:
    """Forwards torchrun's lines to the task log and mirrors `step N/M` into a progress artifact."""
    state: dict[str, Any] = {"id": None, "last": -1.0}

    def on_line(line: str) -> None:
        logger.info(line)
        m = STEP_LINE.match(line)
        if not m:
            return
        pct = 100.0 * int(m.group(1)) / max(int(m.group(2)), 1)
        if state["id"] is None:
            state["id"] = create_progress_artifact(pct, key="sftflow-training", description="training steps")
        elif pct - state["last"] >= 1 or pct == 100:
            update_progress_artifact(state["id"], pct)
        state["last"] = pct
    return on_line


def _stage(stage: str, config: dict, fingerprint: str, force: bool, tags: dict | None = None) -> dict:
    logger = get_run_logger()
    p = plan(SFTConfig.model_validate(config))
    if p.fingerprints[stage] != fingerprint:
        # Data or code edited after the flow planned: running now would file new outputs under an old key.
        raise StageError(f"{stage}: inputs changed while the flow was running (fingerprint {fingerprint} -> "
                         f"{p.fingerprints[stage]}); run the flow again")
    on_line = _training_progress(logger) if stage == "train" else logger.info
    result = run_stage(p, stage, force=force, on_line=on_line, extra_tags=tags)
    logger.info(f"{stage} {'cached' if result.cached else 'done'} -> {result.path}")
    return result.to_dict()


_opts = dict(cache_policy=StageFingerprint(), persist_result=True)


@task(name="prepare", **_opts)
def prepare_task(config: dict, fingerprint: str, force: bool = False) -> dict:
    return _stage("prepare", config, fingerprint, force)


@task(name="train", **_opts)
def train_task(config: dict, fingerprint: str, force: bool = False, tags: dict | None = None) -> dict:
    return _stage("train", config, fingerprint, force, tags)


@task(name="evaluate", **_opts)
def evaluate_task(config: dict, fingerprint: str, force: bool = False) -> dict:
    return _stage("evaluate", config, fingerprint, force)


@task(name="register", **_opts)
def register_task(config: dict, fingerprint: str, force: bool = False, tags: dict | None = None) -> dict:
    return _stage("register", config, fingerprint, force, tags)


TASKS = {"prepare": prepare_task, "train": train_task, "evaluate": evaluate_task, "register": register_task}


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                              cwd=Path(__file__).resolve().parent).stdout.strip() or "unknown"
    except Exception:
        return "unknown"


def _run_one(stage: str, cfg: SFTConfig, force: bool) -> dict:
    p = plan(cfg)
    complete = p.status(stage) == "complete"
    f = cfg.flow
    # A retried train finds its partial folder and resumes from the newest checkpoint.
    t = TASKS[stage].with_options(refresh_cache=force or not complete, retries=f.retries,
                                  retry_delay_seconds=f.retry_delay_seconds, timeout_seconds=f.timeout_seconds)
    kwargs: dict[str, Any] = dict(config=cfg.model_dump(mode="json"), fingerprint=p.fingerprints[stage], force=force)
    if stage in ("train", "register"):  # tags of the MLflow run (opened by train, finished by register)
        kwargs["tags"] = {"sftflow.git_commit": _git_commit(), "prefect.flow_run_id": str(flow_run.id or "")}
    t0 = time.time()
    state = t(return_state=True, **kwargs)
    result = state.result()
    result["cached"] = bool(result.get("cached")) or state.name == "Cached"
    result["seconds"] = round(time.time() - t0, 2)
    return result


def _publish_summary(results: list[dict]) -> None:
    """A markdown run summary and a table of eval predictions, visible on the flow run's page."""
    lines = ["| stage | fingerprint | cached | seconds | key metric |", "|---|---|---|---|---|"]
    for r in results:
        key, label = KEY_METRIC[r["stage"]]
        lines.append(f"| {r['stage']} | `{r['fingerprint']}` | {'yes' if r['cached'] else 'no'} | "
                     f"{r['seconds']:.1f} | {label} {r['metrics'].get(key)} |")
    by_stage = {r["stage"]: r for r in results}
    if "evaluate" in by_stage:
        m = by_stage["evaluate"]["metrics"]
        lines += ["", f"**Held-out accuracy**: base {m.get('base_accuracy', 'n/a')} → tuned {m['accuracy']} "
                      f"({m['correct']}/{m['total']}), eval loss {m.get('eval_loss')}"]
        preds = Path(by_stage["evaluate"]["path"]) / "predictions.jsonl"
        if preds.is_file():
            rows = [json.loads(line) for line in preds.read_text(encoding="utf-8").splitlines()[:20]]
            create_table_artifact(
                [{"prompt": r["prompt"][-1]["content"], "reference": r["reference"], "prediction": r["prediction"],
                  "correct": r["correct"]} for r in rows],
                key="sftflow-eval-predictions", description="first 20 held-out predictions")
    if "register" in by_stage:
        reg = json.loads((Path(by_stage["register"]["path"]) / "registration.json").read_text())
        lines += ["", f"**MLflow**: run `{reg['run_id']}` at `{reg['tracking_uri']}`; model "
                      f"`{reg['model_uri']}` aliases {', '.join(reg['aliases']) or 'none'}"]
    create_markdown_artifact("\n".join(lines), key="sftflow-summary", description="sftflow run summary")


@flow(name="sft_pipeline", log_prints=True)
def sft_pipeline(config_path: str, overrides: list[str] | None = None, force: list[str] | None = None) -> list[dict]:
    """prepare -> train -> evaluate -> register; `force` names stages to redo (and so everything after them)."""
    cfg = load_config(config_path, overrides or [])
    forced = set(force or [])
    results = []
    for stage in STAGES:
        # forcing a stage changes nothing upstream but redoes everything downstream of it
        redo = stage in forced or any(u in forced for u in UPSTREAM[stage])
        results.append(_run_one(stage, cfg, redo))
        if redo:
            forced.add(stage)
    _publish_summary(results)
    return results


@flow(name="sft_stage", log_prints=True)
def sft_stage(stage: str, config_path: str, overrides: list[str] | None = None, force: bool = False,
              with_upstream: bool = False) -> list[dict]:
    """One stage. Upstream stages come from their completed folders; with `with_upstream`, the
    missing ones run first (complete ones stay cached)."""
    cfg = load_config(config_path, overrides or [])
    results = []
    if with_upstream:
        needed = upstream(cfg, stage)  # evaluate --model needs prepare only: nothing is trained for it
        for up in (s for s in STAGES if s in needed):
            results.append(_run_one(up, cfg, False))
    results.append(_run_one(stage, cfg, force))
    _publish_summary(results)
    return results
