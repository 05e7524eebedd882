"""The Prefect flow: four thin tasks around `stages.pipeline.run_stage`.

Each task's cache key is its stage fingerprint (see `StageFingerprint`). A Prefect cache
record only counts while the stage folder is complete: the flow looks at the folder first
and refreshes the cache when the manifest is gone, so a deleted folder re-runs its stage.
"""

from __future__ import annotations

import hashlib
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.cache_policies import CachePolicy
from prefect.runtime import flow_run

from stages.config import SFTConfig, load_config
from stages.pipeline import STAGES, UPSTREAM, StageError, plan, run_stage


@dataclass
class StageFingerprint(CachePolicy):
    """Cache key = the stage fingerprint (config slice, upstream fingerprints, input contents, code)."""

    def compute_key(self, task_ctx, inputs: dict[str, Any], flow_parameters: dict[str, Any], **kwargs) -> str | None:
        root = inputs["config"].get("artifacts_dir", "artifacts")
        scope = hashlib.sha256(str(Path(root).resolve()).encode()).hexdigest()[:8]
        return f"sftflow-{inputs['fingerprint']}-{scope}"


def _stage(stage: str, config: dict, fingerprint: str, force: bool, tags: dict | None = None) -> dict:
    logger = get_run_logger()
    p = plan(SFTConfig.model_validate(config))
    if p.fingerprints[stage] != fingerprint:
        # Data or code edited after the flow planned: running now would file new outputs under an old key.
        raise StageError(f"{stage}: inputs changed while the flow was running (fingerprint {fingerprint} -> "
                         f"{p.fingerprints[stage]}); run the flow again")
    result = run_stage(p, stage, force=force, on_line=logger.info, extra_tags=tags)
    logger.info(f"{stage} {'cached' if result.cached else 'done'} -> {result.path}")
    return result.to_dict()


_opts = dict(cache_policy=StageFingerprint(), persist_result=True, retries=0)


@task(name="prepare", **_opts)
def prepare_task(config: dict, fingerprint: str, force: bool = False) -> dict:
    return _stage("prepare", config, fingerprint, force)


@task(name="train", **_opts)
def train_task(config: dict, fingerprint: str, force: bool = False) -> dict:
    return _stage("train", config, fingerprint, force)


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
    t = TASKS[stage].with_options(refresh_cache=force or not complete)
    kwargs: dict[str, Any] = dict(config=cfg.model_dump(mode="json"), fingerprint=p.fingerprints[stage], force=force)
    if stage == "register":
        kwargs["tags"] = {"sftflow.git_commit": _git_commit(), "prefect.flow_run_id": str(flow_run.id or "")}
    t0 = time.time()
    state = t(return_state=True, **kwargs)
    result = state.result()
    result["cached"] = bool(result.get("cached")) or state.name == "Cached"
    result["seconds"] = round(time.time() - t0, 2)
    return result


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
    return results


@flow(name="sft_stage", log_prints=True)
def sft_stage(stage: str, config_path: str, overrides: list[str] | None = None, force: bool = False) -> list[dict]:
    """One stage on its own; upstream stages must already be complete (their folders are reused)."""
    cfg = load_config(config_path, overrides or [])
    return [_run_one(stage, cfg, force)]
