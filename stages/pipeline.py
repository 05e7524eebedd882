"""The stage graph: what each stage reads, its fingerprint, and how to run it.

Orchestrators (the Prefect flow, the CLI, tests) validate a config once (`load_config`),
plan once (`plan`), and hand the `Plan` to `run_stage` for each stage; a plan travels as
JSON (`Plan.to_dict`) to Prefect tasks and is never re-resolved there.

    models ─┐  ┌─► baseline ──────────┐       (the base model's scores: one folder across trials and retrains)
    prepare ─┼─► train ──────────────► evaluate ─► register
             └─► champion ─────────────────────────┘  (the registry's champion, scored on today's eval sets)

Evaluate compares the trained model with the base model; register compares it with the champion
(the champion is a fact about the registry when the run is planned, so when it moves only register
re-runs, never an evaluation).

`baseline` and `champion` are in a plan only when there is something to score: the base model
unless `eval.eval_base` is off or `eval.model` is the base model; the champion when `eval.model` is
unset, `registry.promote` is `if_better` and the registry has one that another training produced.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Iterator

from .core.cache.artifacts import (WAITED, StageResult, cached_result, damage, deferred_digest_memos, fingerprint,
                             input_digest, is_complete, read_manifest, stage_dir, stage_lock)
from .core.cache.codeversion import code_version
from .core.config import CORPUS, REHEARSE, REPLAY_PROMPTS, SCORER_NAMES, SFTConfig, eval_split, mix_split
from .core.errors import ConfigError, MissingUpstream, StageError
from .core.cache.imports import import_identity, import_object
from .core.cache.inputs import HUB_PREFIX
from .core.narrow import with_sets
from .core.quarantine import check_folder
from .graph import BY_NAME, KEY_METRIC, STAGES, UPSTREAM, Stage, config_slice, planning_order
from .models.base import model_config_json, model_fingerprint, resolve_model
from .models.refs import eval_model_identity
from .models.start import KEY as KEY_INIT_FROM
from .models.start import caught_up, rehearsal, resolve_start, start_folder, start_tag
from .planning import memory_plan
from .inference.harness import chosen, lm_eval_version, resolve_task
from .tracking.registry import REGISTRY_PREFIX, current_champion, version_state
from .tracking.run import Lineage

__all__ = ["STAGES", "REFERENCES", "UPSTREAM", "KEY_METRIC", "Plan", "plan", "run_stage", "upstream", "requires",
           "require_upstream",
           "ConfigError", "MissingUpstream", "StageError"]

REFERENCES = ("baseline", "champion")  # models the trained one is compared with, item by item


@dataclass
class Plan:
    """A validated config with everything resolved from it: the inputs its paths name (with content
    digests), what `eval.model` is, and every stage's fingerprint (`models` is the base model's)."""

    cfg: SFTConfig
    fingerprints: dict[str, str]
    inputs: dict[str, list[tuple[str, str]]]  # split -> [(input, content sha256)]
    eval_model: dict | None = None
    champion: dict | None = None  # the registry version `champion` named at planning (registry.current_champion)
    start: dict | None = None     # the weights training starts from (models/start.py); None: the base model
    start_note: str | None = None  # why `actor.init_from` resolved to the base model, when it did
    facts: dict | None = None      # the facts the fingerprints saw (stages/graph.py FACTS)
    rehearsal: list[dict] | None = None  # a warm start's rehearsed files (models/start.py `rehearsal`), else None

    @property
    def stages(self) -> tuple[str, ...]:
        """The stages this plan runs, in order (a reference stage only when it has a model to score)."""
        return tuple(s for s in STAGES if s in self.fingerprints)

    def folder(self, stage: str) -> Path:
        return stage_dir(self.cfg.artifacts_path, stage, self.fingerprints[stage])

    def status(self, stage: str) -> str:
        """complete | damaged (complete, but fails the check a reuse makes: the flow rebuilds it, so
        nothing before the flow reads it) | missing."""
        folder = self.folder(stage)
        if not is_complete(folder):
            return "missing"
        return "complete" if damage(folder) is None else "damaged"

    def lineage(self, dirs: dict[str, str], tags: dict[str, str] | None = None) -> Lineage:
        started = {"sftflow.start": self.start["ref"] if self.start else "base",
                   "sftflow.models_fingerprint": self.fingerprints["models"],
                   **({"sftflow.parent_version": self.start["parent_version"]}
                      if self.start and self.start.get("parent_version") else {})}
        return Lineage(fingerprints={s: self.fingerprints[s] for s in self.stages}, dirs=dirs, inputs=self.inputs,
                       tags={**started, **(tags or {})}, start=start_tag(self.start))

    def to_dict(self) -> dict:
        return {"config": self.cfg.model_dump(mode="json"), "fingerprints": self.fingerprints,
                "inputs": {s: [list(x) for x in v] for s, v in self.inputs.items()}, "eval_model": self.eval_model,
                "champion": self.champion, "start": self.start, "start_note": self.start_note, "facts": self.facts,
                "rehearsal": self.rehearsal}

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        """The plan `to_dict` wrote; nothing is globbed, hashed or looked up again."""
        cfg = SFTConfig.model_validate(d["config"])
        inputs = {s: [(ref, digest) for ref, digest in v] for s, v in d["inputs"].items()}
        cfg.pin_inputs({s: [ref if ref.startswith(HUB_PREFIX) else Path(ref) for ref, _ in v]
                        for s, v in inputs.items()})
        if d.get("rehearsal"):
            cfg.pin_rehearsal(d["rehearsal"], cfg.inputs()["train"])
        return cls(cfg, dict(d["fingerprints"]), inputs, d.get("eval_model"), d.get("champion"), d.get("start"),
                   d.get("start_note"), d.get("facts"), d.get("rehearsal"))


def _custom_scorers(cfg: SFTConfig) -> dict[str, str]:
    """config key -> 'pkg.module:fn' for every scorer that is not a builtin."""
    keys = {"eval.scorer": cfg.eval.scorer,
            **{f"eval.sets.{n}.scorer": s.scorer for n, s in cfg.eval.sets.items() if s.scorer}}
    return {k: v for k, v in keys.items() if v not in SCORER_NAMES}


def check_code(cfg: SFTConfig) -> None:
    """The code the config names imports, before anything runs: custom scorers, and the worker
    and model type (importing `actor.worker` registers its model types; it imports torch, so
    only when the config names one or a model type other than the builtin `causal_lm`)."""
    for key, path in _custom_scorers(cfg).items():
        if not callable(import_object(path, key)):
            raise ConfigError(f"{key}='{path}' is not callable")
    if cfg.actor.worker or cfg.actor.model.model_type != "causal_lm":
        from .runtime.worker import check_worker_config
        check_worker_config(cfg)
    # the attention kernel depends on the machine that trains, not the one that plans (a deployment is
    # planned anywhere): `check_launch` checks it where and when training starts


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


def _local_files(refs) -> list[Path]:
    return [Path(r) for r in refs if not str(r).startswith(HUB_PREFIX)]


def check_contamination(cfg: SFTConfig) -> None:
    """No training or replay prompt equals a named eval set's prompt (chatdata/overlap.py)."""
    if not cfg.eval.sets:
        return
    from .chatdata.overlap import first_collision
    d, inputs = cfg.data, cfg.inputs()
    trains = [(p, d.format, d.columns) for p in _local_files(inputs["train"])]
    for name, m in d.mix.items():
        if m.paths:
            trains += [(p, m.format or d.format, m.columns if m.columns is not None else d.columns)
                       for p in _local_files(inputs[mix_split(name)])]
    if cfg.replay is not None:
        trains += [(p, "prompt", d.columns) for p in _local_files(inputs[REPLAY_PROMPTS])]
    trains += [(Path(e["ref"]), e["format"], e.get("columns") or d.columns)  # a warm start's rehearsed files
               for e in cfg.rehearsal_files if not e["ref"].startswith(HUB_PREFIX)]
    evals = {name: [(p, "choice" if s.mode == "choice" else d.format, d.columns)
                    for p in _local_files(inputs[eval_split(name)])]
             for name, s in cfg.eval.sets.items() if not s.is_harness}  # a harness task's documents: lm-eval's
    problem = first_collision(trains, evals)
    if problem:
        raise ConfigError(problem)


def _check_sources_distinct(cfg: SFTConfig) -> None:
    """A file in two training sources would train twice under two weights."""
    owner: dict[str, str] = {}
    keys = ["train", *(mix_split(n) for n, m in cfg.data.mix.items() if m.paths)]
    for name, m in cfg.data.mix.items():
        files = _local_files(cfg.inputs()[mix_split(name)]) if m.paths else []
        if files and all(f.is_file() and f.stat().st_size == 0 for f in files):
            raise ConfigError(f"data.mix.{name}: its files are empty ({', '.join(map(str, files))}); "
                              "a source needs rows, or leave it out of the mixture")
    for key in keys:
        for ref in cfg.inputs()[key]:
            where = "data.train_data_paths" if key == "train" else f"data.mix.{key.split('/', 1)[1]}.paths"
            if str(ref) in owner:
                raise ConfigError(f"{ref} is in both {owner[str(ref)]} and {where}; a file belongs to one source")
            owner[str(ref)] = where


def plan(cfg: SFTConfig) -> Plan:
    """Fingerprints of every stage from the config and input *contents*; runs nothing. The code
    the config names is imported first (`check_code`), so its errors come before any work, and
    nothing is written (not even a digest memo) unless the whole plan is valid."""
    with deferred_digest_memos():
        return _build_plan(cfg)


def check_checkpoints(cfg: SFTConfig) -> None:
    """A checkpoint folder the config names (`eval.model`, `runner.resume`) is read safely before
    anything runs: its DCP `.metadata` is a pickle, and a crafted one would run code when DCP loads it
    (`runtime/checkpoint.py` reads it with an allow-listed unpickler)."""
    named = {"eval.model": cfg.eval.model, "runner.resume": cfg.runner.resume}
    for key, ref in named.items():
        folder = Path(ref).expanduser() if ref and ref not in ("auto", "never", "base") else None
        if folder is None or not (folder / ".metadata").is_file():
            continue
        from .runtime.checkpoint import CheckpointError, read_metadata  # torch: only for a named checkpoint
        try:
            read_metadata(folder)
        except CheckpointError as e:
            raise ConfigError(f"{key}: {e}") from None


def _memory_inputs(p: Plan) -> tuple[dict, str, list[int] | None] | None:
    """(the base model's config.json, where it was read, the prepared samples' lengths once prepare
    has run and its folder is sound: a damaged one is rebuilt by the flow, so its lengths are
    unknown until then); None when the config can't be read without building or converting the model."""
    found = model_config_json(p.cfg, p.fingerprints["models"])
    if found is None:
        return None
    done = p.status("prepare") == "complete"
    return *found, memory_plan.prepared_lengths(p.folder("prepare") / "train") if done else None


def train_memory(p: Plan, device: memory_plan.Device | None = None) -> tuple[memory_plan.MemoryPlan | None, str]:
    """(the train stage's memory plan per rank, where the model's dimensions came from): the
    longest micro-batch from the prepared shards once prepare has run, else the config's bound;
    (None, why) when the dimensions can't be read without building the model."""
    found = _memory_inputs(p)
    if found is None:
        return None, "the model's config.json is not available before the model is built or converted"
    hf_config, source, lengths = found
    try:
        device = device or planned_device(p.cfg, p.fingerprints["models"])
        return memory_plan.for_config(p.cfg, hf_config, device, lengths), source
    except KeyError as e:
        return None, f"{source} has no {e.args[0]}"
    except memory_plan.UnknownArchitecture as e:
        return None, f"{e} in {source}: only dense {', '.join(memory_plan.DENSE_MODEL_TYPES)} layouts are estimated"
    except ConfigError as e:  # an attention kernel this machine lacks
        return None, str(e)


def check_memory(p: Plan, device: memory_plan.Device | None = None, warn: Callable[[str], None] = print) -> None:
    """A training that clearly can't fit its device (over budget x MARGIN) is a ConfigError before
    torchrun starts (from the CLI, before a Prefect server starts too), naming the settings that would
    fit; one within the margin is a `warn` line; docs/operations.md, "Memory plan"."""
    found = _memory_inputs(p) if p.cfg.actor.memory_budget_gb != 0 else None
    if found is None:
        return
    try:
        device = device or planned_device(p.cfg, p.fingerprints["models"])
        verdict = memory_plan.check_fits(p.cfg, found[0], device, found[2])
    except (KeyError, memory_plan.UnknownArchitecture):  # a layout the plan doesn't know: nothing to estimate
        return
    if verdict and verdict.refuse:
        raise ConfigError(verdict.line)
    if verdict:
        warn(verdict.line)


def check_attention(cfg: SFTConfig, device: memory_plan.Device | None = None) -> None:
    """An explicit `actor.attn_implementation` that can't run on the machine that trains (package
    missing, no CUDA, fp32, an older GPU) is a ConfigError there, before torchrun; torch-free, as
    the worker's own rule (planning/attention.py) on the packages installed here."""
    if cfg.actor.attn_implementation == "auto":
        return  # auto always resolves to something that runs
    device = device or memory_plan.visible_device()
    memory_plan.attention_kernel(cfg.actor.attn_implementation, device, cfg.actor.packing,
                                 device.precision(cfg.actor.precision))


def check_processes(cfg: SFTConfig, device: memory_plan.Device | None = None) -> None:
    """Training on GPUs runs one process per GPU (FSDP2 over NCCL shards over distinct devices; NCCL
    refuses two ranks on one GPU): a count above the GPUs this machine shows is a ConfigError naming
    `actor.nproc_per_node`. On CPU any count runs (gloo processes share the cores); evaluation and
    replay ranks hold whole models and talk over gloo, so they may share a GPU."""
    device = device or memory_plan.visible_device()
    n = cfg.actor.nproc_per_node
    if device.kind == "cuda" and n > device.count:
        gpus = f"{device.count} visible GPU{'s' if device.count > 1 else ''} ({device.name})"
        raise ConfigError(f"actor.nproc_per_node={n} but this machine has {gpus}: training runs one process per "
                          f"GPU; set actor.nproc_per_node=auto (uses what the machine has) or at most "
                          f"{device.count}")


def check_launch(p: Plan, device: memory_plan.Device | None = None, warn: Callable[[str], None] = print) -> None:
    """What only the machine that trains can tell, checked on it right before training launches
    (the CLI's run/stage train, and the train stage itself on a worker): the process count against
    the GPUs, the attention kernel, then the memory plan. Planning alone (`sftflow show`, a
    deployment) checks none of them."""
    device = device or planned_device(p.cfg, p.fingerprints["models"])
    check_processes(p.cfg, device)
    check_attention(p.cfg, device)
    check_memory(p, device, warn)


def launch_report(p: Plan, device: memory_plan.Device | None = None, memory: bool = True) -> dict:
    """Every decision the machine makes for training, as `sftflow show --json` reports it: the device
    inventory, processes per node and why, the backend, the precision, the attention kernel, each
    rank's device, the memory plan against the budget, and what `check_launch` would refuse (the
    first check that does, in its order) or warn of (torch-free: the worker's rules, on what
    planning sees). `memory=False` leaves the memory plan out (`sftflow show` prints its own table)."""
    from .core.machine.topology import backend, inventory, rank_gpu
    from .evaluate.placement import describe as describe_eval_launch
    from .evaluate.placement import settled as settled_eval_launch
    device = device or planned_device(p.cfg, p.fingerprints["models"])
    a, inv = p.cfg.actor, inventory()
    # scoring in the stage's process uses one device; where the work's size decides, list the ranks' devices
    eval_rule = settled_eval_launch(p.cfg, device.kind == "cuda")
    eval_ranks = 1 if eval_rule is not None and eval_rule[0] else a.nproc_per_node
    precision = device.precision(a.precision)
    report: dict = {
        "device": {"kind": device.kind, "name": device.name, "count": device.count,
                   "memory_gib": round(device.bytes / memory_plan.GIB, 1),
                   "capability": ".".join(map(str, device.capability)) if device.capability else None,
                   "source": inv.source, "note": inv.note,
                   **({"bf16": _cpu_bf16(p.cfg, device)} if device.kind == "cpu" else {})},
        "nproc_per_node": a.nproc_per_node, "topology": a.topology, "backend": backend(device.kind),
        "precision": precision, "precision_why": device.precision_why(a.precision),
        "eval_precision": device.precision(p.cfg.eval.precision, "eval.precision"),
        "eval_precision_why": device.precision_why(p.cfg.eval.precision, "eval.precision"), "attn_implementation": None,
        "train_devices": [f"cuda:{rank_gpu(r, device.count)}" if device.kind == "cuda" else "cpu"
                          for r in range(a.nproc_per_node)],
        "eval_devices": [f"cuda:{rank_gpu(r, device.count, shared=True)}" if device.kind == "cuda" else "cpu"
                         for r in range(eval_ranks)],
        "eval_launch": describe_eval_launch(p.cfg, device.kind == "cuda"),
        "memory": None, "warnings": [], "refused": None, "refused_by": None,
    }
    try:
        report["attn_implementation"] = memory_plan.attention_kernel(a.attn_implementation, device, a.packing,
                                                                     precision)
    except ConfigError:
        pass  # check_attention below names it
    mp, source = train_memory(p, device) if memory else (None, "left out")
    budget = memory_plan.budget_for(p.cfg, device)
    if mp is not None:
        report["memory"] = {"per_rank_bytes": mp.total, "ranks_sharing_budget": budget.ranks if budget else None,
                            "budget_bytes": budget.bytes if budget else None,
                            "budget": budget.what if budget else None, "dims": source}
    else:
        report["memory"] = {"unknown": source}
    for check, name in ((check_processes, "processes"), (check_attention, "attention")):
        try:
            check(p.cfg, device)
        except ConfigError as e:
            report["refused"], report["refused_by"] = str(e), name
            return report
    try:
        if memory:
            check_memory(p, device, warn=report["warnings"].append)
    except ConfigError as e:
        report["refused"], report["refused_by"] = str(e), "memory"
    return report


def _worker_identity(cfg: SFTConfig):
    """The code that builds and trains the model: `actor.worker`'s source, and an import-path
    `actor.model.model_type`'s builder's (editing either re-runs the stages that use the worker)."""
    worker = import_identity(cfg.actor.worker)
    model_type = cfg.actor.model.model_type
    return {"worker": worker, "model_type": import_identity(model_type)} if ":" in model_type else worker


def _custom_scorer_identity(cfg: SFTConfig):
    custom = _custom_scorers(cfg)
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


def planned_device(cfg: SFTConfig, model_fp: str) -> memory_plan.Device:
    """The device training will run on as planning sees it, with what a CPU's bf16 is measured at: the
    base model's shapes (its config.json; a default class where it can't be read before the model is
    built)."""
    from .core.machine.bf16_speed import Dims
    found = model_config_json(cfg, model_fp)
    try:
        dims = Dims.from_hf_config(found[0]) if found is not None else None
    except (KeyError, TypeError, ValueError):
        dims = None
    return memory_plan.visible_device(dims)


def _cpu_bf16(cfg: SFTConfig, device: memory_plan.Device) -> dict | None:
    """`show --json`'s account of a CPU's bf16: what was measured, where, and whether `auto` takes it."""
    if "auto" not in (cfg.actor.precision, cfg.eval.precision):
        return None  # nothing asks: nothing measured
    speed = device.cpu_bf16
    if speed is None:
        return {"native": False, "measured": None}
    from .core.machine.bf16_speed import MARGIN
    return {"native": True, "measured": {"train": speed.train, "generate": speed.generate}, "margin": MARGIN,
            "cpu": speed.cpu, "threads": speed.threads, "torch": speed.torch, "shape_class": speed.shape_class,
            "seconds": speed.seconds}


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
    _check_sources_distinct(cfg)
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
    cfg = p.cfg
    if not cfg.eval.sets:
        return {"val": p.fingerprints[stage]}
    digests = {split: [d for _, d in items] for split, items in p.inputs.items()}
    keys = {}
    for name in cfg.eval.set_names:
        scorer = p.facts.get("scorer")
        facts = {**p.facts, "harness": {name: p.facts["harness"][name]} if name in (p.facts.get("harness") or {})
                 else None,
                 "scorer": {k: v for k, v in scorer.items() if k in ("eval.scorer", f"eval.sets.{name}.scorer")}
                 or None if scorer else None}
        keys[name] = _stage_fingerprint(BY_NAME[stage], with_sets(cfg, [name]), digests, {}, facts)
    return keys


def replay_file(p: Plan) -> str | None:
    """The replay stage's conversations (data.mix.replay) once it has run, else None."""
    if "replay" not in p.stages or p.status("replay") != "complete":
        return None
    from .replay import conversations_file
    return conversations_file(p.folder("replay"))


def held_out_dir(dirs: dict[str, str]) -> str:
    """Where the scoring stages find their sets: prepare_eval's folder (named eval sets), else prepare's
    (the val split)."""
    return dirs.get("prepare_eval") or dirs.get("prepare") or ""  # "": harness sets only, nothing prepared


def upstream(p: Plan, stage: str) -> tuple[str, ...]:
    """Stages `stage` reads in this plan (the stage table's `upstream` without its `skips`)."""
    row = BY_NAME[stage]
    skip = row.skips(p.cfg)
    return tuple(u for u in row.upstream if u in p.fingerprints and u not in skip)


def requires(p: Plan, stage: str) -> set[str]:
    """Every stage `stage` needs in this plan, directly or through another."""
    found: set[str] = set()
    todo = list(upstream(p, stage))
    while todo:
        s = todo.pop()
        if s not in found:
            found.add(s)
            todo += upstream(p, s)
    return found


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


# The stage table's `run` names one of these per stage (stages/graph.py): each turns the plan into its
# stage's call, importing the stage package only then (each imports torch or MLflow: only the one
# that runs is loaded). Each returns the call rather than making it: `run_stage` calls the stage's
# own function (`run_train`, ...) itself, so that no hop is added on the road from the CLI to the
# training loop (docs/architecture.md, at most 8 calls).
StageCall = Callable[[Plan, str, dict, Callable[[str], None], dict | None], Callable[[], dict]]
CALLS: dict[str, StageCall] = {}  # name -> function, for the table's `run`


def _readies(fn: StageCall) -> StageCall:
    CALLS[fn.__name__] = fn
    return fn


@_readies
def replay_call(p: Plan, stage: str, dirs: dict, on_line: Callable[[str], None], tags: dict | None):
    from .replay import run_replay
    return partial(run_replay, p.cfg, p.fingerprints[stage], resolve_model(p.cfg, p.fingerprints["models"], on_line),
                   on_line=on_line)


@_readies
def prepare_call(p: Plan, stage: str, dirs: dict, on_line: Callable[[str], None], tags: dict | None):
    from .prepare.stage import run_prepare
    from .replay import conversations_file
    _check_inputs_unchanged(p)
    replay = conversations_file(dirs["replay"]) if "replay" in dirs else None
    return partial(run_prepare, p.cfg, p.fingerprints[stage], resolve_model(p.cfg, p.fingerprints["models"], on_line),
                   "train" if stage == "prepare" else "eval", replay, stage)


@_readies
def train_call(p: Plan, stage: str, dirs: dict, on_line: Callable[[str], None], tags: dict | None):
    from .train import run_train
    cfg = p.cfg
    check_launch(p, warn=on_line)  # the model is built and the data prepared: the exact longest micro-batch
    weights = resolve_model(cfg, p.fingerprints["models"], on_line)  # the base model, built on first use
    if p.start is not None:
        on_line(f"train: {p.start['note']} ({KEY_INIT_FROM}={cfg.actor.init_from})")
        weights = start_folder(cfg, p.start, on_line)
    return partial(run_train, cfg, p.fingerprints[stage], weights, dirs["prepare"], p.lineage(dirs, tags),
                   on_line=on_line)


@_readies
def reference_call(p: Plan, stage: str, dirs: dict, on_line: Callable[[str], None], tags: dict | None):
    from .evaluate import run_reference
    cfg = p.cfg
    ref, identity = ("base", None) if stage == "baseline" else (
        f"{REGISTRY_PREFIX}{p.champion['name']}/{p.champion['version']}", p.champion)
    return partial(run_reference, cfg, stage, p.fingerprints[stage],
                   resolve_model(cfg, p.fingerprints["models"], on_line), ref, identity, held_out_dir(dirs),
                   on_line=on_line, set_keys=reference_set_keys(p, stage) if cfg.eval.sets and p.facts else None)


@_readies
def evaluate_call(p: Plan, stage: str, dirs: dict, on_line: Callable[[str], None], tags: dict | None):
    from .evaluate import run_evaluate
    cfg = p.cfg
    model_ref = cfg.eval.model if cfg.eval.model is not None else str(p.folder("train"))
    return partial(run_evaluate, cfg, p.fingerprints[stage], resolve_model(cfg, p.fingerprints["models"], on_line),
                   model_ref, held_out_dir(dirs), p.eval_model, dirs.get("baseline"), on_line=on_line)


@_readies
def register_call(p: Plan, stage: str, dirs: dict, on_line: Callable[[str], None], tags: dict | None):
    from .register import run_register
    return partial(run_register, p.cfg, p.fingerprints[stage], p.lineage(dirs, tags))


def _trains_here(p: Plan, runs: set[str] | None = None, forced: set[str] | frozenset[str] = frozenset()) -> bool:
    """Whether the stages `runs` (default all) of this plan train, and with sftflow's own worker (a custom
    worker's imports are its own)."""
    trains = "train" in p.stages and "train" in (p.stages if runs is None else runs) and not p.cfg.actor.worker
    return trains and (p.status("train") != "complete" or bool(forced & ({"train"} | requires(p, "train"))))


def warm_imports(p: Plan, runs: set[str] | None = None, forced: set[str] | frozenset[str] = frozenset()) -> None:
    """Imports now the libraries the stages this plan computes import first in this process (torch,
    transformers and the model's modeling code to build a builtin model and tokenize; MLflow's SQL store):
    seconds on a cold interpreter, which a caller with time to spare (the CLI while a Prefect server
    starts) spends here instead of on the run's path. A fully cached plan imports nothing. `runs` and
    `forced` as for `launch_ahead`."""
    import importlib
    if all(p.status(s) == "complete" for s in p.stages):
        return
    from .train import start_rank_ahead, warm_modules
    model_type = _model_type(p)
    if _trains_here(p, runs, forced):  # its rank imports alongside: the flow's `launch_ahead` then finds it waiting
        start_rank_ahead(p.cfg, p.fingerprints["train"], model_type)
    # what this process builds and tokenizes with (the model's own modeling code included), and MLflow's store
    for name in ["torch", *[m for m in warm_modules(model_type) if m.startswith("transformers.")],
                 "mlflow.store.tracking.sqlalchemy_store"]:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the stage that needs it imports it again and says why
            pass


def _model_type(p: Plan) -> str | None:
    """The Hugging Face `model_type` of the plan's base model, when its config can be read without loading it."""
    found = model_config_json(p.cfg, p.fingerprints["models"])
    return found[0].get("model_type") if found else None


@contextmanager
def launch_ahead(p: Plan, runs: set[str] | None = None,
                 forced: set[str] | frozenset[str] = frozenset()) -> Iterator[None]:
    """Around a flow's stages (`runs`: those it may run, default all): when they will train on one process
    of this machine (train not complete, or forced, or downstream of a forced stage), its rank starts now
    and imports while the stages before train run (launch/ahead.py); stopped at the end if no launch took it."""
    handle = None
    if _trains_here(p, runs, forced):
        from .train import start_rank_ahead
        handle = start_rank_ahead(p.cfg, p.fingerprints["train"], _model_type(p))
    try:
        yield
    finally:
        if handle is not None:
            handle.close()


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
        call = CALLS[BY_NAME[stage].run](p, stage, dirs, on_line, tags)
        metrics = call()
    waited = read_manifest(p.folder(stage)).get(WAITED, 0.0)  # queued for the machine's cores (train): not work
    return StageResult(stage, fp, str(p.folder(stage)), metrics, cached=False,
                       seconds=round(time.time() - t0 - waited, 2), waited=waited)
