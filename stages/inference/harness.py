"""lm-evaluation-harness tasks as eval sets (`eval.sets.<name>.mode: harness`, docs/evaluation.md,
"Harness sets").

Two halves:
  * planning (no torch, no lm-eval import but its version): `resolve_task` finds the task's YAML,
    the YAML files it includes, the Python modules its `!function`s name and its local data files,
    so their contents can be part of the fingerprints; a missing lm-eval, file or task is a one-line
    ConfigError naming the key;
  * scoring (`score_task`): lm-eval runs the task in this process through its Python API on the model
    the stage loaded (wrapped in lm-eval's HFLM, so checkpoints, state dicts and LoRA merges score as
    they do everywhere else), with `log_samples`; each document's value of the set's metric (0 or 1)
    under the set's filter becomes the item's `correct`, so the paired statistics, guards and
    `if_better` work on the set like on any other.

lm-eval is an optional dependency (`pip install 'sftflow[harness]'`): it is imported only here, only
inside the functions that need it.
"""

from __future__ import annotations

import copy
import functools
import glob
import json
import math
from pathlib import Path
from typing import Any

import yaml

from stages.core.errors import ConfigError
from stages.core.stats.scores import counted

INSTALL_HINT = "pip install 'sftflow[harness]' (lm_eval==0.4.13)"
TASK_SUFFIXES = (".yaml", ".yml")


def lm_eval_version(key: str) -> str:
    """lm-eval's version; a ConfigError naming `key` when it is not importable."""
    try:
        import lm_eval
        return str(lm_eval.__version__)
    except Exception:  # noqa: BLE001 - not installed, or broken: either way this set can't run
        raise ConfigError(f"{key}: mode: harness needs lm-evaluation-harness, which is not importable here; "
                          f"{INSTALL_HINT}") from None


def is_task_file(task: str) -> bool:
    """`task` names a YAML file (by suffix or a path separator) rather than a registered task name."""
    return task.endswith(TASK_SUFFIXES) or "/" in task or Path(task).expanduser().is_file()


# --------------------------------------------------------------------------- reading task YAML


def _loader(base: Path, modules: list[Path]) -> type:
    """A safe YAML loader for lm-eval task files: `!function utils.fn` becomes the text
    `!function utils.fn`, and the module file it names next to the YAML (if any) is recorded."""
    class Loader(yaml.SafeLoader):
        pass

    def function(loader, node):
        spec = loader.construct_scalar(node)
        mod = spec.rpartition(".")[0]
        path = base / f"{mod.replace('.', '/')}.py"
        if mod and path.is_file():
            modules.append(path.resolve())
        return f"!function {spec}"

    Loader.add_constructor("!function", function)
    return Loader


def read_task_yaml(path: Path, files: list[Path], key: str, seen: tuple[Path, ...] = ()) -> dict:
    """The task config as lm-eval merges it (an `include`d file's keys first, the file's own keys win);
    every file it reads (YAML and `!function` modules) is appended to `files`."""
    path = path.expanduser().resolve()
    if path in seen:
        raise ConfigError(f"{key}: {path} includes itself")
    if not path.is_file():
        raise ConfigError(f"{key}: task file '{path}' not found")
    modules: list[Path] = []
    try:
        cfg = yaml.load(path.read_text(encoding="utf-8"), Loader=_loader(path.parent, modules))  # a SafeLoader
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(f"{key}: {path} is not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{key}: {path} is not a task config (a mapping of keys)")
    files.append(path)
    files += [m for m in modules if m not in files]
    includes = cfg.pop("include", None)
    if includes is None:
        return cfg
    merged: dict = {}
    for inc in includes if isinstance(includes, list) else [includes]:
        inc_path = Path(inc) if Path(inc).is_absolute() else path.parent / inc
        inc_cfg = read_task_yaml(inc_path, files, key, (*seen, path))
        inc_cfg.pop("task_list", None)
        merged.update(inc_cfg)
    merged.update(cfg)
    return merged


def _local(ref: str, base: Path) -> list[Path]:
    """What a data-file pattern names: relative ones in the task's folder first, then the working
    directory (where sftflow reads every relative path); sorted glob matches."""
    pattern = Path(ref).expanduser()
    for root in ([Path()] if pattern.is_absolute() else [base, Path.cwd()]):
        found = sorted(Path(p).resolve() for p in glob.glob(str(root / pattern), recursive=True))
        if found:
            return found
    return []


def _absolute_data_files(data_files: Any, base: Path, key: str, task_file: Path, files: list[Path]) -> Any:
    """`dataset_kwargs.data_files` (a pattern, a list, or split -> either) with every pattern made
    absolute; each file it matches is appended to `files`."""
    if isinstance(data_files, dict):
        return {split: _absolute_data_files(v, base, key, task_file, files) for split, v in data_files.items()}
    if isinstance(data_files, (list, tuple)):
        return [x for v in data_files for x in _absolute_data_files(v, base, key, task_file, files)]
    found = _local(str(data_files), base)
    if not found:
        raise ConfigError(f"{key}: {task_file}: data file '{data_files}' not found (relative paths are read from "
                          f"the task's folder {base}, then the working directory)")
    files += [f for f in found if f not in files]
    return [str(f) for f in found]


def resolve_task(task: str, key: str) -> dict:
    """What a harness set's `task` is, torch-free: {name, yaml (or None), config (as lm-eval will load it,
    local data made absolute; None for a registered task, loaded by name), files (every local file whose
    contents define the task: YAML, includes, `!function` modules, data), output_type, metrics, filters}.
    A missing file, an unknown name or a group is a ConfigError naming `key`."""
    files: list[Path] = []
    if is_task_file(task):
        path = Path(task).expanduser()
        if not path.is_file():
            raise ConfigError(f"{key}='{task}': task file not found")
        cfg = read_task_yaml(path, files, key)
        if "task" not in cfg or "group" in cfg or not isinstance(cfg["task"], str):
            raise ConfigError(f"{key}='{task}': not a single task (a YAML with `task: <name>`; groups are not "
                              "supported: make one set per task)")
        base = path.expanduser().resolve().parent
        kwargs = cfg.get("dataset_kwargs") or {}
        if isinstance(kwargs, dict) and kwargs.get("data_files") is not None:
            cfg["dataset_kwargs"] = {**kwargs, "data_files": _absolute_data_files(kwargs["data_files"], base, key,
                                                                                 path, files)}
        dataset_path = cfg.get("dataset_path")
        if isinstance(dataset_path, str) and not Path(dataset_path).is_absolute():
            local = [p for p in (base / dataset_path, Path.cwd() / dataset_path) if p.is_dir()]
            if local:  # a dataset folder (or loading script folder) of the user's: its files define the data
                cfg["dataset_path"] = str(local[0].resolve())
        if isinstance(cfg.get("dataset_path"), str) and Path(cfg["dataset_path"]).is_dir():
            folder = Path(cfg["dataset_path"])
            files += sorted(f.resolve() for f in folder.rglob("*") if f.is_file() and f.resolve() not in files)
        name, yaml_path = cfg["task"], str(path.resolve())
    else:
        entry = _registered(task, key)
        cfg, yaml_path = {}, None
        if entry.yaml_path is not None:
            cfg = read_task_yaml(Path(entry.yaml_path), files, key)
            yaml_path = str(entry.yaml_path)
        name, cfg = task, None if entry.yaml_path is None else cfg
    shown = cfg or {}
    metrics = [m["metric"] for m in shown.get("metric_list") or []
               if isinstance(m, dict) and isinstance(m.get("metric"), str)]
    filters = [f["name"] for f in shown.get("filter_list") or [] if isinstance(f, dict) and "name" in f]
    return {"name": name, "yaml": yaml_path, "config": cfg if yaml_path and is_task_file(task) else None,
            "files": [str(f) for f in files], "output_type": shown.get("output_type"), "metrics": metrics,
            "filters": filters or (["none"] if shown else [])}


@functools.lru_cache(maxsize=1)
def task_manager():
    """lm-eval's TaskManager over its bundled tasks, built once per process: building it reads every
    bundled YAML (seconds)."""
    from lm_eval.tasks import TaskManager
    return TaskManager()


def _registered(task: str, key: str):
    """lm-eval's index entry of a registered task name; an unknown name, a group or a tag is a ConfigError."""
    entry = task_manager().task_index.get(task)
    if entry is None:
        raise ConfigError(f"{key}='{task}': not an lm-eval task name, nor a task file (a .yaml path)")
    if getattr(entry.kind, "name", "") not in ("TASK", "PY_TASK"):
        raise ConfigError(f"{key}='{task}': an lm-eval {entry.kind.name.lower()}, not a single task; make one set "
                          "per task")
    return entry


def chosen(set_cfg, resolved: dict, key: str) -> tuple[str, str]:
    """(the metric that is an item's correctness, the filter whose answers are scored): the set's `metric`
    and `filter`, else the task's first of each (`acc`, `exact_match`, ...; `none` without filters)."""
    metric = set_cfg.metric or (resolved["metrics"][0] if resolved["metrics"] else None)
    if metric is None:
        metric = {"multiple_choice": "acc", "generate_until": "exact_match"}.get(resolved["output_type"] or "")
    if metric is None:
        raise ConfigError(f"{key}: the task names no metric; set eval.sets.<set>.metric (a per-sample 0/1 metric)")
    if set_cfg.metric and resolved["metrics"] and set_cfg.metric not in resolved["metrics"]:
        raise ConfigError(f"{key}: metric '{set_cfg.metric}' is not one of the task's "
                          f"({', '.join(resolved['metrics'])})")
    filt = set_cfg.filter or (resolved["filters"][0] if resolved["filters"] else "none")
    if set_cfg.filter and resolved["filters"] and set_cfg.filter not in resolved["filters"]:
        raise ConfigError(f"{key}: filter '{set_cfg.filter}' is not one of the task's "
                          f"({', '.join(resolved['filters'])})")
    return metric, filt


# --------------------------------------------------------------------------- scoring


def _jsonable(x: Any) -> Any:
    return json.loads(json.dumps(x, default=str, ensure_ascii=False))


def _correct(value: Any, metric: str, set_name: str) -> bool:
    if isinstance(value, bool) or (isinstance(value, (int, float)) and value in (0, 1)):
        return bool(value)
    raise ValueError(f"eval set '{set_name}': lm-eval's per-sample '{metric}' is {value!r}, not 0 or 1; an item's "
                     "correctness needs a 0/1 metric (set eval.sets.<set>.metric, e.g. acc or exact_match)")


def records_of(samples: list[dict], metric: str, filt: str, set_name: str, task: str) -> list[dict]:
    """lm-eval's per-sample log of one task -> sftflow's per-item records, by doc_id: `prompt` is the
    document and `reference` its target (what was asked, not how a tokenizer rendered it, so two models'
    records pair); `correct` is the sample's `metric` under `filt`."""
    mine = [s for s in samples if s.get("filter", "none") == filt]
    if not mine:
        have = sorted({s.get("filter", "none") for s in samples})
        raise ValueError(f"eval set '{set_name}': lm-eval logged no samples under filter '{filt}' (it has: "
                         f"{', '.join(have) or 'none'})")
    out = []
    for s in sorted(mine, key=lambda s: s["doc_id"]):
        if metric not in s:
            raise ValueError(f"eval set '{set_name}': lm-eval's samples have no '{metric}' (they have: "
                             f"{', '.join(s.get('metrics') or [])})")
        target = _jsonable(s["target"])
        rec = {"set": set_name, "source": f"{task}:{s['doc_id']}", "doc_id": s["doc_id"], "prompt": _jsonable(s["doc"]),
               "reference": None, "prediction": None, "correct": _correct(s[metric], metric, set_name)}
        args = s.get("arguments") or []
        resps = s.get("filtered_resps") or []
        loglikelihood = bool(args) and len(args[0]) >= 2 and isinstance(args[0][1], str) and len(resps) == len(args) \
            and all(isinstance(r, (list, tuple)) and r and isinstance(r[0], (int, float)) for r in resps)
        if loglikelihood and len(args) > 1:  # multiple choice: one (context, option) request per option
            choices = [a[1] for a in args]
            logprobs = [float(r[0]) for r in s["filtered_resps"]]
            picked = max(range(len(logprobs)), key=lambda i: (logprobs[i], -i))
            rec.update(choices=choices, answer=target, picked=picked, logprobs=logprobs, prediction=choices[picked],
                       reference=(choices[target] if isinstance(target, int) and 0 <= target < len(choices)
                                  else str(target)))
        else:
            resp = s.get("filtered_resps") or [None]
            rec.update(reference=target if isinstance(target, str) else json.dumps(target, ensure_ascii=False),
                       prediction=_jsonable(resp[0] if len(resp) == 1 else resp),
                       response=_jsonable((s.get("resps") or [[None]])[0][0] if s.get("resps") else None))
        out.append(rec)
    return out


def lm_eval_metrics(results: dict) -> dict[str, float]:
    """lm-eval's aggregate numbers of one task under lm-eval's names (`acc,none`, `acc_stderr,none`,
    `exact_match,strict-match`); numbers only (a stderr lm-eval could not compute is left out)."""
    return {k: float(v) for k, v in results.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and "," in k and math.isfinite(float(v))}


def score_task(model, tok, set_cfg, set_name: str, batch_size: int) -> tuple[dict, list[dict]]:
    """Runs the set's task with lm-eval on `model`/`tok` (a Transformers causal LM and its tokenizer, on
    their device): (metrics, per-item records). `accuracy` is the mean of the items' correctness, so it
    equals lm-eval's `<metric>,<filter>`; `lm_eval` holds every number lm-eval reports for the task."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    key = f"eval.sets.{set_name}.task"
    resolved = resolve_task(set_cfg.task, key)
    metric, filt = chosen(set_cfg, resolved, key)
    # lm-eval may give the tokenizer a pad token: on a copy, so the stage's own tokenizer is unchanged
    lm = HFLM(pretrained=model, tokenizer=copy.deepcopy(tok), batch_size=batch_size)
    if resolved["config"] is not None:  # a task file: its config as read at planning, local data made absolute
        from lm_eval.tasks._yaml_loader import load_yaml
        config = load_yaml(resolved["yaml"], resolve_func=True)  # `!function`s as lm-eval resolves them
        for k in ("dataset_kwargs", "dataset_path"):
            if k in resolved["config"]:
                config[k] = resolved["config"][k]
        spec, manager = config, TaskManager(include_defaults=False)
    else:
        spec, manager = resolved["name"], task_manager()
    out = lm_eval.simple_evaluate(model=lm, tasks=[spec], num_fewshot=set_cfg.num_fewshot, limit=set_cfg.limit,
                                  apply_chat_template=set_cfg.uses_chat_template,
                                  fewshot_as_multiturn=set_cfg.uses_chat_template, log_samples=True,
                                  task_manager=manager)
    name = resolved["name"]
    if out is None or name not in out.get("samples", {}):
        raise ValueError(f"eval set '{set_name}': lm-eval returned no samples for task '{name}'")
    records = records_of(out["samples"][name], metric, filt, set_name, name)
    metrics = {**counted(sum(r["correct"] for r in records), len(records)), "mode": "harness", "task": name,
               "metric": metric, "filter": filt,
               "lm_eval": lm_eval_metrics(out["results"].get(name, {})), "lm_eval_version": str(lm_eval.__version__)}
    return metrics, records
