"""The SFT worker: one process per rank under torchrun.

    python -m torch.distributed.run ... -m stages.train.worker <spec.json>

`SFTWorker` owns the loop: process group, FSDP2 sharding, gradient accumulation, clipping,
LR schedule, validation, checkpoints, metrics and export. A subclass adapts it to another
model or data layout by overriding `build_dataloader`, `get_train_model_output` and
`get_eval_model_output` (the RLinf recipe).

Loss of a global step = (sum of token cross-entropy over all micro-batches on all ranks)
/ (trainable tokens of the whole global step, all-reduced before backward). FSDP averages
gradients over ranks, so each rank scales its loss by world size to undo that average.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from stages.config import SFTConfig
from stages.train import checkpoint as ckpt
from stages.train.data import IGNORE_INDEX, DataPosition, GlobalBatchSampler, SFTDataset, collate_padded
from stages.train.registry import fsdp_units, get_model_builder


def log(msg: str) -> None:
    if dist.get_rank() == 0:
        print(msg, flush=True)


def lr_lambda(total_steps: int, warmup: float, scheduler: str, min_ratio: float):
    warm = int(warmup) if warmup >= 1 else math.ceil(warmup * total_steps)

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / (warm + 1)
        if scheduler == "constant":
            return 1.0
        progress = min(1.0, (step - warm) / max(1, total_steps - warm))
        decay = 0.5 * (1 + math.cos(math.pi * progress)) if scheduler == "cosine" else 1 - progress
        return min_ratio + (1 - min_ratio) * decay
    return f


class SFTWorker:
    def __init__(self, spec: dict):
        self.spec = spec
        self.cfg = SFTConfig.model_validate(spec["config"])
        self.out = Path(spec["out_dir"])
        self.ckpt_dir = self.out / "checkpoints"

    # ------------------------------------------------------------------ setup
    def init_distributed(self) -> None:
        self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        precision = self.cfg.actor.precision
        if precision == "auto":
            precision = "bf16" if self.device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
        self.precision = precision

    def build_model(self) -> torch.nn.Module:
        builder = get_model_builder(self.cfg.actor.model.model_type)
        torch.manual_seed(self.cfg.runner.seed)
        model = builder(self.cfg.actor.model.model_dump(), self.spec["model_path"])
        model.to(self.device)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if self.precision == "bf16" else MixedPrecisionPolicy()
        for unit in fsdp_units(model):
            fully_shard(unit, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        return model

    def build_dataloader(self, data_paths: str, eval_dataset: bool = False) -> SFTDataset:
        return SFTDataset(data_paths)

    def load_tokenizer_info(self) -> None:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(self.spec["model_path"], trust_remote_code=self.cfg.actor.model.trust_remote_code)
        self.tokenizer = tok
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)

    # ------------------------------------------------------------------ model outputs
    def collate(self, samples: list[dict]) -> dict[str, torch.Tensor]:
        return {k: v.to(self.device) for k, v in collate_padded(samples, self.pad_id).items()}

    def _token_loss_sum(self, batch: dict) -> tuple[torch.Tensor, int]:
        logits = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
        labels = batch["labels"][:, 1:]
        loss_sum = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.size(-1)), labels.reshape(-1),
                                   ignore_index=IGNORE_INDEX, reduction="sum")
        return loss_sum, int((labels != IGNORE_INDEX).sum())

    def get_train_model_output(self, batch: dict):
        """(sum of token losses, number of trainable tokens) of one micro-batch."""
        return self._token_loss_sum(batch)

    def get_eval_model_output(self, batch: dict):
        return self._token_loss_sum(batch)

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
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        tokens = torch.zeros((), dtype=torch.float64, device=self.device)
        with torch.no_grad():
            for k in range(n_batches):
                idx = mine[k * mbs: (k + 1) * mbs]
                batch = self.collate([self.val_ds[i] for i in (idx or [0])])
                ls, nt = self.get_eval_model_output(batch)
                if idx:
                    loss_sum += ls.double()
                    tokens += nt
        stats = torch.stack([loss_sum, tokens])
        dist.all_reduce(stats)
        self.model.train()
        val_loss = (stats[0] / stats[1].clamp(min=1)).item()
        return {"val_loss": val_loss, "val_tokens": int(stats[1].item())}

    def trainer_state(self, step: int, pos: DataPosition) -> dict:
        return {"step": step, "data_position": pos.to_dict(), "scheduler": self.scheduler.state_dict(),
                "world_size": self.world, "total_steps": self.total_steps}

    def maybe_resume(self) -> tuple[int, DataPosition]:
        resume = self.cfg.runner.resume
        if resume == "never":
            return 0, DataPosition()
        if resume == "auto":
            found = ckpt.list_checkpoints(self.ckpt_dir, warn=log)
            if not found:
                return 0, DataPosition()
            path = found[-1]
        else:
            path = Path(resume)
            if not (path / ckpt.COMPLETE).is_file():
                raise SystemExit(f"runner.resume: '{path}' is not a complete checkpoint (no {ckpt.COMPLETE})")
        state, rng_ok = ckpt.load_checkpoint(path, self.model, self.optimizer)
        self.scheduler.load_state_dict(state["scheduler"])
        pos = DataPosition(**state["data_position"])
        log(f"resumed from {path} at step {state['step']} (epoch {pos.epoch}, {pos.consumed} samples into it)"
            + ("" if rng_ok else "; world size changed, RNG streams start fresh"))
        return state["step"], pos

    # ------------------------------------------------------------------ main loop
    def setup(self) -> None:
        self.init_distributed()
        self.load_tokenizer_info()
        run, actor = self.cfg.runner, self.cfg.actor
        self.train_ds = self.build_dataloader(self.spec["train_dir"])
        self.val_ds = self.build_dataloader(self.spec["val_dir"], eval_dataset=True) if self.spec.get("val_dir") else None
        self.sampler = GlobalBatchSampler(len(self.train_ds), actor.global_batch_size, actor.micro_batch_size, self.world, run.seed)
        steps_all_epochs = self.sampler.steps_per_epoch * run.max_epochs
        self.total_steps = min(run.max_steps, steps_all_epochs) if run.max_steps > 0 else steps_all_epochs
        self.model = self.build_model()
        self.model.train()
        o = actor.optim
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=o.lr, betas=o.betas, weight_decay=o.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(self.total_steps, o.warmup, o.scheduler, o.min_lr_ratio))

    def forward_backward(self, batch_idx) -> dict:
        """Accumulates the gradient of one global batch; loss normalized by its total trainable tokens."""
        mine = self.sampler.rank_micro_batches(batch_idx, self.rank)
        share = batch_idx[self.rank::self.world]
        counts = torch.tensor([float(self.train_ds.trainable[share].sum()), float(self.train_ds.lengths[share].sum())],
                              dtype=torch.float64, device=self.device)
        dist.all_reduce(counts)
        total_trainable = max(counts[0].item(), 1.0)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for k, idx in enumerate(mine):
            batch, real = self.micro_batch(idx)
            self.model.set_requires_gradient_sync(k == len(mine) - 1)
            ls, _ = self.get_train_model_output(batch)
            ls = ls if real else ls * 0.0
            (ls * self.world / total_trainable).backward()
            loss_sum += ls.detach().double()
        dist.all_reduce(loss_sum)
        return {"loss": loss_sum.item() / total_trainable, "trainable_tokens": int(counts[0].item()),
                "tokens": int(counts[1].item())}

    def fit(self) -> None:
        self.setup()
        run = self.cfg.runner
        step, pos = self.maybe_resume()
        metrics_path = self.out / "metrics.jsonl"
        if self.rank == 0:
            self._truncate_metrics(metrics_path, step)
        metrics_f = open(metrics_path, "a") if self.rank == 0 else None
        log(f"training {self.total_steps} steps: {len(self.train_ds)} samples, world {self.world}, "
            f"accum {self.sampler.accum}, precision {self.precision}, device {self.device.type}")
        while step < self.total_steps:
            t0 = time.perf_counter()
            batch_idx = self.sampler.global_batch(pos)
            row = self.forward_backward(batch_idx)
            grad_norm = self._clip()
            self.optimizer.step()
            lr = self.scheduler.get_last_lr()[0]
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            pos = self.sampler.advance(pos, len(batch_idx))
            step += 1
            dt = time.perf_counter() - t0
            row = {"step": step, "epoch": round(pos.epoch + pos.consumed / len(self.train_ds), 4), **row,
                   "grad_norm": grad_norm, "lr": lr, "tokens_per_s": row["tokens"] / dt, "step_time": dt}
            if (run.val_check_interval > 0 and step % run.val_check_interval == 0) or step == self.total_steps:
                row.update(self.validate())
            if metrics_f:
                metrics_f.write(json.dumps(row) + "\n")
                metrics_f.flush()
            if step % run.log_interval == 0 or step == self.total_steps:
                extra = f" val_loss {row['val_loss']:.4f}" if "val_loss" in row else ""
                log(f"step {step}/{self.total_steps} epoch {row['epoch']:.2f} loss {row['loss']:.4f} "
                    f"grad_norm {grad_norm:.3f} lr {lr:.2e} tok/s {row['tokens_per_s']:.0f}{extra}")
            if (run.save_interval > 0 and step % run.save_interval == 0) or step == self.total_steps:
                ckpt.save_checkpoint(self.ckpt_dir, step, self.model, self.optimizer, self.trainer_state(step, pos),
                                     keep=run.keep_checkpoints)
        if metrics_f:
            metrics_f.close()
        self.export()
        dist.barrier()
        dist.destroy_process_group()

    def _clip(self) -> float:
        max_norm = self.cfg.actor.optim.clip_grad
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        return float(norm)

    @staticmethod
    def _truncate_metrics(path: Path, step: int) -> None:
        """On resume, drop lines logged after the checkpoint so every step appears exactly once."""
        if not path.exists():
            return
        keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
        path.write_text("".join(line + "\n" for line in keep))

    def export(self) -> None:
        """Full state dict gathered to rank 0 on CPU, saved as a Hugging Face folder."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank != 0:
            return
        from transformers import AutoConfig, AutoModelForCausalLM
        src = self.spec["model_path"]
        config = AutoConfig.from_pretrained(src, trust_remote_code=self.cfg.actor.model.trust_remote_code)
        with torch.device("cpu"):
            plain = AutoModelForCausalLM.from_config(config, trust_remote_code=self.cfg.actor.model.trust_remote_code,
                                                     dtype=torch.float32)
        missing, unexpected = plain.load_state_dict(full, strict=False)
        tied = set(getattr(plain, "_tied_weights_keys", None) or [])
        if unexpected or [k for k in missing if k not in tied]:
            raise RuntimeError(f"export: state dict mismatch missing={missing} unexpected={unexpected}")
        plain.tie_weights()
        dest = self.out / "model"
        plain.save_pretrained(dest, safe_serialization=True)
        self.tokenizer.save_pretrained(dest)
        gen = Path(src) / "generation_config.json"
        if gen.is_file():
            shutil.copy(gen, dest / "generation_config.json")
        log(f"exported Hugging Face model to {dest}")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    spec = json.loads(Path(argv[0]).read_text())
    worker_cls = SFTWorker
    if spec.get("worker"):
        import importlib
        mod, _, name = spec["worker"].partition(":")
        worker_cls = getattr(importlib.import_module(mod), name)
    worker_cls(spec).fit()


if __name__ == "__main__":
    main()
