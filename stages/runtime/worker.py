"""The SFT worker: one process per rank. The train stage starts `torchrun` (launch/launcher.py,
through launch/local_torchrun.py), whose ranks each run `python -m stages.train <spec.json>`:
`load_worker` checks the class named by `actor.worker` against the contract (runtime/contract.py),
then `fit` runs `setup` and the loop and always closes (metrics, MLflow, process group).

`SFTWorker` owns the loop -- gradient accumulation, exact loss weighting, clipping, the LR schedule
-- and composes the parts that do the rest:

    runtime/sharding.py       `parallelize`: activation checkpointing, compilation, FSDP2
    runtime/saving/checkpoint_schedule.py  `Checkpointer`: when to save, what to resume (DCP:
                              runtime/saving/checkpoint.py)
    runtime/reporting.py      `Reporter`: metrics.jsonl, live MLflow rows, progress, runtime.json
    runtime/validation.py     `validate`: the validation loss and accuracy across ranks; `BestCheck`:
                              early stopping and the step whose weights ship
    runtime/saving/hf_export.py         `export_model`: the gathered state dict, LoRA merge, the HF folder
    runtime/packing.py        `packs_exactly`: whether the model may train on packed micro-batches

Public surface (docs/adding-a-model.md). Hooks a subclass overrides, one name and one return type
each: `build_dataloader`, `collate`, `get_train_model_output` (-> `TrainOutput`),
`get_eval_model_output` (-> dict of summable numbers); less often `load_tokenizer`, `build_model`,
`supports_packing`, `init_distributed`, `setup`, `optimizer_step`. Methods others call: `fit`, `setup`,
`forward_backward`, `optimizer_step`, `validate`, `export`, `reshard`, `add_eval_output` and
`SFTWorker.for_eval` (the evaluate stage). Attributes a subclass may read are the ones the class
declares below; they are set in `__init__`, `setup` or `for_eval` and nowhere else.

Loss of a global step = (sum of token cross-entropy -- or of `actor.loss`'s per-token objective --
over all micro-batches on all ranks) / (trainable tokens of the whole global step, all-reduced
before backward). FSDP averages gradients over ranks, so each rank scales its loss by world size
to undo that average.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict

from stages.core.config import SFTConfig, stale_train_validation
from stages.core.machine.cores import follow_threads
from stages.core.errors import ConfigError, StageError
from stages.core.cache.imports import import_object
from stages.core.machine.topology import backend

from stages.planning.attention import effective_attn_implementation, resolve_attn_implementation
from .batches import GlobalBatchSampler, SFTDataset, collate_packed, collate_padded, pad_token_id, sample_of_trained
from .saving.checkpoint_schedule import Checkpointer
from .contract import TrainOutput, add_eval_output, check_worker_class, train_output
from .distributed import choose_precision, local_device, log, precision_why
from .saving.hf_export import export_model
from .lora import adapters_off, lora_enabled
from .qlora import base_bytes_line
from .loss import model_loss, reference_outputs
from .mixture import describe, held_out_line, summary_line
from .packing import packs_exactly
from .model_types import UnknownModelType, build_configured_model, get_model_builder
from .reporting import PEAK_FLOPS, Reporter, epochs_done, samples_said
from .schedule import lr_lambda
from .sharding import Sharding, parallelize, reshard
from .validation import BestCheck, Joined, validate

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

class WorkerSpec(BaseModel):
    """Everything a worker is given (written as `spec.json` in the stage folder)."""

    model_config = ConfigDict(extra="forbid")

    config: SFTConfig
    model_path: str | None = None      # the base model (weights to start from, tokenizer)
    out_dir: str                       # the stage folder being built
    train_dir: str | None = None       # prepared shards
    val_dir: str | None = None
    mix: list[dict] = []               # the mixture's sources in the train split's row order: {source, rows, weight}
    epoch_samples: int = 0             # > 0: a mixture epoch's samples (a warm start's, sized by its new rows)
    kl_rows_from: int = 0              # > 0: actor.kl_to_base holds only rows from here on (the earlier sources)
    val_mix: list[dict] = []           # held-out rows per mixture source, in mixture order: {source, rows, dir}

    def write(self, path: Path) -> Path:
        path.write_text(self.model_dump_json(indent=2))
        return path

    @classmethod
    def read(cls, path: str | Path) -> "WorkerSpec":
        return cls.model_validate_json(Path(path).read_text())


class SFTWorker:
    """One rank's training (`fit`), or a scorer around a loaded model (`for_eval`).

    Every attribute is declared here. `__init__` sets the first group; training sets the others in
    `setup`, each group in one block there; `for_eval` sets placement, tokenizer, model and
    sharding, the rest of what scoring reads."""

    # What the run is (__init__).
    spec: WorkerSpec
    cfg: SFTConfig              # spec.config
    out: Path                   # the stage folder being built
    checkpointer: Checkpointer  # out/checkpoints: saves on runner.save_interval, resumes runner.resume

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
    fsdp: bool                  # see sharding.Sharding
    keep_gathered: bool         # see sharding.Sharding
    packing: bool               # packed micro-batches: asked for, and the model's logits allow it

    # Data (setup). The datasets are what build_dataloader returns (see there).
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
    peak_flops: float | None    # the device's dense bf16 peak (reporting.PEAK_FLOPS); unknown devices: None

    def __init__(self, spec: WorkerSpec | dict):
        self.spec = spec if isinstance(spec, WorkerSpec) else WorkerSpec.model_validate(spec)
        self.cfg = self.spec.config
        self.out = Path(self.spec.out_dir)
        self.checkpointer = Checkpointer(self.out, self.cfg.runner)
        self.tokenizer = None
        self.pad_id = 0

    @classmethod
    def for_eval(cls, spec: WorkerSpec, model: torch.nn.Module, device: torch.device, rank: int,
                 world: int) -> "SFTWorker":
        """A worker around an already loaded, unsharded `model` for scoring: no process group,
        optimizer or FSDP of its own; its tokenizer, `build_dataloader`, `collate` and
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
        return (device, dist.get_rank(), dist.get_world_size(),
                choose_precision(self.cfg.actor.precision, device, self.spec.model_path))

    def build_model(self) -> tuple[torch.nn.Module, Sharding]:
        """The configured model on this rank's device, with LoRA, activation checkpointing and
        compilation as configured, wrapped with FSDP2 unless one fp32 process has nothing to shard
        (sharding.parallelize); and how it was wrapped. Reads `device`, `world` and `precision`."""
        actor = self.cfg.actor
        try:
            attn = resolve_attn_implementation(actor.attn_implementation, self.device.type, actor.packing,
                                               self.precision)
            model = build_configured_model(self.cfg, self.spec.model_path, seed=self.cfg.runner.seed,
                                           device=self.device, lora=lora_enabled(self.cfg), nf4=True,
                                           attn_implementation=attn)
        except UnknownModelType as e:
            raise ConfigError(str(e)) from None
        return model, parallelize(model, actor, self.device, self.world, self.precision)

    def build_dataloader(self, data_paths: str, eval_dataset: bool = False):
        """The dataset of `data_paths` (RLinf's name; the prepared Arrow shards by default): len(),
        ds[i], and int arrays `lengths` (tokens per sample, for balancing) and `trainable` (loss
        tokens per sample, for exact loss weighting); see batches.SFTDataset."""
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
        """Packed logits equal unpacked ones for this model (packing.packs_exactly, on the first
        training sample); every rank checks."""
        return packs_exactly(self.model, self.train_ds, self.device, self.precision)

    def reshard(self) -> None:
        """Frees the weights a no-grad forward left gathered (sharding.reshard); nothing unsharded."""
        if self.fsdp:
            reshard(self.model)

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
        """The micro-batch's `TrainOutput`: its loss sum and token count; the loop divides by the
        global step's summed `n_tokens`. The token loss is `actor.loss`: the cross-entropy, or with
        `dft` each token's cross-entropy weighted by its own detached probability (then `ce_sum`
        holds the plain cross-entropy sum). With `actor.kl_to_base` the loss sum includes
        beta x KL(base || tuned) and `kl_sum` holds the KL sum."""
        beta, dft = self.cfg.actor.kl_to_base, self.cfg.actor.loss == "dft"
        kl_mask = batch.pop("kl_mask", None)
        if not beta and not dft:
            return TrainOutput(*self._token_loss_sum(batch))
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        reference = None
        if beta:
            with torch.no_grad(), adapters_off(self.model):
                reference = reference_outputs(self.model, inputs, batch["labels"], kl_mask)
        sums = model_loss(self.model, inputs, batch["labels"], dft=dft, reference=reference)
        loss_sum = sums.dft if dft else sums.ce
        if beta:
            loss_sum = loss_sum + beta * sums.kl
        return TrainOutput(loss_sum, sums.n_tokens, kl_sum=sums.kl.detach() if beta else None,
                           ce_sum=sums.ce.detach() if dft else None)

    def get_eval_model_output(self, batch: dict) -> dict:
        """A dict of summable numbers: `loss_sum` and `n_tokens` (the validation loss), `token_correct`
        (trained tokens whose argmax is the label: the replies' teacher-forced token accuracy),
        `reply_correct` of `reply_total` (samples whose every trained token is the argmax: their replies
        are what greedy decoding answers, token for token, given the reference turns before each), and
        when the model counts them `correct` and `total` (the accuracy); any other key is summed too."""
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        sums = model_loss(self.model, inputs, batch["labels"], accuracy=True)
        samples = sample_of_trained(batch)
        replies = int(samples.unique().numel())
        return {"loss_sum": sums.ce, "n_tokens": sums.n_tokens, "token_correct": sums.correct,
                "reply_correct": replies - int(samples[~sums.hits].unique().numel()), "reply_total": replies}

    def add_eval_output(self, sums: dict[str, float], out) -> None:
        """Adds what get_eval_model_output returned into `sums` (the evaluate stage sums with it too)."""
        add_eval_output(sums, out, self._hook("get_eval_model_output"))

    def _hook(self, name: str) -> str:
        return f"{type(self).__name__}.{name}"

    # ------------------------------------------------------------------ loop pieces
    def micro_batch(self, indices) -> tuple[dict, bool]:
        """A collated micro-batch; an empty slot reuses sample 0 with zero weight (collectives must run)."""
        if len(indices) == 0:
            return self.collate([self._sample(0)]), False
        return self.collate([self._sample(int(i)) for i in indices]), True

    def _sample(self, i: int) -> dict:
        """Row i of the train split; with `kl_rows_from`, marked whether the KL holds it (`kl`)."""
        if not self.spec.kl_rows_from:
            return self.train_ds[i]
        return {**self.train_ds[i], "kl": i >= self.spec.kl_rows_from}

    def validate(self) -> dict:
        """`val_loss`, `val_tokens`, `val_token_accuracy` (and `val_accuracy`) over the validation set,
        with a mixture also per source (`val_loss/<source>`, ...: validation.validate); {} without one."""
        return validate(self.model, self.val_ds, lambda samples: self.get_eval_model_output(self.collate(samples)),
                        self._hook("get_eval_model_output"), self.cfg.actor.micro_batch_size, self.rank, self.world,
                        self.device, self.fsdp, [m for m in self.spec.val_mix if m["rows"]] or None)

    def _observe(self, selection: BestCheck, step: int, metrics: dict) -> None:
        """Counts a validation check; keeps its weights when it is the new best and they will ship.
        The ranks' reduced sums should agree already; rank 0's values are broadcast so that whether to
        stop and what to keep can never differ between ranks by a rounding."""
        values = torch.tensor(selection.values(metrics, self._hook("get_eval_model_output")),
                              dtype=torch.float64, device=self.device)
        dist.broadcast(values, src=0)
        value, tie, guard_values = selection.split(values.tolist())
        best = selection.observe(step, value, guard_values, tie=tie)
        if selection.guards or selection.tie:
            broken = selection.rejected[-1]["guard"] if selection.rejected and selection.rejected[-1]["step"] == step \
                else None
            log(f"check at step {step}: {selection.metric} {value:.6g}"
                + (f" ({selection.tie} {tie:.6g})" if selection.tie else "")
                + ("" if step == 0 and selection.guards
                   else f" ({'the best so far' if best else 'not better'})" if broken is None
                   else f", not eligible: {broken}")
                + ("; the start's " + ", ".join(f"{k} {v:.6g}" for k, v in guard_values.items())
                   if step == 0 and selection.guards else ""))
        if best and selection.load_best:
            self.checkpointer.save_best(step, self.model)

    # ------------------------------------------------------------------ main loop
    def setup(self) -> None:
        """Everything `fit` needs, in this order: process group, tokenizer, data, model, optimizer,
        packing, MFU constants."""
        run, actor = self.cfg.runner, self.cfg.actor
        self.device, self.rank, self.world, self.precision = self.init_distributed()
        self.tokenizer, self.pad_id = self.load_tokenizer()

        self.train_ds = self.build_dataloader(self.spec.train_dir)
        if len(self.train_ds) == 0:  # 0 steps would export the base model as if it were trained
            raise StageError(f"no training samples in {self.spec.train_dir} ({self._hook('build_dataloader')})")
        self.val_ds = self.build_dataloader(self.spec.val_dir, eval_dataset=True) if self.spec.val_dir else None
        if self.spec.val_mix and self.val_ds is not None:
            # every source's held-out rows, one after another: validate scores each apart
            self.val_ds = Joined([self.val_ds if m["dir"] == self.spec.val_dir else
                                  self.build_dataloader(m["dir"], eval_dataset=True)
                                  for m in self.spec.val_mix if m["rows"]])
            log(held_out_line(self.spec.val_mix, self.cfg.data.val_fraction, bool(self.cfg.data.val_data_paths)))
        ones = np.ones(len(self.train_ds))  # a dataset without the arrays: every sample counts one
        self.sample_lengths = np.asarray(getattr(self.train_ds, "lengths", ones), dtype=np.int64)
        self.sample_trainable_tokens = np.asarray(getattr(self.train_ds, "trainable", ones), dtype=np.int64)
        mixture = None
        if self.spec.mix:
            mixture = ([m["weight"] for m in self.spec.mix], [m["rows"] for m in self.spec.mix],
                       self.spec.epoch_samples or None)
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
            if actor.lora.quantize != "none":
                log(base_bytes_line(self.model))
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else ""
        self.peak_flops = next((v for k, v in PEAK_FLOPS.items() if k in name), None)

    def forward_backward(self, batch_idx) -> dict:
        """Accumulates the gradient of one global batch; loss normalized by its total trainable tokens.

        The normalizer must be known before the first backward, so it comes from the dataset's
        `trainable` counts (`sample_trainable_tokens`); when the outputs' own `n_tokens` add up to
        a different total, the gradients are rescaled once at the end, so the step divides by what
        the outputs said."""
        micro = self.sampler.rank_micro_batches(batch_idx, self.rank)
        share = np.concatenate(micro) if micro else np.zeros(0, dtype=np.int64)
        counts = torch.tensor([float(self.sample_trainable_tokens[share].sum()),
                               float(self.sample_lengths[share].sum())], dtype=torch.float64, device=self.device)
        n_micro = torch.tensor([float(len(micro))], dtype=torch.float64, device=self.device)
        dist.all_reduce(counts)
        dist.all_reduce(n_micro, op=dist.ReduceOp.MAX)
        micro += [np.zeros(0, dtype=np.int64)] * (int(n_micro.item()) - len(micro))
        expected = max(counts[0].item(), 1.0)
        beta, objective, hook = self.cfg.actor.kl_to_base, self.cfg.actor.loss, self._hook("get_train_model_output")
        # loss sum, tokens the outputs counted, KL sum (actor.kl_to_base; the loss sum includes it x beta),
        # cross-entropy sum (actor.loss other than ce)
        sums = torch.zeros(4, dtype=torch.float64, device=self.device)
        for k, idx in enumerate(micro):
            batch, real = self.micro_batch(idx)
            if self.fsdp:
                self.model.set_requires_gradient_sync(k == len(micro) - 1)
                if self.keep_gathered:
                    self.model.set_reshard_after_backward(k == len(micro) - 1)
            out = train_output(self.get_train_model_output(batch), hook)
            ls, n = out.loss_sum, float(out.n_tokens)
            if not real:
                ls, n = ls * 0.0, 0.0
            else:
                if beta and out.kl_sum is None:  # a subclass's own output: the term asked for would be missing
                    raise ConfigError(f"actor.kl_to_base: {hook} adds no KL term (its TrainOutput has no kl_sum; "
                                      "the base class's has); remove the setting or add the term")
                if objective != "ce" and out.ce_sum is None:  # likewise the objective asked for
                    raise ConfigError(f"actor.loss: {hook} does not compute '{objective}' (its TrainOutput has no "
                                      "ce_sum; the base class's has); remove the setting or compute it")
                if beta:
                    sums[2] += out.kl_sum.detach().double()
                if objective != "ce":
                    sums[3] += out.ce_sum.detach().double()
            (ls * self.world / expected).backward()
            sums[0] += ls.detach().double()
            sums[1] += n
        dist.all_reduce(sums)
        counted = max(sums[1].item(), 1.0)
        if counted != expected:
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(expected / counted)
        stats = {"loss": sums[0].item() / counted, "trainable_tokens": int(sums[1].item()),
                 "tokens": int(counts[1].item()), "micro_batches": len(micro)}
        if beta:  # the logged loss is the token loss alone (the cross-entropy by default), without beta x KL
            stats["kl"] = sums[2].item() / counted
            stats["loss"] -= beta * stats["kl"]
        if objective != "ce":  # `loss` is that objective's mean; `ce` compares with val_loss and other runs
            stats["ce"] = sums[3].item() / counted
        return stats

    def optimizer_step(self) -> tuple[float, float]:
        """Clips, steps the optimizer and the LR schedule; (grad norm before clipping, the LR used)."""
        max_norm = self.cfg.actor.optim.clip_grad
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"), foreach=True)
        grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        self.optimizer.step()
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, lr

    def fit(self) -> None:
        """Setup, the resumed or fresh loop, export; the metrics, MLflow rows, progress display and
        process group are closed however it ends."""
        reporter, failed = None, True
        try:
            self.setup()
            run = self.cfg.runner
            step, pos = self.checkpointer.resume(self.model, self.optimizer, self.scheduler, self.world)
            selection = self._selection()
            reporter = Reporter(self.out, self.rank, step, self.total_steps, run.log_interval,
                                self.cfg.registry.live_after_seconds, 6 * self.n_params, self.peak_flops)
            log(f"training {self.total_steps} steps: {samples_said(self.sampler.n, len(self.train_ds))}, "
                f"world {self.world}, "
                f"accum {self.sampler.accum}, "
                f"precision {precision_why(self.cfg.actor.precision, self.device, model_dir=self.spec.model_path)}, "
                f"device {self.device.type}, "
                f"attention {self.attn_implementation}, {'packed' if self.packing else 'padded'} micro-batches")
            runtime = {"attn_implementation": self.attn_implementation, "precision": self.precision,
                       "device": self.device.type, "packing": self.packing, "world_size": self.world}
            reporter.write_runtime(runtime)
            threads = follow_threads(torch.set_num_threads, log)  # the share of the cores other sftflow runs leave
            if selection is not None and selection.needs_start and step == 0:
                # the start's check (step 0): the guards' origin, and the candidate that ships when no
                # trained check is eligible and better; redone by a resume from before the first checkpoint
                self._observe(selection, 0, self.validate())
            while step < self.total_steps and (selection is None or selection.stopped_at is None):
                t0 = time.perf_counter()
                batch_idx = self.sampler.global_batch(pos)
                stats = self.forward_backward(batch_idx)
                grad_norm, lr = self.optimizer_step()
                pos = self.sampler.advance(pos, len(batch_idx))
                step += 1
                row = reporter.step_row(step, epochs_done(pos.epoch, pos.consumed, self.sampler.n), stats,
                                        grad_norm, lr, time.perf_counter() - t0, self.world)
                if (run.val_check_interval > 0 and step % run.val_check_interval == 0) or step == self.total_steps:
                    row.update(self.validate())
                    if selection is not None:
                        self._observe(selection, step, row)
                reporter.report(row)
                # the step early stopping ends at is the last: saved like the budget's last, so a
                # resume from it exports at once instead of training on
                stopping = selection is not None and selection.stopped_at == step
                if self.checkpointer.due(step, self.total_steps) or stopping:
                    self.checkpointer.save(step, pos, self.model, self.optimizer, self.scheduler, self.world,
                                           self.total_steps, None if selection is None else selection.state_dict())
                threads.poll()
            reporter.close()
            if selection is not None:
                self._ship(selection, step, runtime, reporter)
            self.export()
            dist.barrier()
            failed = False
        finally:
            if reporter is not None:
                reporter.close()
            _close_process_group(failed)

    def _selection(self) -> BestCheck | None:
        """`runner`'s early stopping and best-checkpoint rule with the resumed checkpoint's state;
        None when neither is on."""
        run = self.cfg.runner
        selection = BestCheck.from_runner(run)
        if selection is None:
            return None
        if self.val_ds is None or len(self.val_ds) == 0:
            raise ConfigError("runner.early_stopping_patience and runner.load_best_model_at_end need a validation "
                              "set: data.val_data_paths or data.val_fraction")
        selection.load_state_dict(self.checkpointer.state.get("selection"))
        if selection.needs_start and selection.start is None and self.checkpointer.state:
            raise ConfigError("runner.best_model_guard: the resumed checkpoint holds no start values (the step-0 "
                              "check the guards are bounded by); runner.resume=never starts afresh")
        every = run.val_check_interval
        log(f"validation every {every} step{'s' if every > 1 else ''} watches {selection.metric}"
            + (f" (ties broken by {selection.tie})" if selection.tie else "") + ": "
            + (f"early stopping after {selection.patience} checks without an improvement above "
               f"{run.early_stopping_threshold:g}" if selection.patience else "no early stopping")
            + ("; the best check's weights ship" if selection.load_best else "; the last step's weights ship")
            + ("" if not selection.guards else ", among the checks that keep " + " and ".join(
                f"{k} within {d:g} of the start's (step 0)" for k, d in selection.guards))
            + (f" (resumed: {selection.checks} checks, best {selection.metric} {selection.best:.6g} at step "
               f"{selection.best_step})" if selection.best_step is not None else ""))
        stale = stale_train_validation(self.cfg)
        if stale:
            log(stale)
        return selection

    def _ship(self, selection: BestCheck, step: int, runtime: dict, reporter: Reporter) -> None:
        """Loads the best check's weights when they ship (the last step's too when it was the best: the
        load is exact and frees the other copies), and says which step ships in train.log and runtime.json."""
        shipped = selection.shipped_step(step)
        if selection.load_best and selection.best_step is not None:
            self.checkpointer.load_best(shipped, self.model)
        log(selection.summary(step, self.total_steps))
        reporter.write_runtime({**runtime, **selection.report(step)})

    def export(self) -> None:
        """`out/model`: the trained model gathered to rank 0 (export.export_model). Every rank calls it."""
        export_model(self.model, self.cfg, self.spec.model_path, self.out, self.rank, self.tokenizer)


def _close_process_group(failed: bool) -> None:
    """Destroys the process group, if one is up. After a failure NCCL's is aborted instead: a
    destroy waits for collectives the other ranks may never join."""
    if not dist.is_initialized():
        return
    if failed and dist.get_backend() == "nccl":
        from torch.distributed.distributed_c10d import _abort_process_group
        _abort_process_group()
    else:
        dist.destroy_process_group()


def load_worker_class(path: str | None) -> type[SFTWorker]:
    """`actor.worker`, checked against the worker contract (runtime/contract.py); a ConfigError
    naming the key. Importing it also registers any model types its module registers."""
    if not path:
        return SFTWorker
    cls = import_object(path, "actor.worker")
    if not (isinstance(cls, type) and issubclass(cls, SFTWorker)):
        raise ConfigError(f"actor.worker='{path}' is not a subclass of stages.runtime.worker.SFTWorker")
    check_worker_class(cls, SFTWorker)
    return cls


def check_worker_config(cfg: SFTConfig) -> type[SFTWorker]:
    """Before torchrun starts (planning calls it): the worker class imports and keeps the contract,
    and the model type is registered or imports."""
    cls = load_worker_class(cfg.actor.worker)
    try:
        get_model_builder(cfg.actor.model.model_type)
    except UnknownModelType as e:
        raise ConfigError(str(e)) from None
    return cls


def load_worker(spec_path: str) -> SFTWorker:
    """A rank's worker for the `spec.json` torchrun was given (`python -m stages.train <spec.json>`),
    its class checked before any process group starts."""
    spec = WorkerSpec.read(spec_path)
    return load_worker_class(spec.config.actor.worker)(spec)
