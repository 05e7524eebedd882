"""The `eval` section of the config: how replies are generated and scored, the builtin scorers'
names and the default answer pattern, the named eval sets (`eval.sets`: their files and scorer,
or an lm-evaluation-harness task with its `HARNESS_KEYS`), the primary set and the promotion guards.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from .fields import _Section, hashed_unless_default, unhashed
from ..cache.imports import is_import_path

# Its effect on results is the config values, which every fingerprint hashes as data; editing
# a description here must not retrain anything.
__fingerprint__ = False

SCORER_NAMES = ("exact", "normalized", "contains", "regex", "numeric")
DEFAULT_ANSWER_PATTERN = r"####\s*(-?[\d,]*\.?\d+)"


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
    # hashed only when set: configs that leave it keep their fingerprints (a change re-decides the alias)
    champion_tolerance: float = hashed_unless_default(
        0.1, ge=0, le=1,
        description="promotion guard against the champion (registry.promote: if_better): a version whose accuracy "
                    "on this set is more than this below the champion's (paired, same items, on the estimate) "
                    "stays challenger; the primary set is judged by registry.tolerance and registry.decide_on")
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
                            "natively (an Ampere or later GPU, ROCm) or a CPU measured it faster at the model's "
                            "decode shapes, else fp32. fp32: replies and "
                            "accuracy do not depend on eval.batch_size or the process count; bf16 is faster, but "
                            "its greedy replies follow the batch's rounding (docs/evaluation.md, 'Replies, batch "
                            "size and precision')")
    launch: Literal["auto", "in_process", "torchrun"] = unhashed(
        "auto", description="with actor.nproc_per_node > 1, where evaluate, baseline and champion score: under "
                            "torchrun, one rank per training process, or in the stage's process. auto: in the "
                            "stage's process on a machine without GPUs when the evaluation is small (torchrun's "
                            "start would cost more than its ranks save: stages/evaluate/placement.py), else torchrun")
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
