"""The run configuration: a pydantic schema, YAML loading and dotted overrides.

Everything is validated here, before any stage runs, so a typo costs a second and one
line of text rather than a torchrun launch. Relative paths are resolved against the
current working directory (the project root when you use `make`).
"""

from __future__ import annotations

import copy
import glob
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class ConfigError(ValueError):
    """A config problem, phrased as one line that names the key and the fix."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RunnerConfig(_Section):
    max_epochs: int = Field(3, ge=1)
    max_steps: int = Field(-1, description="<= 0: train max_epochs full epochs")
    val_check_interval: int = Field(0, description="validation loss every N steps; <= 0 only at the end")
    save_interval: int = Field(0, description="DCP checkpoint every N steps; <= 0 only at the end")
    keep_checkpoints: int = Field(2, ge=1)
    log_interval: int = Field(1, ge=1)
    seed: int = 1234
    resume: str = Field("auto", description="auto | never | <checkpoint path>")


class ModelConfig(_Section):
    model_type: str = "causal_lm"
    model_path: str = "builtin:tiny-chat"
    trust_remote_code: bool = False


class OptimConfig(_Section):
    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    warmup: float = Field(0.05, ge=0, description="< 1: fraction of total steps; >= 1: number of steps")
    scheduler: Literal["cosine", "linear", "constant"] = "cosine"
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    clip_grad: float = Field(1.0, description="max grad norm; <= 0 disables clipping")


class ActorConfig(_Section):
    nproc_per_node: int = Field(1, ge=1)
    nnodes: int = Field(1, ge=1)
    node_rank: int = Field(0, ge=0)
    rdzv_endpoint: str | None = Field(None, description="host:port of the c10d rendezvous; required when nnodes > 1")
    micro_batch_size: int = Field(4, ge=1)
    global_batch_size: int = Field(16, ge=1)
    max_tokens_per_micro_batch: int = Field(0, ge=0, description="> 0: micro-batches filled up to this many tokens")
    packing: bool = Field(True, description="padding-free packed micro-batches when the model supports them")
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    activation_checkpointing: bool = False
    compile: bool = False
    worker: str | None = Field(None, description="'pkg.module:Class' subclass of stages.train.worker.SFTWorker")
    model: ModelConfig = ModelConfig()
    optim: OptimConfig = OptimConfig()

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    @model_validator(mode="after")
    def _multi_node(self) -> "ActorConfig":
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError("actor.rdzv_endpoint is required when actor.nnodes > 1; set it to host:port of node 0")
        if self.node_rank >= self.nnodes:
            raise ValueError(f"actor.node_rank={self.node_rank} must be < actor.nnodes={self.nnodes}")
        if self.worker and ":" not in self.worker:
            raise ValueError(f"actor.worker='{self.worker}' must look like 'pkg.module:ClassName'")
        return self

    @model_validator(mode="after")
    def _batch_divisible(self) -> "ActorConfig":
        per_step = self.micro_batch_size * self.world_size
        if self.global_batch_size % per_step:
            lo = max(per_step, self.global_batch_size // per_step * per_step)
            raise ValueError(
                f"actor.global_batch_size={self.global_batch_size} must be divisible by "
                f"micro_batch_size x world size = {self.micro_batch_size} x {self.world_size} = {per_step}; "
                f"try actor.global_batch_size={lo}"
            )
        return self


CANONICAL_FIELDS = ("messages", "conversations", "conversation", "role", "content", "from", "value", "prompt",
                    "completion", "instruction", "input", "output", "system")


class DataConfig(_Section):
    train_data_paths: list[str] = Field(default_factory=list, min_length=1)
    val_data_paths: list[str] = Field(default_factory=list)
    val_fraction: float = Field(0.0, ge=0, lt=1, description="without val_data_paths: held-out share, by row hash")
    format: Literal["auto", "messages", "sharegpt", "prompt_completion", "alpaca", "conversation"] = "auto"
    columns: dict[str, str] = Field(default_factory=dict, description="canonical field -> your field name")
    max_length: int = Field(1024, ge=8)
    truncation: Literal["drop", "keep_start"] = "drop"
    loss_on: Literal["assistant", "last_assistant", "all"] = "assistant"
    strict: bool = Field(False, description="the first bad row is an error instead of being quarantined")
    shard_rows: int = Field(50_000, ge=1)
    num_proc: int = Field(1, ge=1, description="tokenizing processes; the output is identical for any value")

    @field_validator("train_data_paths", "val_data_paths", mode="before")
    @classmethod
    def _one_path_is_a_list(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @field_validator("columns")
    @classmethod
    def _known_columns(cls, v: dict[str, str]) -> dict[str, str]:
        unknown = sorted(set(v) - set(CANONICAL_FIELDS))
        if unknown:
            raise ValueError(f"unknown field(s) {unknown}; data.columns maps one of {', '.join(CANONICAL_FIELDS)} "
                             "to the name your data uses")
        return v


class EvalConfig(_Section):
    max_new_tokens: int = Field(64, ge=1)
    batch_size: int = Field(16, ge=1)
    max_samples: int = Field(0, description="<= 0: every held-out sample")
    eval_base: bool = Field(True, description="also score the untrained base model (base_accuracy)")
    scorer: str = Field("exact", description="exact | normalized | contains | regex | numeric | 'pkg.module:fn'")
    answer_pattern: str = Field(r"####\s*(-?[\d,]*\.?\d+)", description="regex/numeric: the answer is group 1 of the last match")
    numeric_tolerance: float = Field(1e-6, ge=0, description="numeric: relative or absolute tolerance")
    model: str | None = Field(None, description="None: the trained model; base | folder | train stage folder | "
                                                "checkpoint folder | models:/name@alias")

    @field_validator("scorer")
    @classmethod
    def _known_scorer(cls, v: str) -> str:
        from stages.evaluate.scorers import check_scorer_name
        check_scorer_name(v)
        return v

    @field_validator("answer_pattern")
    @classmethod
    def _compiles(cls, v: str) -> str:
        import re
        try:
            re.compile(v)
        except re.error as e:
            raise ValueError(f"not a valid regular expression ({e})") from None
        return v


class RegistryConfig(_Section):
    tracking_uri: str | None = Field(None, description="default: sqlite:///<artifacts_dir>/mlflow.db")
    experiment: str = "sftflow"
    model_name: str = "sftflow-model"
    promote: Literal["always", "if_better", "never"] = "if_better"
    live_after_seconds: float = Field(10, description="rank 0 logs to MLflow live once training looks this long; "
                                                      "< 0: only when the train stage ends")


class FlowConfig(_Section):
    """How Prefect runs the stages; never part of a fingerprint."""

    retries: int = Field(0, ge=0, description="task retries; a retried train resumes from its last checkpoint")
    retry_delay_seconds: float = Field(10, ge=0)
    timeout_seconds: float | None = Field(None, gt=0, description="per-task timeout; the torchrun tree is killed")


class SFTConfig(_Section):
    artifacts_dir: str = "artifacts"
    flow: FlowConfig = FlowConfig()
    runner: RunnerConfig = RunnerConfig()
    actor: ActorConfig = ActorConfig()
    data: DataConfig
    eval: EvalConfig = EvalConfig()
    registry: RegistryConfig = RegistryConfig()

    @property
    def artifacts_path(self) -> Path:
        return Path(self.artifacts_dir).resolve()

    @property
    def resolved_tracking_uri(self) -> str:
        return self.registry.tracking_uri or f"sqlite:///{self.artifacts_path / 'mlflow.db'}"


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
    if kind == "value_error":
        return msg if not loc else f"{loc}: {msg}"
    return f"{loc}: {msg} (got {e.get('input')!r})"


def _section_for(dotted: str) -> type[BaseModel] | None:
    model: type[BaseModel] = SFTConfig
    for part in [p for p in dotted.split(".") if p]:
        field = model.model_fields.get(part)
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            return None
        model = field.annotation
    return model


def expand_paths(patterns: list[str], key: str) -> list[Path | str]:
    """Inputs named by paths, globs or directories, sorted; an empty match is an error.

    A directory means the data files under it (by suffix), unless it is a `datasets`
    save_to_disk folder, which is one input; `hf:NAME` (a hub dataset) passes through."""
    from stages.prepare.readers import HUB_PREFIX, SUFFIXES, is_datasets_folder
    files: list[Path | str] = []
    for pattern in patterns:
        if pattern.startswith(HUB_PREFIX):
            files.append(pattern)
            continue
        p = Path(pattern).expanduser()
        if any(ch in pattern for ch in "*?["):
            matches = sorted(Path(m) for m in glob.glob(str(p), recursive=True) if Path(m).is_file() or is_datasets_folder(Path(m)))
        elif is_datasets_folder(p):
            matches = [p]
        elif p.is_dir():
            # `datasets` folders inside are one input each; their own .json files are not data
            datasets = {f.parent for f in p.rglob("*.json") if is_datasets_folder(f.parent)}
            matches = sorted([d for d in datasets if not any(a in d.parents for a in datasets)] + [
                f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in SUFFIXES
                and not any(part.startswith(".") for part in f.relative_to(p).parts)
                and not any(d in f.parents for d in datasets)])
            if not matches:
                raise ConfigError(f"{key}: directory '{pattern}' holds no data files ({', '.join(sorted(SUFFIXES))})")
        elif p.is_file():
            matches = [p]
        else:
            matches = []
        if not matches:
            raise ConfigError(f"{key}: '{pattern}' does not exist (cwd: {os.getcwd()}); fix the path or run from the project root")
        files.extend(m.resolve() for m in matches)
    return files


def load_config(path: str | os.PathLike, overrides: list[str] | None = None) -> SFTConfig:
    path = Path(path)
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
    return config_from_dict(apply_overrides(raw, overrides or []), source=str(path))


def config_from_dict(raw: dict, source: str = "<config>") -> SFTConfig:
    try:
        cfg = SFTConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(f"{source}: {_first_error_line(e)}") from None
    expand_paths(cfg.data.train_data_paths, "data.train_data_paths")
    if cfg.data.val_data_paths:
        expand_paths(cfg.data.val_data_paths, "data.val_data_paths")
    elif cfg.data.val_fraction <= 0:
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
