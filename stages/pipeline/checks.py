"""The pre-flight checks: what is refused before anything runs. At planning (`fingerprints.plan`): the
code the config names imports (`check_code`), a named checkpoint reads safely (`check_checkpoints`),
no file is in two training sources, no training prompt is an eval prompt (`check_contamination`). On
the machine that trains, right before torchrun (`check_launch`): the process count against the GPUs,
the attention kernel, the memory plan."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from ..core.cache.imports import import_object
from ..core.cache.inputs import HUB_PREFIX
from ..core.config import REPLAY_PROMPTS, SCORER_NAMES, SFTConfig, eval_split, mix_split
from ..core.errors import ConfigError
from ..models.base import model_config_json
from ..planning import memory_plan
from .plans import Plan, planned_device


def custom_scorers(cfg: SFTConfig) -> dict[str, str]:
    """config key -> 'pkg.module:fn' for every scorer that is not a builtin."""
    keys = {"eval.scorer": cfg.eval.scorer,
            **{f"eval.sets.{n}.scorer": s.scorer for n, s in cfg.eval.sets.items() if s.scorer}}
    return {k: v for k, v in keys.items() if v not in SCORER_NAMES}


def check_code(cfg: SFTConfig) -> None:
    """The code the config names imports, before anything runs: custom scorers, and the worker
    and model type (importing `actor.worker` registers its model types; it imports torch, so
    only when the config names one or a model type other than the builtin `causal_lm`)."""
    for key, path in custom_scorers(cfg).items():
        if not callable(import_object(path, key)):
            raise ConfigError(f"{key}='{path}' is not callable")
    if cfg.actor.worker or cfg.actor.model.model_type != "causal_lm":
        from ..runtime.worker import check_worker_config
        check_worker_config(cfg)


def _local_files(refs) -> list[Path]:
    return [Path(r) for r in refs if not str(r).startswith(HUB_PREFIX)]


def check_contamination(cfg: SFTConfig) -> None:
    """No training or replay prompt equals a named eval set's prompt (chatdata/overlap.py)."""
    if not cfg.eval.sets:
        return
    from ..chatdata.overlap import first_collision
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


def check_sources_distinct(cfg: SFTConfig) -> None:
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


def check_checkpoints(cfg: SFTConfig) -> None:
    """A checkpoint folder the config names (`eval.model`, `runner.resume`) is read safely before
    anything runs: its DCP `.metadata` is a pickle, and a crafted one would run code when DCP loads it
    (`runtime/saving/checkpoint.py` reads it with an allow-listed unpickler)."""
    named = {"eval.model": cfg.eval.model, "runner.resume": cfg.runner.resume}
    for key, ref in named.items():
        folder = Path(ref).expanduser() if ref and ref not in ("auto", "never", "base") else None
        if folder is None or not (folder / ".metadata").is_file():
            continue
        from ..runtime.saving.checkpoint import CheckpointError, read_metadata  # torch: only for a named checkpoint
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
