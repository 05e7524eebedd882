"""The SFT worker: one process per rank under torchrun.

    python -m torch.distributed.run ... -m stages.train <spec.json>

`SFTWorker` owns the loop: process group, FSDP2 sharding, gradient accumulation, clipping,
LR schedule, validation, checkpoints, metrics and export. A subclass adapts it to another
model or data layout by overriding `build_dataset` (or its RLinf name `build_dataloader`),
`collate`, `get_train_model_output` and `get_eval_model_output` (docs/adding-a-model.md).
Evaluate uses the same subclass through `SFTWorker.for_eval`. What `get_train_model_output`
returns is read in one place, `as_train_output`, into a `TrainOutput`.

Loss of a global step = (sum of token cross-entropy -- or of `actor.loss`'s per-token objective --
over all micro-batches on all ranks) / (trainable tokens of the whole global step, all-reduced
before backward). FSDP averages gradients over ranks, so each rank scales its loss by world size
to undo that average.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from stages.core.config import SFTConfig
from stages.core.errors import ConfigError, StageError
from stages.core.imports import import_object
from stages.core.topology import backend
from stages.tracking.live import RankZeroMetrics, read_metrics_file

from . import checkpoint as ckpt
from . import faults
from .attention import effective_attn_implementation, resolve_attn_implementation
from .batches import DataPosition, GlobalBatchSampler, SFTDataset, collate_packed, collate_padded, pad_token_id
from .distributed import choose_precision, local_device, log
from .lora import adapters_off, lora_enabled, unwrap
from .loss import model_loss, reference_outputs
from .mixture import describe, summary_line
from .model_types import (UnknownModelType, WeightsLoadError, build_configured_model, fsdp_units, get_model_builder,
                          load_state_checked)
from .schedule import lr_lambda

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

RUNTIME_FILE = "runtime.json"  # the settings `auto` resolved to, written by rank 0 in the output folder
# Dense bf16 peak FLOP/s per device, for the MFU estimate (unknown devices report none).
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "L4": 121e12}


class WorkerSpec(BaseModel):
    """Everything a worker is given (written as `spec.json` in the stage folder)."""

    model_config = ConfigDict(extra="forbid")

    config: SFTConfig
    model_path: str | None = None      # the base model (weights to start from, tokenizer)
    out_dir: str                       # the stage folder being built
    train_dir: str | None = None       # prepared shards
    val_dir: str | None = None
    mix: list[dict] = []               # the mixture's sources in the train split's row order: {source, rows, weight}

    def write(self, path: Path) -> Path:
        path.write_text(self.model_dump_json(indent=2))
        return path

    @classmethod
    def read(cls, path: str | Path) -> "WorkerSpec":
        return cls.model_validate_json(Path(path).read_text())


@dataclass(frozen=True)
class TrainOutput:
    """One micro-batch's share of a step, as `get_train_model_output` returns it: the loop adds up
    `loss_sum` and `n_tokens` over all micro-batches and ranks of the step and divides once."""

    loss_sum: torch.Tensor  # sum of the per-token (per-unit) losses, attached to the graph
    n_tokens: float         # how many tokens (units) `loss_sum` sums over

    # It reads as the `(loss_sum, n_tokens)` tuple it replaces: overrides that unpack or index
    # `super().get_train_model_output(batch)` keep working.
    def __iter__(self):
        return iter((self.loss_sum, self.n_tokens))

    def __getitem__(self, i):
        return (self.loss_sum, self.n_tokens)[i]


def as_train_output(out, trainable_tokens: float, method: str = "get_train_model_output") -> TrainOutput:
    """What `get_train_model_output` returned, as a TrainOutput: the one place its accepted forms are
    read (docs/adding-a-model.md lists them).

    * a `TrainOutput`: as it is (`n_tokens` as a float);
    * `(loss_sum, n_tokens)`, RLinf's form (a tuple or list of two): a tensor and a count -- a
      number, or a tensor that is not floating;
    * a tensor: a mean loss over the micro-batch's trainable tokens, `trainable_tokens` (the
      dataset's count); its loss sum is the mean times that count;
    * a list/tuple of tensors (a pair whose second is a floating tensor included): summed, then
      a mean loss as above.

    Anything else is a TypeError naming `method` (e.g. "MyWorker.get_train_model_output")."""
    if isinstance(out, TrainOutput):
        return TrainOutput(out.loss_sum, float(out.n_tokens))
    if isinstance(out, (tuple, list)) and len(out) == 2 and torch.is_tensor(out[0]) and not (
            torch.is_tensor(out[1]) and out[1].is_floating_point()):
        return TrainOutput(out[0], float(out[1]))
    if isinstance(out, (tuple, list)):
        out = sum(out)
    if not torch.is_tensor(out):
        raise TypeError(f"{method} returned {type(out).__name__}; expected a TrainOutput, (loss_sum, n_tokens), "
                        "a tensor (a mean loss) or a list/tuple of tensors (summed into one)")
    return TrainOutput(out * trainable_tokens, trainable_tokens)


@dataclass(frozen=True)
class Sharding:
    """How `build_model` wrapped the model with FSDP2."""

    fsdp: bool           # sharded at all (one fp32 process is not: nothing to shard, reduce or cast)
    keep_gathered: bool  # gathered weights stay until a step's last backward (`reshard_after_forward` off)



class SFTWorker:
    """One rank's training (`fit`), or a scorer around a loaded model (`for_eval`).

    Every attribute is declared here. `__init__` sets the first group; training sets the others in
    `setup`, each group in one block there; `for_eval` sets placement, tokenizer, model and
    sharding, the rest of what scoring reads."""

    # What the run is (__init__).
    spec: WorkerSpec
    cfg: SFTConfig              # spec.config
    out: Path                   # the stage folder being built
    ckpt_dir: Path              # out/checkpoints

    # Where this rank runs (init_distributed, assigned in setup).
    device: torch.device
    rank: int
    world: int
    precision: str              # "bf16" or "fp32": actor.precision resolved for the device
    # what the built model runs (actor.attn_implementation resolved; "n/a": not transformers)
    attn_implementation: str

    # The tokenizer of Hugging Face models (load_tokenizer); other model types have none, and
    # export writes their bare state dict.
    tokenizer: PreTrainedTokenizerBase | None
    pad_id: int                 # pads padded micro-batches

    # The model and how FSDP2 wraps it (build_model, assigned in setup).
    model: torch.nn.Module
    fsdp: bool                  # see Sharding
    keep_gathered: bool         # see Sharding
    packing: bool               # packed micro-batches: asked for, and the model's logits allow it

    # Data (setup). The datasets are what build_dataset returns (see there).
    train_ds: Any
    val_ds: Any | None          # None without a validation set
    sample_lengths: np.ndarray  # train_ds.lengths, tokens per sample: balances ranks and micro-batches
    sample_trainable_tokens: np.ndarray  # train_ds.trainable, loss tokens per sample: each step's exact divisor
    sampler: GlobalBatchSampler  # which samples each rank's micro-batches of a step hold
    total_steps: int            # optimizer steps of the whole run

    # Optimization (setup).
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR

    # The MFU estimate in the metrics (setup).
    n_params: int               # all parameters, LoRA's frozen base included (a DTensor counts whole)
    peak_flops: float | None    # the device's dense bf16 peak (PEAK_FLOPS); unknown devices: None

    # The KL sum of the last micro-batch when get_train_model_output adds actor.kl_to_base's term;
    # None otherwise. forward_backward clears it before each micro-batch and adds it up.
    last_kl: torch.Tensor | None
    # Likewise the plain cross-entropy sum when the loss is another objective (`actor.loss: dft`).
    last_ce: torch.Tensor | None

    def __init__(self, spec: WorkerSpec | dict):
        self.spec = spec if isinstance(spec, WorkerSpec) else WorkerSpec.model_validate(spec)
        self.cfg = self.spec.config
        self.out = Path(self.spec.out_dir)
        self.ckpt_dir = self.out / "checkpoints"
        self.tokenizer = None
        self.pad_id = 0
        self.last_kl = None
        self.last_ce = None

    @classmethod
    def for_eval(cls, spec: WorkerSpec, model: torch.nn.Module, device: torch.device, rank: int,
                 world: int) -> "SFTWorker":
        """A worker around an already loaded, unsharded `model` for scoring: no process group,
        optimizer or FSDP of its own; its tokenizer, `build_dataset`, `collate` and
        `get_eval_model_output` are the subclass's."""
        w = cls(spec)
        w.device, w.rank, w.world = device, rank, world
        w.precision = "bf16" if next(model.parameters()).dtype == torch.bfloat16 else "fp32"
        w.tokenizer, w.pad_id = w.load_tokenizer()
        w.model, w.fsdp, w.keep_gathered, w.packing = model, False, False, False
        return w

    # ------------------------------------------------------------------ setup
    def init_distributed(self) -> tuple[torch.device, int, int, str]:
        """Starts this rank's process group; (device, rank, world size, precision)."""
        device = local_device()
        dist.init_process_group(backend(device.type))
        return device, dist.get_rank(), dist.get_world_size(), choose_precision(self.cfg.actor.precision, device)

    def build_model(self) -> tuple[torch.nn.Module, Sharding]:
        """The configured model on this rank's device, with LoRA, activation checkpointing and
        compilation as configured, wrapped with FSDP2 unless one fp32 process has nothing to shard;
        and how it was wrapped. Reads `device`, `world` and `precision`."""
        actor = self.cfg.actor
        try:
            attn = resolve_attn_implementation(actor.attn_implementation, self.device.type, actor.packing,
                                               self.precision)
            model = build_configured_model(self.cfg, self.spec.model_path, seed=self.cfg.runner.seed,
                                           device=self.device, lora=lora_enabled(self.cfg), attn_implementation=attn)
        except UnknownModelType as e:
            raise ConfigError(str(e)) from None
        units = fsdp_units(unwrap(model))  # the blocks themselves: peft swaps layers inside them, not the blocks
        if actor.activation_checkpointing:
            # transformers renamed gradient_checkpointing_enable (5.24 warns that the alias goes in v6);
            # older transformers and custom models may have only the old name
            if hasattr(model, "activation_checkpointing_enable"):
                model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            elif hasattr(model, "gradient_checkpointing_enable"):
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            else:
                raise ConfigError("actor.activation_checkpointing needs a model with activation_checkpointing_enable() "
                                 "or gradient_checkpointing_enable()")
        if actor.compile:
            for unit in units or [model]:
                unit.compile()
        # One fp32 process has nothing to shard, reduce or cast: FSDP would only add per-layer hooks.
        # DCP checkpoints stay interchangeable with sharded runs (they reshard on load).
        if not (self.world > 1 or self.precision == "bf16"):
            return model, Sharding(fsdp=False, keep_gathered=False)
        mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if self.precision == "bf16" else MixedPrecisionPolicy())
        # gloo on a few cores is bound by collectives, not memory: gathering each layer once per
        # step instead of twice per micro-batch is most of what FSDP costs there
        reshard = actor.reshard_after_forward
        keep_gathered = not (reshard if reshard is not None else self.device.type != "cpu")
        for unit in units:
            fully_shard(unit, mp_policy=mp, reshard_after_forward=not keep_gathered)
        fully_shard(model, mp_policy=mp, reshard_after_forward=not keep_gathered)
        return model, Sharding(fsdp=True, keep_gathered=keep_gathered)

    def build_dataset(self, data_paths: str, eval_dataset: bool = False):
        """A dataset with len(), ds[i], and int arrays `lengths` (tokens per sample, for balancing)
        and `trainable` (loss tokens per sample, for exact loss weighting); see batches.SFTDataset.
        The base class asks `build_dataloader`, so a subclass may override either name."""
        return self.build_dataloader(data_paths, eval_dataset)

    def build_dataloader(self, data_paths: str, eval_dataset: bool = False):
        """RLinf's name for `build_dataset`; the prepared Arrow shards by default."""
        return SFTDataset(data_paths)

    def load_tokenizer(self) -> tuple[PreTrainedTokenizerBase | None, int]:
        """(the base model's tokenizer, the pad id) for a causal LM; (None, 0) for other model types."""
        if not self.spec.model_path or self.cfg.actor.model.model_type != "causal_lm":
            return None, 0
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(self.spec.model_path,
                                            trust_remote_code=self.cfg.actor.model.trust_remote_code)
        return tok, pad_token_id(tok)

    def supports_packing(self) -> bool:
        """Packed logits must equal unpacked ones; checked once on two short sequences, on every rank."""
        from transformers import PreTrainedModel
        if not isinstance(unwrap(self.model), PreTrainedModel):
            return False
        ids = self.train_ds[0]["input_ids"][:12]
        a = {"input_ids": ids, "loss_mask": np.ones_like(ids)}
        b = {"input_ids": ids[::-1].copy(), "loss_mask": np.ones_like(ids)}
        with torch.no_grad():
            packed = self.model(**{k: v.to(self.device) for k, v in collate_packed([a, b]).items() if k != "labels"},
                                use_cache=False).logits[0].float()
            single = self.model(input_ids=torch.as_tensor(b["input_ids"], device=self.device)[None].long(),
                                use_cache=False).logits[0].float()
        tol = 1e-2 if self.precision == "bf16" else 1e-4
        return bool(torch.allclose(packed[len(ids):], single, atol=tol, rtol=tol))

    def reshard(self) -> None:
        """After a no-grad forward no backward frees gathered weights: the root's always stay
        gathered, and every block's too when they are kept (`reshard_after_forward` off). Resharding
        them makes checkpoint loads, state dicts and the optimizer meet sharded parameters only."""
        if self.fsdp:
            for m in self.model.modules():
                if isinstance(m, FSDPModule):
                    m.reshard()

    # ------------------------------------------------------------------ model outputs
    def collate(self, samples: list[dict]) -> dict[str, torch.Tensor]:
        batch = collate_packed(samples) if self.packing else collate_padded(samples, self.pad_id)
        return {k: v.to(self.device) for k, v in batch.items()}

    def _token_loss_sum(self, batch: dict) -> tuple[torch.Tensor, int]:
        """(sum of cross-entropy over the batch's trained tokens, their number); the output head
        and the loss run on the trained positions only, in chunks, where the model allows it (loss.py)."""
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        sums = model_loss(self.model, inputs, batch["labels"])
        return sums.ce, sums.n_tokens

    def get_train_model_output(self, batch: dict) -> TrainOutput:
        """The micro-batch's loss sum and token count; the loop divides by the global step's summed
        `n_tokens`. An override may also return `(loss_sum, n_tokens)` or a mean loss (a tensor, or
        a list/tuple of tensors that are summed): `as_train_output` lists what is accepted. The
        token loss is `actor.loss`: the cross-entropy, or with `dft` each token's cross-entropy
        weighted by its own detached probability (then `self.last_ce` holds the plain cross-entropy
        sum). With `actor.kl_to_base` the loss sum includes beta x KL(base || tuned) and
        `self.last_kl` holds the KL sum."""
        beta, dft = self.cfg.actor.kl_to_base, self.cfg.actor.loss == "dft"
        if not beta and not dft:
            return TrainOutput(*self._token_loss_sum(batch))
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        reference = None
        if beta:
            with torch.no_grad(), adapters_off(self.model):
                reference = reference_outputs(self.model, inputs, batch["labels"])
        sums = model_loss(self.model, inputs, batch["labels"], dft=dft, reference=reference)
        loss_sum = sums.dft if dft else sums.ce
        if dft:
            self.last_ce = sums.ce.detach()
        if beta:
            self.last_kl = sums.kl.detach()
            loss_sum = loss_sum + beta * sums.kl
        return TrainOutput(loss_sum, sums.n_tokens)

    def get_eval_model_output(self, batch: dict):
        """`(loss_sum, n_tokens)` or a dict of summable numbers (`loss_sum`, `n_tokens`, `correct`, `total`, ...)."""
        return self._token_loss_sum(batch)

    @staticmethod
    def add_eval_output(sums: dict[str, float], out) -> None:
        """Adds what get_eval_model_output returned (`(loss_sum, n_tokens)` or a dict) into `sums`."""
        if not isinstance(out, dict):
            out = {"loss_sum": out[0], "n_tokens": out[1]}
        for key, v in out.items():
            sums[key] = sums.get(key, 0.0) + float(v)

    # ------------------------------------------------------------------ loop pieces
    def micro_batch(self, indices) -> tuple[dict, bool]:
        """A collated micro-batch; an empty slot reuses sample 0 with zero weight (collectives must run)."""
        if len(indices) == 0:
            return self.collate([self.train_ds[0]]), False
        return self.collate([self.train_ds[int(i)] for i in indices]), True

    def validate(self) -> dict:
        if self.val_ds is None or len(self.val_ds) == 0:
            return {}
        self.model.eval()
        mbs = self.cfg.actor.micro_batch_size
        mine = list(range(self.rank, len(self.val_ds), self.world))
        n_batches = math.ceil(math.ceil(len(self.val_ds) / self.world) / mbs)
        sums: dict[str, float] = {}
        with torch.no_grad():
            for k in range(n_batches):
                idx = mine[k * mbs: (k + 1) * mbs]
                out = self.get_eval_model_output(self.collate([self.val_ds[i] for i in (idx or [0])]))
                if idx:
                    self.add_eval_output(sums, out)
        keys = ["loss_sum", "n_tokens", "correct", "total"]
        keys += sorted(k for k in sums if k not in keys)
        stats = torch.tensor([sums.get(k, 0.0) for k in keys], dtype=torch.float64, device=self.device)
        self.reshard()
        dist.all_reduce(stats)
        self.model.train()
        total = dict(zip(keys, stats.tolist()))
        out = {"val_loss": total["loss_sum"] / max(total["n_tokens"], 1.0), "val_tokens": int(total["n_tokens"])}
        if total["total"] > 0:
            out["val_accuracy"] = total["correct"] / total["total"]
        return out

    def save_checkpoint(self, step: int, pos: DataPosition) -> None:
        """A resumable checkpoint of `step` (model, optimizer, data position; runtime/checkpoint.py), the
        oldest beyond `runner.keep_checkpoints` removed. The test hook's two kill points sit around it."""
        ckpt.save_checkpoint(self.ckpt_dir, step, self.model, self.optimizer, self.trainer_state(step, pos),
                             keep=self.cfg.runner.keep_checkpoints, before_complete=lambda: faults.inject("save", step))
        log(f"checkpoint step {step} saved")
        faults.inject("after_save", step)

    def trainer_state(self, step: int, pos: DataPosition) -> dict:
        return {"step": step, "data_position": pos.to_dict(), "scheduler": self.scheduler.state_dict(),
                "world_size": self.world, "total_steps": self.total_steps}

    def maybe_resume(self) -> tuple[int, DataPosition]:
        resume = self.cfg.runner.resume
        if resume == "never":
            return 0, DataPosition()
        if resume == "auto":
            path = ckpt.newest_usable(self.ckpt_dir, warn=log)
            if path is None:
                if ckpt.list_checkpoints(self.ckpt_dir):
                    log("no usable checkpoint: training starts from the beginning")
                return 0, DataPosition()
        else:
            path = Path(resume)
            if not (path / ckpt.COMPLETE).is_file():
                raise ConfigError(f"runner.resume: '{path}' is not a complete checkpoint (no {ckpt.COMPLETE})")
            problem = ckpt.checkpoint_problem(path)
            if problem is not None:
                raise ConfigError(f"runner.resume: '{path}' can't be used: {problem}")
        state, rng_ok = ckpt.load_checkpoint(path, self.model, self.optimizer)
        self.scheduler.load_state_dict(state["scheduler"])
        pos = DataPosition(**state["data_position"])
        log(f"resumed from {path} at step {state['step']} (epoch {pos.epoch}, {pos.consumed} samples into it)"
            + ("" if rng_ok else f"; world size {state['world_size']} -> {self.world}, RNG streams start fresh"))
        return state["step"], pos

    # ------------------------------------------------------------------ main loop
    def setup(self) -> None:
        """Everything `fit` needs, in this order: process group, tokenizer, data, model, optimizer,
        packing, MFU constants."""
        run, actor = self.cfg.runner, self.cfg.actor
        self.device, self.rank, self.world, self.precision = self.init_distributed()
        self.tokenizer, self.pad_id = self.load_tokenizer()

        self.train_ds = self.build_dataset(self.spec.train_dir)
        if len(self.train_ds) == 0:  # 0 steps would export the base model as if it were trained
            raise StageError(f"no training samples in {self.spec.train_dir} ({type(self).__name__}.build_dataset)")
        self.val_ds = self.build_dataset(self.spec.val_dir, eval_dataset=True) if self.spec.val_dir else None
        ones = np.ones(len(self.train_ds))  # a dataset without the arrays: every sample counts one
        self.sample_lengths = np.asarray(getattr(self.train_ds, "lengths", ones), dtype=np.int64)
        self.sample_trainable_tokens = np.asarray(getattr(self.train_ds, "trainable", ones), dtype=np.int64)
        mixture = None
        if self.spec.mix:
            mixture = ([m["weight"] for m in self.spec.mix], [m["rows"] for m in self.spec.mix])
            log(summary_line(describe([m["source"] for m in self.spec.mix], *mixture)))
        self.sampler = GlobalBatchSampler(self.sample_lengths, actor.global_batch_size, actor.micro_batch_size,
                                          self.world, run.seed, actor.max_tokens_per_micro_batch,
                                          interleave=actor.packing, mixture=mixture)
        steps_all_epochs = self.sampler.steps_per_epoch * run.max_epochs
        self.total_steps = min(run.max_steps, steps_all_epochs) if run.max_steps > 0 else steps_all_epochs

        self.model, sharding = self.build_model()
        self.fsdp, self.keep_gathered = sharding.fsdp, sharding.keep_gathered
        self.attn_implementation = effective_attn_implementation(self.model)
        self.model.train()

        o = actor.optim
        # Before any forward: FSDP2 keeps the root unsharded after a no-grad forward, and the
        # optimizer must hold the sharded parameters.
        trainable_params = [p for p in self.model.parameters() if p.requires_grad]  # LoRA: the adapters only
        # foreach: one op over all parameters instead of one per parameter. CPU's default is the
        # per-parameter loop, whose DTensor dispatch under FSDP2 cost ~5% of a 2-process step.
        self.optimizer = torch.optim.AdamW(trainable_params, lr=o.lr, betas=o.betas, weight_decay=o.weight_decay,
                                           foreach=True)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(self.total_steps, o.warmup, o.scheduler, o.min_lr_ratio))

        self.packing = False
        if actor.packing:
            self.packing = self.supports_packing()
            self.reshard()
            if not self.packing:
                log(f"packing: {type(self.model).__name__} can't be packed (packed logits differ from unpacked or "
                    "no position_ids); using padded micro-batches")

        self.n_params = sum(p.numel() for p in self.model.parameters())  # a DTensor's numel is the global size
        if lora_enabled(self.cfg):
            n_train = sum(p.numel() for p in trainable_params)
            log(f"LoRA r={actor.lora.r}: {n_train:,} trainable of {self.n_params:,} parameters "
                f"({100 * n_train / self.n_params:.2f}%)")
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else ""
        self.peak_flops = next((v for k, v in PEAK_FLOPS.items() if k in name), None)

    def forward_backward(self, batch_idx) -> dict:
        """Accumulates the gradient of one global batch; loss normalized by its total trainable tokens.

        The normalizer must be known before the first backward, so it comes from the dataset's
        `trainable` counts (`sample_trainable_tokens`); when the model outputs' own `n_tokens` add up
        to a different total, the gradients are rescaled once at the end, so the step divides by
        what the outputs said."""
        micro = self.sampler.rank_micro_batches(batch_idx, self.rank)
        share = np.concatenate(micro) if micro else np.zeros(0, dtype=np.int64)
        counts = torch.tensor([float(self.sample_trainable_tokens[share].sum()),
                               float(self.sample_lengths[share].sum())], dtype=torch.float64, device=self.device)
        n_micro = torch.tensor([float(len(micro))], dtype=torch.float64, device=self.device)
        dist.all_reduce(counts)
        dist.all_reduce(n_micro, op=dist.ReduceOp.MAX)
        micro += [np.zeros(0, dtype=np.int64)] * (int(n_micro.item()) - len(micro))
        expected = max(counts[0].item(), 1.0)
        # loss sum, tokens the outputs counted, KL sum (actor.kl_to_base; the loss sum includes it x beta),
        # cross-entropy sum (actor.loss other than ce)
        sums = torch.zeros(4, dtype=torch.float64, device=self.device)
        for k, idx in enumerate(micro):
            batch, real = self.micro_batch(idx)
            if self.fsdp:
                self.model.set_requires_gradient_sync(k == len(micro) - 1)
                if self.keep_gathered:
                    self.model.set_reshard_after_backward(k == len(micro) - 1)
            self.last_kl = self.last_ce = None
            out = as_train_output(self.get_train_model_output(batch),
                                  float(self.sample_trainable_tokens[idx].sum()) if real else 0.0,
                                  f"{type(self).__name__}.get_train_model_output")
            ls, n = out.loss_sum, out.n_tokens
            if not real:
                ls, n = ls * 0.0, 0.0
            elif self.last_kl is not None:
                sums[2] += self.last_kl.double()
            elif self.cfg.actor.kl_to_base:  # a subclass's own output: the term asked for would be missing
                raise ConfigError(f"actor.kl_to_base: {type(self).__name__}.get_train_model_output adds no KL "
                                 "term (the base class's does); remove the setting or add the term")
            if real and self.cfg.actor.loss != "ce":
                if self.last_ce is None:  # a subclass's own output: the objective asked for would be missing
                    raise ConfigError(f"actor.loss: {type(self).__name__}.get_train_model_output does not compute "
                                     f"'{self.cfg.actor.loss}' (the base class's does); remove the setting or "
                                     "compute it and set self.last_ce")
                sums[3] += self.last_ce.double()
            (ls * self.world / expected).backward()
            sums[0] += ls.detach().double()
            sums[1] += n
        dist.all_reduce(sums)
        counted = max(sums[1].item(), 1.0)
        if counted != expected:
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(expected / counted)
        out = {"loss": sums[0].item() / counted, "trainable_tokens": int(sums[1].item()),
               "tokens": int(counts[1].item()), "micro_batches": len(micro)}
        beta = self.cfg.actor.kl_to_base
        if beta:  # the logged loss is the token loss alone (the cross-entropy by default), without beta x KL
            out["kl"] = sums[2].item() / counted
            out["loss"] -= beta * out["kl"]
        if self.cfg.actor.loss != "ce":  # `loss` is that objective's mean; `ce` compares with val_loss and other runs
            out["ce"] = sums[3].item() / counted
        return out

    def optimizer_step(self) -> tuple[float, float]:
        grad_norm = self._clip()
        self.optimizer.step()
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, lr

    def fit(self) -> None:
        self.setup()
        run = self.cfg.runner
        step, pos = self.maybe_resume()
        metrics_path = self.out / "metrics.jsonl"
        live = None
        if self.rank == 0:
            self._truncate_metrics(metrics_path, step)
            # with MLFLOW_RUN_ID (set by the train stage) rows also go to that MLflow run while training runs
            live = RankZeroMetrics(metrics_path, step, self.total_steps, self.cfg.registry.live_after_seconds)
        metrics_f = open(metrics_path, "a") if self.rank == 0 else None
        log(f"training {self.total_steps} steps: {len(self.train_ds)} samples, world {self.world}, "
            f"accum {self.sampler.accum}, precision {self.precision}, device {self.device.type}, "
            f"attention {self.attn_implementation}, {'packed' if self.packing else 'padded'} micro-batches")
        if self.rank == 0:  # what `auto` resolved to on this machine: the train stage logs it to MLflow
            (self.out / RUNTIME_FILE).write_text(json.dumps({
                "attn_implementation": self.attn_implementation, "precision": self.precision,
                "device": self.device.type, "packing": self.packing, "world_size": self.world}))
        bar = self._progress_bar(step)
        while step < self.total_steps:
            t0 = time.perf_counter()
            batch_idx = self.sampler.global_batch(pos)
            row = self.forward_backward(batch_idx)
            grad_norm, lr = self.optimizer_step()
            pos = self.sampler.advance(pos, len(batch_idx))
            step += 1
            dt = time.perf_counter() - t0
            row = {"step": step, "epoch": round(pos.epoch + pos.consumed / len(self.train_ds), 4), **row,
                   "grad_norm": grad_norm, "lr": lr, "tokens_per_s": row["tokens"] / dt, "step_time": dt}
            if self.peak_flops:
                row["mfu"] = 6 * self.n_params * row["tokens_per_s"] / (self.peak_flops * self.world)
            if (run.val_check_interval > 0 and step % run.val_check_interval == 0) or step == self.total_steps:
                row.update(self.validate())
            if metrics_f:
                metrics_f.write(json.dumps(row) + "\n")
                metrics_f.flush()
            if live:
                live.log(row)
            self._report(row, step, bar)
            if (run.save_interval > 0 and step % run.save_interval == 0) or step == self.total_steps:
                self.save_checkpoint(step, pos)
        if bar:
            bar.close()
        if metrics_f:
            metrics_f.close()
        self.export()
        if live:
            live.close()
        dist.barrier()
        dist.destroy_process_group()

    def _progress_bar(self, step: int):
        """A live bar when a person watches a terminal; under the flow, log lines instead."""
        if self.rank != 0 or not sys.stderr.isatty():
            return None
        from tqdm import tqdm
        return tqdm(total=self.total_steps, initial=step, desc="train", dynamic_ncols=True)

    def _report(self, row: dict, step: int, bar) -> None:
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{row['loss']:.4f}", tok_s=f"{row['tokens_per_s']:.0f}")
            return
        if step % self.cfg.runner.log_interval == 0 or step == self.total_steps:
            extra = (f" kl {row['kl']:.4f}" if "kl" in row else "") + (
                f" val_loss {row['val_loss']:.4f}" if "val_loss" in row else "")
            log(f"step {step}/{self.total_steps} epoch {row['epoch']:.2f} loss {row['loss']:.4f} "
                f"grad_norm {row['grad_norm']:.3f} lr {row['lr']:.2e} tok/s {row['tokens_per_s']:.0f}{extra}")

    def _clip(self) -> float:
        max_norm = self.cfg.actor.optim.clip_grad
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"), foreach=True)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        return float(norm)

    @staticmethod
    def _truncate_metrics(path: Path, step: int) -> None:
        """On resume, drop lines logged after the checkpoint so every step appears exactly once."""
        if not path.exists():
            return
        keep = [row for row in read_metrics_file(path) if row["step"] <= step]
        path.write_text("".join(json.dumps(row) + "\n" for row in keep))

    def full_state_dict(self) -> dict:
        """The trained model's weights, gathered whole to rank 0 on CPU (LoRA: the adapters merged in)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        lora = lora_enabled(self.cfg)
        full = get_model_state_dict(self.model, options=StateDictOptions(
            full_state_dict=True, cpu_offload=True, ignore_frozen_params=lora))
        if not lora or self.rank != 0:
            return full
        return self._merged_state_dict(full)

    def _merged_state_dict(self, adapters: dict) -> dict:
        """A fresh base model (as `build_model` makes it, on CPU in fp32) with the trained adapters:
        saved in peft's format to `adapter/`, then merged; its plain state dict."""
        try:
            peft_model = build_configured_model(self.cfg, self.spec.model_path, device="cpu", float32=True, lora=True,
                                                weights=adapters, where="the trained model")
        except WeightsLoadError as e:
            raise RuntimeError(f"export: {e}") from None
        peft_model.save_pretrained(self.out / "adapter")
        log(f"exported LoRA adapters to {self.out / 'adapter'}")
        return peft_model.merge_and_unload().state_dict()

    def export(self) -> None:
        """Full state dict gathered to rank 0 on CPU; a Hugging Face folder for HF models,
        `model.safetensors` of the state dict for anything else."""
        full = self.full_state_dict()
        if self.rank != 0:
            return
        dest = self.out / "model"
        dest.mkdir(parents=True, exist_ok=True)
        if self.tokenizer is None:
            from safetensors.torch import save_file
            save_file({k: v.contiguous() for k, v in full.items()}, str(dest / "model.safetensors"))
            log(f"exported state dict to {dest / 'model.safetensors'}")
            return
        from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
        src, trust = self.spec.model_path, self.cfg.actor.model.trust_remote_code
        config = AutoConfig.from_pretrained(src, trust_remote_code=trust)
        with torch.device("cpu"):
            plain = AutoModelForCausalLM.from_config(config, trust_remote_code=trust, dtype=torch.float32)
        try:
            load_state_checked(plain, full, "the trained model")
        except ValueError as e:
            raise RuntimeError(f"export: {e}") from None
        plain.tie_weights()
        try:
            plain.generation_config = GenerationConfig.from_pretrained(src)
        except OSError:
            pass
        plain.save_pretrained(dest, safe_serialization=True)
        self.tokenizer.save_pretrained(dest)
        log(f"exported Hugging Face model to {dest}")


def load_worker_class(path: str | None) -> type[SFTWorker]:
    """`actor.worker` (importing it also registers its model types); a ConfigError naming the key."""
    if not path:
        return SFTWorker
    cls = import_object(path, "actor.worker")
    if not (isinstance(cls, type) and issubclass(cls, SFTWorker)):
        raise ConfigError(f"actor.worker='{path}' is not a subclass of stages.runtime.worker.SFTWorker")
    return cls


def check_worker_config(cfg: SFTConfig) -> type[SFTWorker]:
    """Before torchrun starts: the worker class imports and the model type is registered."""
    cls = load_worker_class(cfg.actor.worker)
    try:
        get_model_builder(cfg.actor.model.model_type)
    except UnknownModelType as e:
        raise ConfigError(str(e)) from None
    return cls


def load_worker(spec_path: str) -> SFTWorker:
    """A rank's worker for the `spec.json` torchrun was given (`python -m stages.train <spec.json>`)."""
    spec = WorkerSpec.read(spec_path)
    return load_worker_class(spec.config.actor.worker)(spec)
