"""The stage graph: which config slice each stage reads, its fingerprint, and how to run it.

Orchestrators (the Prefect flow, the CLI, tests) go through `plan()` and `run_stage()`; they
never need to know what a stage does inside.

    models ─┐
    prepare ─► train ─► evaluate ─► register
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from .artifacts import (
    StageResult,
    cached_result,
    code_version,
    fingerprint,
    input_digest,
    is_complete,
    stage_dir,
    stage_lock,
)
from .config import ConfigError, SFTConfig, expand_paths
from .errors import StageError  # noqa: F401  (re-exported for orchestrators)
from .evaluate.scorers import scorer_identity
from .models import eval_model_identity, model_fingerprint, resolve_model

STAGES = ("prepare", "train", "evaluate", "register")
EXECUTION_ONLY = {"nproc_per_node", "nnodes", "node_rank", "rdzv_endpoint", "activation_checkpointing", "compile"}
UPSTREAM = {"prepare": (), "train": ("prepare",), "evaluate": ("train", "prepare"), "register": ("evaluate", "train", "prepare")}


@dataclass
class Plan:
    cfg: SFTConfig
    fingerprints: dict[str, str]

    def folder(self, stage: str):
        return stage_dir(self.cfg.artifacts_path, stage, self.fingerprints[stage])

    def status(self, stage: str) -> str:
        return "complete" if is_complete(self.folder(stage)) else "missing"


def _digests(cfg: SFTConfig, paths: list[str], key: str) -> list[str]:
    return [input_digest(p, cfg.artifacts_path) for p in expand_paths(paths, key)]


def plan(cfg: SFTConfig) -> Plan:
    """Fingerprints of every stage from the config and input *contents*; runs nothing."""
    d, a, r = cfg.data, cfg.actor, cfg.runner
    model_fp = model_fingerprint(cfg)
    prepare = fingerprint(
        "prepare", code=code_version("prepare"), model=model_fp, trust_remote_code=a.model.trust_remote_code,
        # num_proc only spreads the work: the shards are identical for any value
        data=d.model_dump(exclude={"train_data_paths", "val_data_paths", "num_proc"}),
        train=_digests(cfg, d.train_data_paths, "data.train_data_paths"),
        val=_digests(cfg, d.val_data_paths, "data.val_data_paths"))
    train = fingerprint(
        "train", code=code_version("train", "models"), prepare=prepare, model=model_fp,
        # How the work is spread (world size, rendezvous) and memory/speed knobs don't change the math,
        # so they stay out: a run checkpointed on 2 processes resumes on 1 under the same fingerprint.
        actor=a.model_dump(exclude=EXECUTION_ONLY), runner=r.model_dump(exclude={"resume", "log_interval"}))
    evaluate = fingerprint("evaluate", code=code_version("evaluate"), prepare=prepare, eval=cfg.eval.model_dump(),
                           scorer=scorer_identity(cfg.eval.scorer), **_evaluated_model(cfg, train, model_fp))
    register = fingerprint("register", code=code_version("register"), evaluate=evaluate, train=train, prepare=prepare,
                           registry=cfg.registry.model_dump(exclude={"live_after_seconds"}),
                           tracking_uri=cfg.resolved_tracking_uri)
    return Plan(cfg, {"prepare": prepare, "train": train, "evaluate": evaluate, "register": register})


def _evaluated_model(cfg: SFTConfig, train: str, model_fp: str) -> dict:
    """What evaluate scores: the train stage's model, or `eval.model` (its content identity, plus the
    base model and the actor's model type/worker that load and score it); world size never matters."""
    identity = eval_model_identity(cfg)
    if identity is None:
        return {"train": train}
    return {"model": identity, "base": model_fp, "actor": cfg.actor.model_dump(include={"worker", "model"})}


def upstream(cfg: SFTConfig, stage: str) -> tuple[str, ...]:
    """Stages `stage` reads; evaluate with `eval.model` set needs only prepare."""
    if stage == "evaluate" and cfg.eval.model is not None:
        return ("prepare",)
    return UPSTREAM[stage]


class MissingUpstream(ConfigError):
    """A stage was asked for before the stages it reads from: a usage error (exit code 2)."""


def require_upstream(p: Plan, stage: str) -> dict[str, str]:
    if stage == "register" and p.cfg.eval.model is not None:
        raise ConfigError(f"register: eval.model={p.cfg.eval.model!r} scores another model than the trained one "
                          "register would log; unset eval.model (it is for `sftflow stage evaluate --model`)")
    dirs = {}
    for up in upstream(p.cfg, stage):
        if p.status(up) != "complete":
            raise MissingUpstream(f"{stage} needs the {up} stage ({p.fingerprints[up]}), which has not run for this "
                                  f"config; run `sftflow stage {up} -c <config>` or `sftflow run -c <config>` first")
        dirs[up] = str(p.folder(up))
    return dirs


def run_stage(p: Plan, stage: str, force: bool = False, on_line: Callable[[str], None] = print,
              extra_tags: dict[str, str] | None = None) -> StageResult:
    """Runs one stage unless its folder is complete (or `force`); upstream must be complete."""
    cfg, fp, root = p.cfg, p.fingerprints[stage], p.cfg.artifacts_path
    dirs = require_upstream(p, stage)
    t0 = time.time()
    with stage_lock(root, stage, fp):
        hit = cached_result(root, stage, fp)
        if hit is not None and not force:
            return hit
        if stage == "prepare":
            from .prepare import run_prepare
            metrics = run_prepare(cfg, fp, resolve_model(cfg))
        elif stage == "train":
            from .register.tracking import training_run
            from .train import run_train
            # the MLflow run exists before torchrun starts; rank 0 logs into it while training runs
            metrics_file = p.folder("train") / "metrics.jsonl"
            with training_run(cfg, p.fingerprints, dirs, extra_tags, on_line, metrics_file) as env:
                metrics = run_train(cfg, fp, resolve_model(cfg), dirs["prepare"], on_line=on_line, env=env)
        elif stage == "evaluate":
            from .evaluate import run_evaluate
            model_ref = cfg.eval.model if cfg.eval.model is not None else str(p.folder("train"))
            metrics = run_evaluate(cfg, fp, resolve_model(cfg), model_ref, dirs["prepare"], on_line=on_line)
        elif stage == "register":
            from .register import run_register
            metrics = run_register(cfg, fp, p.fingerprints, dirs, extra_tags)
        else:
            raise ValueError(f"unknown stage {stage!r}; stages: {', '.join(STAGES)}")
    return StageResult(stage, fp, str(p.folder(stage)), metrics, cached=False, seconds=round(time.time() - t0, 2))


KEY_METRIC = {"prepare": ("train_rows_kept", "rows"), "train": ("final_loss", "loss"),
              "evaluate": ("accuracy", "accuracy"), "register": ("version", "version")}
