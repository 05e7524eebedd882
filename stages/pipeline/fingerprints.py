"""Planning: a config -> a `Plan` (`plan`), running nothing. The inputs and their content digests, the
facts (the base model, the worker's and scorers' source, harness tasks, the resolved precisions, the
champion, the start) and every stage's fingerprint as the stage table declares it (stages/graph.py)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ..core.cache.artifacts import deferred_digest_memos, fingerprint, input_digest
from ..core.cache.codeversion import code_version
from ..core.cache.imports import import_identity
from ..core.cache.inputs import HUB_PREFIX
from ..core.config import CORPUS, REHEARSE, SFTConfig, eval_split, mix_split
from ..core.errors import ConfigError
from ..core.narrow import with_sets
from ..graph import BY_NAME, Stage, config_slice, planning_order
from ..inference.harness import chosen, lm_eval_version, resolve_task
from ..models.base import model_fingerprint
from ..models.refs import eval_model_identity
from ..models.start import caught_up, rehearsal, resolve_start
from ..planning import memory_plan
from ..tracking.registry import current_champion
from .checks import check_sources_distinct, custom_scorers, check_checkpoints, check_code, check_contamination
from .plans import Plan, planned_device


def plan(cfg: SFTConfig) -> Plan:
    """Fingerprints of every stage from the config and input *contents*; runs nothing. The code
    the config names is imported first (`check_code`), so its errors come before any work, and
    nothing is written (not even a digest memo) unless the whole plan is valid."""
    with deferred_digest_memos():
        return _build_plan(cfg)


def harness_tasks(cfg: SFTConfig) -> dict[str, dict]:
    """set -> what its lm-eval task is (`mode: harness`): the task's name, the metric and filter that
    score an item, lm-eval's version, and the local files that define the task (its YAML, includes,
    `!function` modules, data). lm-eval missing, a task file missing or an unknown task is a
    ConfigError naming the set's key."""
    out = {}
    for name, s in cfg.eval.sets.items():
        if s.is_harness:
            version = lm_eval_version(f"eval.sets.{name}")
            resolved = resolve_task(s.task, f"eval.sets.{name}.task")
            metric, filt = chosen(s, resolved, f"eval.sets.{name}")
            out[name] = {"task": resolved["name"], "metric": metric, "filter": filt, "lm_eval": version,
                         "files": resolved["files"]}
    return out


def _worker_identity(cfg: SFTConfig):
    """The code that builds and trains the model: `actor.worker`'s source, and an import-path
    `actor.model.model_type`'s builder's (editing either re-runs the stages that use the worker)."""
    worker = import_identity(cfg.actor.worker)
    model_type = cfg.actor.model.model_type
    return {"worker": worker, "model_type": import_identity(model_type)} if ":" in model_type else worker


def _custom_scorer_identity(cfg: SFTConfig):
    custom = custom_scorers(cfg)
    return ({k: import_identity(v) for k, v in custom.items()} if cfg.eval.sets else
            import_identity(custom["eval.scorer"]) if custom else None)


def _stage_fingerprint(stage: Stage, cfg: SFTConfig, digests: dict, fps: dict, facts: dict) -> str:
    """The fingerprint the stage table declares (stages/graph.py): code version, config slice, input
    contents, the folded upstream fingerprints in this plan, facts."""
    skip = stage.skips(cfg)
    return fingerprint(stage.name, code=code_version(stage.code, neutral=stage.neutral_code),
                       config=config_slice(cfg, stage),
                       inputs={name: [d for split in splits for d in digests.get(split, [])]
                               for name, splits in stage.inputs(cfg).items()},
                       upstream={u: fps[u] for u in stage.folds if u in fps and u not in skip},
                       facts={f: facts.get(f) for f in stage.facts})


def _precisions(cfg: SFTConfig, model_fp: str) -> dict[str, str]:
    """What `actor.precision` and `eval.precision` resolve to on the machine that plans (the one rule,
    core/machine/precision.py): facts of the stages that generate or score, so that a folder scored in fp32 is
    never reused as a bf16 one (artifacts shared between a machine where bf16 is faster and another, an
    Ampere GPU and a CPU). The device is looked at (and a CPU's bf16 measured) only for `auto`."""
    device: list[memory_plan.Device] = []

    def resolved(requested: str, key: str) -> str:
        if requested != "auto":
            return requested
        device[:] = device or [planned_device(cfg, model_fp)]
        return device[0].precision(requested, key)
    return {"actor_precision": resolved(cfg.actor.precision, "actor.precision"),
            "eval_precision": resolved(cfg.eval.precision, "eval.precision")}


def _build_plan(cfg: SFTConfig) -> Plan:
    check_code(cfg)
    check_checkpoints(cfg)
    check_sources_distinct(cfg)
    check_contamination(cfg)
    root = cfg.artifacts_path
    inputs = {split: [(str(ref), input_digest(ref, root)) for ref in refs] for split, refs in cfg.inputs().items()}
    harness = harness_tasks(cfg)
    for name, h in harness.items():  # a harness task's files are its set's inputs (contents hashed, lineage)
        inputs[eval_split(name)] = [(f, input_digest(Path(f), root)) for f in h["files"]]
    model_fp = model_fingerprint(cfg, [d for _, d in inputs.get(CORPUS) or inputs["train"]])
    facts = {"model": model_fp, "prepare_code": code_version("prepare"), "worker": _worker_identity(cfg),
             "scorer": _custom_scorer_identity(cfg), "tracking_uri": cfg.resolved_tracking_uri,
             "harness": {name: {k: v for k, v in h.items() if k != "files"} for name, h in harness.items()} or None,
             "eval_model": eval_model_identity(cfg, model_fp), **_precisions(cfg, model_fp)}
    order = planning_order()
    upto_train = order[:order.index("train") + 1]
    pinned = {split: list(refs) for split, refs in cfg.inputs().items()}
    kl = cfg.actor.kl_to_base  # as configured; a rehearsal may train with data.rehearsal.kl_to_base instead
    others = {d for split, items in inputs.items() if split.startswith(mix_split("")) for _, d in items}

    def through_train(start: dict | None) -> tuple[dict, dict, list[dict] | None, dict | None]:
        """(fingerprints through train, inputs, the rehearsal, the `start` fact) when training starts from
        `start`: a version's rehearsal changes what prepare reads (models/start.py `rehearsal`)."""
        cfg.pin_inputs(pinned)
        cfg._rehearsal = None
        cfg.actor.kl_to_base = kl  # the configured weight again (a start planned before may have pinned another)
        here = dict(inputs)
        found = rehearsal(cfg, start, inputs["train"], others)
        if found is not None:
            if cfg.data.rehearsal.kl_to_base and cfg.actor.lora.r == 0:
                raise ConfigError("data.rehearsal.kl_to_base needs LoRA (actor.lora.r > 0): the starting version it "
                                  "compares with is the LoRA model with its adapters off")
            entries, new = found
            cfg.pin_rehearsal(entries, [Path(r) if not r.startswith(HUB_PREFIX) else r for r, _ in new])
            here.update({"train": new, mix_split(REHEARSE): [(e["ref"], e["digest"]) for e in entries]})
            here.setdefault(CORPUS, inputs["train"])
        digests = {split: [d for _, d in items] for split, items in here.items()}
        ident = start and start["identity"]
        if found is not None:
            r = cfg.data.rehearsal
            ident = {"version": ident, "rehearsal": r.model_dump()}
        fps = {"models": model_fp}
        for name in upto_train:
            stage = BY_NAME[name]
            if stage.when(cfg, {**facts, "start": ident}):
                fps[name] = _stage_fingerprint(stage, cfg, digests, fps, {**facts, "start": ident})
        return fps, here, (found[0] if found is not None else None), ident

    start, start_note = resolve_start(cfg, model_fp)
    if start is not None:
        start = caught_up(start, lambda s: through_train(s)[0]["train"])
    fps, inputs, rehearsed, facts["start"] = through_train(start)
    if rehearsed:
        check_contamination(cfg)  # what the version trained on against today's eval sets
        r = cfg.data.rehearsal
        kl_note = "" if r.kl_to_base is None else f", KL to it x{r.kl_to_base:g} (data.rehearsal.kl_to_base)"
        start = {**start, "note": f"{start['note']}, rehearsing the {len(rehearsed)} training file(s) it was trained "
                                  f"on (data.rehearsal.weight={r.weight:g}){kl_note}"}
    digests = {split: [d for _, d in items] for split, items in inputs.items()}
    champion = None
    for name in order[len(upto_train):]:
        stage = BY_NAME[name]
        if name == "champion":
            champion, facts["champion"], facts["compared_with"] = _champion(cfg, fps["train"])
        elif name == "register" and "champion" in fps:
            facts["compared_with"] = fps["champion"]
        if stage.when(cfg, facts):
            fps[name] = _stage_fingerprint(stage, cfg, digests, fps, facts)
    return Plan(cfg, fps, inputs, facts["eval_model"], champion, start, start_note, facts, rehearsed)


def _champion(cfg: SFTConfig, train_fp: str) -> tuple[dict | None, dict | None, str | None]:
    """(the champion the plan compares with, its identity for the champion stage, the champion stage
    register's decision depends on when the champion is this very training: the one its registration
    compared with, so that the register folder of that decision is the cache hit). Only `if_better`
    compares; a version number alone may name another model after the registry was reset, so the
    identity includes the training the version holds."""
    wanted = cfg.eval.model is None and cfg.registry.promote == "if_better"
    champion = current_champion(cfg.resolved_tracking_uri, cfg.registry.model_name) if wanted else None
    if champion is None:
        return None, None, None
    if champion["train_fingerprint"] == train_fp:  # nothing to compare with
        return None, None, champion["champion_fingerprint"] or None
    return champion, {k: champion[k] for k in ("registry", "name", "version", "train_fingerprint")}, None


def reference_set_keys(p: Plan, stage: str) -> dict[str, str]:
    """set -> what that set's score by a reference stage depends on: the stage's fingerprint as if the
    config had that set alone, so adding a set re-scores only the new one (evaluate/pieces.py)."""
    if not p.cfg.eval.sets:
        return {"val": p.fingerprints[stage]}
    return _set_keys(p, BY_NAME[stage])


# What one model's score on one set depends on besides the model: the champion stage's row without the
# champion fact (the same reads, ignores, inputs and the other facts: the set's files and how they are
# prepared, the scoring keys of eval and eval.sets.<set>, the scorer's source, the resolved precision).
_SCORING = replace(BY_NAME["champion"], name="scoring", facts=tuple(f for f in BY_NAME["champion"].facts
                                                                     if f != "champion"))


def scoring_keys(p: Plan) -> dict[str, str] | None:
    """set -> what any model's score on that set depends on besides the model (`_SCORING`), or None for a
    plan without facts. evaluate records it per set; the champion stage copies the champion's own
    evaluation of a set whose key is today's instead of scoring it again (evaluate/reuse.py)."""
    if not p.facts:
        return None
    return _set_keys(p, _SCORING)


def _set_keys(p: Plan, stage: Stage) -> dict[str, str]:
    cfg = p.cfg
    digests = {split: [d for _, d in items] for split, items in p.inputs.items()}
    if not cfg.eval.sets:
        return {"val": _stage_fingerprint(stage, cfg, digests, {}, p.facts)}
    keys = {}
    for name in cfg.eval.set_names:
        scorer = p.facts.get("scorer")
        facts = {**p.facts, "harness": {name: p.facts["harness"][name]} if name in (p.facts.get("harness") or {})
                 else None,
                 "scorer": {k: v for k, v in scorer.items() if k in ("eval.scorer", f"eval.sets.{name}.scorer")}
                 or None if scorer else None}
        keys[name] = _stage_fingerprint(stage, with_sets(cfg, [name]), digests, {}, facts)
    return keys
