"""Running a stage: `run_stage` runs the function the stage table's `run` names (stages/graph.py: the
stage's own, as `module:function`, imported only when that stage runs: each imports torch or MLflow)
with the arguments its `call` readies from the plan here, under the stage folder's lock; a complete
folder is the result. Its upstream must be complete and pass today's data gate (`require_upstream`)."""

from __future__ import annotations

import importlib
import time
from functools import partial
from pathlib import Path
from typing import Callable

from ..core.cache.artifacts import WAITED, StageResult, cached_result, damage, input_digest, read_manifest, stage_lock
from ..core.cache.bases import is_adapter
from ..core.cache.inputs import HUB_PREFIX
from ..core.errors import ConfigError, MissingUpstream, StageError
from ..core.quarantine import check_folder
from ..graph import BY_NAME, STAGES
from ..models.base import resolve_model
from ..models.start import KEY as KEY_INIT_FROM
from ..models.start import start_folder
from ..tracking.registry import REGISTRY_PREFIX, version_state
from .checks import check_launch
from .fingerprints import reference_set_keys, scoring_keys
from .plans import Plan, held_out_dir, upstream


# Stages whose folders the data gate (data.max_bad_fraction, in no fingerprint) holds: on a run
# (stages/prepare/stage.py) and on every reuse, its own or a downstream stage's (core/quarantine.py).
GATED = ("prepare", "prepare_eval")


def require_upstream(p: Plan, stage: str) -> dict[str, str]:
    if stage == "register" and p.cfg.eval.model is not None:
        raise ConfigError(f"register: eval.model={p.cfg.eval.model!r} scores another model than the trained one "
                          "register would log; unset eval.model (it is for `sftflow stage evaluate --model`)")
    dirs = {}
    needed = upstream(p, stage)
    for up in (s for s in STAGES if s in needed):  # the earliest missing one is the one to run first
        if p.status(up) == "missing":
            raise MissingUpstream(f"{stage} needs the {up} stage ({p.fingerprints[up]}), which has not run for this "
                                  f"config; run `sftflow stage {up} -c <config>` or `sftflow run -c <config>` first")
        problem = damage(p.folder(up))
        if problem is not None:
            raise MissingUpstream(f"{stage} needs the {up} stage folder {p.folder(up)}, which is damaged ({problem}); "
                                  f"`sftflow stage {up} -c <config>` or `sftflow run -c <config>` rebuilds it")
        if up in GATED:  # a stage reading a prepared folder reads it only if it passes today's gate
            check_folder(p.folder(up), up, p.cfg.data.max_bad_fraction)
        dirs[up] = str(p.folder(up))
    return dirs


def replay_file(p: Plan) -> str | None:
    """The replay stage's conversations (data.mix.replay) once it has run, else None."""
    if "replay" not in p.stages or p.status("replay") != "complete":
        return None
    from ..replay import conversations_file
    return conversations_file(p.folder("replay"))


def _check_inputs_unchanged(p: Plan) -> None:
    """Data edited between planning and reading would file new outputs under an old fingerprint."""
    root = p.cfg.artifacts_path
    for items in p.inputs.values():
        for ref, digest in items:
            if not ref.startswith(HUB_PREFIX) and input_digest(Path(ref), root) != digest:
                raise StageError(f"prepare: {ref} changed after the run was planned; run it again")


def _registry_now(p: Plan, hit: StageResult) -> StageResult | None:
    """A reused registration, reporting the registry as it is now (its aliases may have moved since) with
    the decision it made when it ran; None when the registry no longer holds that version of this
    training (a reset or deleted registry): then register runs again."""
    m = hit.metrics
    now = version_state(p.cfg.resolved_tracking_uri, p.cfg.registry.model_name, m["version"])
    if now is None:
        return hit
    if not now["exists"] or now["train_fingerprint"] != p.fingerprints["train"]:
        return None
    then = f"{', '.join(m.get('aliases') or []) or 'no alias'}: {m['alias_reason']}" if m.get("alias_reason") else ""
    m = {**m, "aliases": now["aliases"],
         "alias_reason": f"registered by an earlier run ({then})" if then else "registered by an earlier run"}
    return StageResult(hit.stage, hit.fingerprint, hit.path, m, cached=True, seconds=hit.seconds)


def stage_function(stage: str) -> Callable[..., dict]:
    """The stage's own function, as its row of the stage table names it (`run`: `module:function`),
    imported now: each stage imports torch or MLflow, so only the one that runs is loaded."""
    module, _, name = BY_NAME[stage].run.partition(":")
    return getattr(importlib.import_module(module), name)


# The stage table's `call` names one of these per stage (stages/graph.py): each turns the plan into the
# call of its stage's own function (the table's `run`, imported by `stage_function` only then: each
# imports torch or MLflow, so only the one that runs is loaded). Each returns the call rather than
# making it: `run_stage` calls the stage's function (`run_train`, ...) itself, so that no hop is added
# on the road from the CLI to the training loop (docs/architecture.md, at most 8 calls).
StageCall = Callable[[Plan, str, dict, Callable[[str], None], dict | None], Callable[[], dict]]
CALLS: dict[str, StageCall] = {}  # name -> function, for the table's `call`


def _readies(fn: StageCall) -> StageCall:
    CALLS[fn.__name__] = fn
    return fn


@_readies
def replay_call(p: Plan, stage: str, dirs: dict, on_line: Callable[[str], None], tags: dict | None):
    run_replay = stage_function(stage)
    return partial(run_replay, p.cfg, p.fingerprints[stage], resolve_model(p.cfg, p.fingerprints["models"], on_line),
                   on_line=on_line)


@_readies
def prepare_call(p: Plan, stage: str, dirs: dict, on_line: Callable[[str], None], tags: dict | None):
    from ..replay import conversations_file
    run_prepare = stage_function(stage)
    _check_inputs_unchanged(p)
    replay = conversations_file(dirs["replay"]) if "replay" in dirs else None
    return partial(run_prepare, p.cfg, p.fingerprints[stage], resolve_model(p.cfg, p.fingerprints["models"], on_line),
                   "train" if stage == "prepare" else "eval", replay, stage)


@_readies
def train_call(p: Plan, stage: str, dirs: dict, on_line: Callable[[str], None], tags: dict | None):
    run_train = stage_function(stage)
    cfg = p.cfg
    check_launch(p, warn=on_line)  # the model is built and the data prepared: the exact longest micro-batch
    weights = resolve_model(cfg, p.fingerprints["models"], on_line)  # the base model, built on first use
    if p.start is not None:
        on_line(f"train: {p.start['note']} ({KEY_INIT_FROM}={cfg.actor.init_from})")
        weights = start_folder(cfg, p.start, on_line)
        if is_adapter(weights):  # a LoRA version: merged once, as the copy registered before held it
            from ..inference.weights import merged_start
            trained_here = cfg.artifacts_path / "train" / p.start["identity"].get("train_fingerprint", "-") / "adapter"
            weights = merged_start(weights, cfg.artifacts_path, cfg.resolved_tracking_uri,
                                   cfg.actor.model.trust_remote_code, same_as=trained_here)
    return partial(run_train, cfg, p.fingerprints[stage], weights, dirs["prepare"], p.lineage(dirs, tags),
                   on_line=on_line)


@_readies
def reference_call(p: Plan, stage: str, dirs: dict, on_line: Callable[[str], None], tags: dict | None):
    run_reference = stage_function(stage)
    cfg = p.cfg
    ref, identity = ("base", None) if stage == "baseline" else (
        f"{REGISTRY_PREFIX}{p.champion['name']}/{p.champion['version']}", p.champion)
    return partial(run_reference, cfg, stage, p.fingerprints[stage],
                   resolve_model(cfg, p.fingerprints["models"], on_line), ref, identity, held_out_dir(dirs),
                   on_line=on_line, set_keys=reference_set_keys(p, stage) if cfg.eval.sets and p.facts else None,
                   scoring=scoring_keys(p) if stage == "champion" else None)


@_readies
def evaluate_call(p: Plan, stage: str, dirs: dict, on_line: Callable[[str], None], tags: dict | None):
    run_evaluate = stage_function(stage)
    cfg = p.cfg
    model_ref = cfg.eval.model if cfg.eval.model is not None else str(p.folder("train"))
    return partial(run_evaluate, cfg, p.fingerprints[stage], resolve_model(cfg, p.fingerprints["models"], on_line),
                   model_ref, held_out_dir(dirs), p.eval_model, dirs.get("baseline"), on_line=on_line,
                   train_fingerprint=p.fingerprints.get("train") if cfg.eval.model is None else None,
                   scoring=scoring_keys(p))


@_readies
def register_call(p: Plan, stage: str, dirs: dict, on_line: Callable[[str], None], tags: dict | None):
    run_register = stage_function(stage)
    return partial(run_register, p.cfg, p.fingerprints[stage], p.lineage(dirs, tags))


def run_stage(p: Plan, stage: str, force: bool = False, on_line: Callable[[str], None] = print,
              tags: dict[str, str] | None = None) -> StageResult:
    """Runs one stage unless its folder is complete (or `force`); upstream must be complete.
    `tags` (git commit, Prefect flow run id) go to the MLflow run that train opens and register finishes."""
    cfg, fp, root = p.cfg, p.fingerprints[stage], p.cfg.artifacts_path
    dirs = require_upstream(p, stage)
    t0 = time.time()
    with stage_lock(root, stage, fp, warn=on_line):
        hit = cached_result(root, stage, fp, warn=on_line)
        if hit is not None and stage == "register":
            hit = _registry_now(p, hit)
        if hit is not None and not force:
            if stage in GATED:  # the data gate holds on a reused folder as on a prepare that runs
                check_folder(hit.path, stage, cfg.data.max_bad_fraction)
            return hit
        call = CALLS[BY_NAME[stage].call](p, stage, dirs, on_line, tags)
        metrics = call()
    waited = read_manifest(p.folder(stage)).get(WAITED, 0.0)  # queued for the machine's cores (train): not work
    return StageResult(stage, fp, str(p.folder(stage)), metrics, cached=False,
                       seconds=round(time.time() - t0 - waited, 2), waited=waited)
