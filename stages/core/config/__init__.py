"""The run configuration: a pydantic schema, YAML loading and dotted overrides.

Everything is validated here, once per run, before any stage runs, so a typo costs a second
and one line of text rather than a torchrun launch. Relative paths are resolved against the
current working directory (the project root when you use `make`).

Fields that can't change a stage's result (how the work is spread, how often it is logged)
are declared with `unhashed(...)`; `hashed(section)` is what fingerprints see. Data paths
are unhashed too: fingerprints hash the *contents* of the files they name.

The sections are this package's modules, by part of the config: fields.py (`unhashed`,
`hashed`, the sections' base), actor.py (`runner`, `actor`), data.py (`data`, `replay`), eval.py
(`eval`); here are the whole config (`SFTConfig`), the `registry`, `flow` and `retention`
sections, the inputs' keys, loading and overrides. Every name of the schema is importable from
here (`from stages.core.config import ...`), and only from here outside this package: every package
of stages/ and flows/ may import it.
"""

from __future__ import annotations

import copy
import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field, PrivateAttr, ValidationError, field_validator, model_validator

from .actor import ActorConfig, RunnerConfig
from .fields import _Section, unhashed
from .data import REHEARSE, DataConfig, ReplayConfig
from ..errors import ConfigError
from .eval import EvalConfig
from ..cache.inputs import expand_paths

# The names of the sections' modules, importable from here as before this module was split:
# `from stages.core.config import ...` is the one import for anything of the config.
from .actor import HIGHER_IS_BETTER, VAL_METRICS, BestModelGuard, LoraConfig, ModelConfig, OptimConfig  # noqa: F401
from .fields import hashed, hashed_unless_default  # noqa: F401
from .data import CANONICAL_FIELDS, FORMATS, MIX_BUILTIN, MixSource, RehearsalConfig  # noqa: F401
from .eval import DEFAULT_ANSWER_PATTERN, HARNESS_KEYS, SCORER_NAMES, EvalSetConfig, _scorer_name  # noqa: F401
from ..cache.imports import is_import_path  # noqa: F401
from ..machine.topology import auto_nproc, describe  # noqa: F401

# Its effect on results is the config values, which every fingerprint hashes as data; editing
# a description here must not retrain anything.
__fingerprint__ = False

__all__ = ["ConfigError", "SFTConfig", "load_config", "config_from_dict", "hashed", "flatten"]


def default_tracking_uri(artifacts_dir: str | os.PathLike = "artifacts") -> str:
    """MLflow's store when `registry.tracking_uri` is unset: a SQLite file in the artifacts folder."""
    return f"sqlite:///{Path(artifacts_dir).resolve() / 'mlflow.db'}"


CORPUS = "model/corpus"  # the inputs' key of actor.model.corpus_paths


class RegistryConfig(_Section):
    tracking_uri: str | None = Field(None, description="default: sqlite:///<artifacts_dir>/mlflow.db")
    experiment: str = "sftflow"
    model_name: str = "sftflow-model"
    promote: Literal["always", "if_better", "never"] = "if_better"
    tolerance: float = Field(0.0, ge=0, le=1, description="if_better: the new model may score at most this much below "
                                                          "the champion on the primary set (same items, paired)")
    decide_on: Literal["estimate", "interval"] = Field(
        "estimate", description="if_better judged on the paired delta to the champion (estimate) or on its 95% "
                                "interval's lower bound (interval: the data must show it is not worse than tolerance)")
    live_after_seconds: float = unhashed(10, description="rank 0 logs to MLflow live once training looks this long; "
                                                      "< 0: only when the train stage ends")
    ui_url: str = unhashed("http://127.0.0.1:5000", description="the MLflow UI that registration.json links to "
                                                             "when the tracking URI is not a server (`make ui`)")


class FlowConfig(_Section):
    """How Prefect runs the stages; never part of a fingerprint."""

    retries: int = Field(0, ge=0, description="task retries; a retried train resumes from its last checkpoint")
    retry_delay_seconds: float = Field(10, ge=0)
    timeout_seconds: float | None = Field(None, gt=0, description="per-task timeout; the torchrun tree is killed")


class RetentionConfig(_Section):
    """What `sftflow gc` and the policy after each flow run keep (stages/retention.py); never part of a
    fingerprint: it decides what stays on disk, not what a stage makes."""

    keep_versions: int = Field(3, ge=1, description="registered versions kept besides those with an alias (the "
                                                    "newest); older ones leave the registry with their model files")
    keep_days: float = Field(7, ge=0, description="a stage folder no kept version needs is dropped once unused "
                                                  "this many days")
    drop_checkpoints: bool = Field(True, description="drop a training's checkpoints once it finished and exported "
                                                     "model/")
    auto: bool = Field(True, description="apply the policy after every flow run (`serve` keeps itself tidy)")


REPLAY_PROMPTS = "replay/prompts"  # the inputs key of the replay stage's prompt files


def mix_split(source: str) -> str:
    """The inputs key of a mixture source's own files (`data.mix.<source>.paths`)."""
    return f"mix/{source}"


def eval_split(set_name: str) -> str:
    """The prepared split (and folder under the prepare stage) of a named eval set."""
    return f"eval/{set_name}"


def stale_train_validation(cfg: "SFTConfig") -> str | None:
    """A warning when a warm start chooses what ships by the `train` source's validation while that is
    data.val_data_paths: those files are the same every day (day 1's, when a day's config was copied
    from the first), so the check watches an earlier skill, not the rows the day adds (measured: the
    skills panel's month chose its checks by the identity rows and shipped the start on two days).
    None when nothing watches `train`, its validation is held out of the day's own rows, or the run
    starts from the base model."""
    r, d = cfg.runner, cfg.data
    watched = {r.metric_for_best_model.partition("/")[2] or "train"} if (
        r.early_stopping_patience or r.load_best_model_at_end) else set()
    watched |= {g.source for g in r.best_model_guard}
    if "train" not in watched or not d.val_data_paths or cfg.actor.init_from == "base":
        return None
    return (f"note: a warm start chooses its checks by the train source's validation, which is data.val_data_paths "
            f"({', '.join(d.val_data_paths)}), not rows of the data this run adds: give that skill's held-out rows "
            "there, or drop data.val_data_paths and data.val_fraction holds out the day's own rows")


class SFTConfig(_Section):
    artifacts_dir: str = unhashed("artifacts")
    flow: FlowConfig = unhashed(FlowConfig())
    retention: RetentionConfig = unhashed(RetentionConfig())
    runner: RunnerConfig = RunnerConfig()
    actor: ActorConfig = ActorConfig()
    data: DataConfig
    replay: ReplayConfig | None = None
    eval: EvalConfig = EvalConfig()
    registry: RegistryConfig = RegistryConfig()

    @field_validator("artifacts_dir")
    @classmethod
    def _a_folder(cls, v: str) -> str:
        if Path(v).expanduser().exists() and not Path(v).expanduser().is_dir():
            raise ValueError(f"'{v}' is a file; artifacts_dir must be a folder (created if missing)")
        return v

    @model_validator(mode="after")
    def _replay_is_mixed(self) -> "SFTConfig":
        if self.replay is not None and "replay" not in self.data.mix:
            raise ValueError("replay: its answers are a training source only through data.mix.replay (a weight)")
        if "replay" in self.data.mix and self.replay is None:
            raise ValueError("data.mix.replay needs a `replay` section (replay.prompt_paths: the prompts the base "
                             "model answers)")
        return self

    @property
    def artifacts_path(self) -> Path:
        return Path(self.artifacts_dir).resolve()

    @property
    def resolved_tracking_uri(self) -> str:
        return self.registry.tracking_uri or default_tracking_uri(self.artifacts_dir)

    _inputs: dict[str, list] | None = PrivateAttr(None)

    def inputs(self) -> dict[str, list[Path | str]]:
        """split -> the inputs its paths name now (globbed once per config object)."""
        if self._inputs is None:
            d = self.data
            self._inputs = {"train": expand_paths(d.train_data_paths, "data.train_data_paths"),
                            "val": expand_paths(d.val_data_paths, "data.val_data_paths") if d.val_data_paths else []}
            for name, s in self.eval.sets.items():
                if not s.is_harness:  # a harness task's files are found at planning (stages/inference/harness.py)
                    self._inputs[eval_split(name)] = expand_paths(s.data_paths, f"eval.sets.{name}.data_paths")
            for name, m in d.mix.items():
                if m.paths:
                    self._inputs[mix_split(name)] = expand_paths(m.paths, f"data.mix.{name}.paths")
            if self.replay is not None:
                self._inputs[REPLAY_PROMPTS] = expand_paths(self.replay.prompt_paths, "replay.prompt_paths")
            if self.actor.model.corpus_paths:
                self._inputs[CORPUS] = expand_paths(self.actor.model.corpus_paths, "actor.model.corpus_paths")
        return self._inputs

    def pin_inputs(self, inputs: dict[str, list[Path | str]]) -> None:
        """Use these inputs from now on instead of globbing the paths again: a plan handed to
        another process (a Prefect task's worker) must read exactly the files it was planned with."""
        self._inputs = {split: list(refs) for split, refs in inputs.items()}

    _rehearsal: list[dict] | None = PrivateAttr(None)

    def pin_rehearsal(self, entries: list[dict], new_train: list[Path | str]) -> None:
        """A warm start's rehearsal (the plan's `rehearsal`): `entries` ({ref, digest, format, columns}) are
        the `rehearse` source's files, `new_train` the train files its version has not trained on; and
        `data.rehearsal.kl_to_base`, when set, is the KL weight training uses (actor.kl_to_base), so the
        fingerprint, the worker's spec and train.log all see the weight that trains."""
        kl = self.data.rehearsal.kl_to_base
        if kl is not None:
            # through the schema's checks (the KL needs LoRA), on a copy: a refused weight leaves the actor as it was
            actor = self.actor.model_copy()
            try:
                actor.kl_to_base = kl
            except ValidationError as e:
                raise ConfigError(f"data.rehearsal.kl_to_base={kl:g} trains as actor.kl_to_base: "
                                  f"{_first_error_line(e)}") from None
            self.actor = actor
        inputs = self.inputs()
        inputs.setdefault(CORPUS, inputs["train"])  # a builtin tokenizer is still built from every train file
        inputs["train"] = list(new_train)
        inputs[mix_split(REHEARSE)] = [e["ref"] if e["ref"].startswith("hf:") else Path(e["ref"]) for e in entries]
        self._rehearsal = [dict(e) for e in entries]

    @property
    def rehearsal_files(self) -> list[dict]:
        """The rehearse source's files as the plan pinned them ([] when nothing is rehearsed)."""
        return self._rehearsal or []

    def mix_weights(self) -> dict[str, float]:
        """The training mixture's sources and weights, in the order their rows follow each other: data.mix,
        then `rehearse` on a warm start that rehearses; {} when train's rows are all there is."""
        weights = {n: m.weight for n, m in self.data.mix.items()}
        if self._rehearsal:
            weights = {"train": 1.0} if not weights else {"train": weights.pop("train"), **weights}
            weights[REHEARSE] = self.data.rehearsal.weight * weights["train"]
        elif weights:
            weights = {"train": weights.pop("train"), **weights}
        return weights


# --------------------------------------------------------------------------- loading


def parse_override(text: str) -> tuple[list[str], Any]:
    """`actor.optim.lr=1e-3` -> (["actor", "optim", "lr"], 0.001); the value is parsed as YAML."""
    if "=" not in text:
        raise ConfigError(f"override '{text}' is not KEY=VALUE (e.g. actor.optim.lr=1e-3)")
    key, raw = text.split("=", 1)
    parts = [p for p in key.strip().split(".") if p]
    if not parts:
        raise ConfigError(f"override '{text}' has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return parts, value


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    out = copy.deepcopy(raw)
    for text in overrides:
        parts, value = parse_override(text)
        node = out
        for p in parts[:-1]:
            child = node.setdefault(p, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override '{text}': '{p}' is a value, not a section")
            node = child
        node[parts[-1]] = value
    return out


def _first_error_line(err: ValidationError) -> str:
    e = err.errors()[0]
    loc = ".".join(str(p) for p in e["loc"] if p != "__root__")
    kind = e["type"]
    if kind == "extra_forbidden":
        section = ".".join(str(p) for p in e["loc"][:-1])
        model = _section_for(section)
        known = ", ".join(model.model_fields) if model else ""
        return f"unknown key '{loc}'" + (f"; known keys in '{section or '<top>'}': {known}" if known else "")
    if kind == "missing":
        return f"missing required key '{loc}'"
    msg = e["msg"].removeprefix("Value error, ")
    if kind == "value_error":  # a section's check names its own keys ("actor.global_batch_size=20 ...")
        return msg if not loc or msg.startswith(f"{loc}.") else f"{loc}: {msg}"
    return f"{loc}: {msg} (got {e.get('input')!r})"


def _section_for(dotted: str) -> type[BaseModel] | None:
    model: type[BaseModel] = SFTConfig
    for part in [p for p in dotted.split(".") if p]:
        field = model.model_fields.get(part)
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            return None
        model = field.annotation
    return model


# Keys a served deployment's runs may not override unless `sftflow serve --allow-override` says so:
# they run code (imports, remote code), read files from elsewhere, or send data elsewhere.
SERVE_PROTECTED = ("actor.worker", "eval.scorer", "eval.sets", "actor.model.trust_remote_code", "runner.resume",
                   "artifacts_dir", "registry.tracking_uri", "actor.model.model_type")


def check_overrides_allowed(overrides: list[str], protected: list[str]) -> None:
    """A ConfigError for an override that sets a protected key, or a section holding one."""
    for text in overrides:
        key = ".".join(parse_override(text)[0])
        for p in protected:
            if key == p or p.startswith(key + ".") or key.startswith(p + "."):
                raise ConfigError(f"override '{text}': {p} can't be set by the runs of this deployment "
                                  f"(`sftflow serve --allow-override {p}` allows it)")


def load_config(path: str | os.PathLike, overrides: list[str] | None = None) -> SFTConfig:
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"config '{path}' is a folder, not a config file (e.g. configs/default.yaml)")
    if not path.is_file():
        raise ConfigError(f"config file '{path}' not found")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}{where}: invalid YAML ({getattr(e, 'problem', e)})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections (runner, actor, data, ...)")
    return config_from_dict(apply_overrides(raw, overrides or []), source=str(path), overrides=overrides or [])


_DOTTED_KEY = re.compile(r"\b[a-z_]+(?:\.[A-Za-z0-9_-]+)+")


def _origin(line: str, loc: str, overrides: list[str]) -> str:
    """Where the value an error line is about came from: the last command-line override that set one
    of the keys the line names (or a section holding it), else ''."""
    keys = set(_DOTTED_KEY.findall(line.split(" (got ")[0])) | ({loc} if "." in loc else set())
    for text in reversed(overrides):
        key = ".".join(parse_override(text)[0])
        if any(k == key or k.startswith(key + ".") for k in keys):
            return text
    return ""


def config_from_dict(raw: dict, source: str = "<config>", overrides: list[str] | None = None) -> SFTConfig:
    """`source`: the config file the values came from; `overrides`: the command line's KEY=VALUE
    settings applied to it, named instead of the file in an error about a key they set."""
    def where(line: str, loc: str = "") -> str:
        origin = _origin(line, loc, overrides or [])
        return f"command-line override '{origin}'" if origin else source
    try:
        cfg = SFTConfig.model_validate(raw)
    except ValidationError as e:
        line = _first_error_line(e)
        loc = ".".join(str(p) for p in e.errors()[0]["loc"] if p != "__root__")
        raise ConfigError(f"{where(line, loc)}: {line}") from None
    try:
        cfg.inputs()
    except ConfigError as e:  # a missing data file: the key and file are in the line, the config here
        raise ConfigError(f"{where(str(e))}: {e}") from None
    if not cfg.data.val_data_paths and cfg.data.val_fraction <= 0 and not cfg.eval.sets:
        raise ConfigError(f"{source}: evaluate needs held-out prompts: set data.val_data_paths, "
                          "or data.val_fraction (e.g. 0.05) to hold out a share of the training rows")
    return cfg


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': 1}} -> {'a.b': 1}: MLflow params and `show` output."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out
