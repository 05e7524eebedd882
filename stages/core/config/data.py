"""The sections of the config about the data: `data` (training and validation files, their format
and columns, lengths, the data gate, the weighted mixture `data.mix` and a warm start's
`data.rehearsal`) and `replay` (the prompts the base model answers for the mixture's `replay`
source), with the names they share: the canonical fields, the formats, the mixture's built-in sources.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator

from .fields import _Section, unhashed

# Its effect on results is the config values, which every fingerprint hashes as data; editing
# a description here must not retrain anything.
__fingerprint__ = False

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
