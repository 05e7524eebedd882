"""What a training run reports, from rank 0: one `metrics.jsonl` row per optimizer step (cut back
to the resumed step first, so every step appears once), the same rows to the run's MLflow run
while training runs, a progress bar on a terminal or log lines under the flow, and `runtime.json`.
Every rank makes a `Reporter`; only rank 0's writes anything."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from stages.tracking.live import RankZeroMetrics, read_metrics_file

from .distributed import log

METRICS_FILE = "metrics.jsonl"
RUNTIME_FILE = "runtime.json"  # the settings `auto` resolved to, written by rank 0 in the output folder
# Dense bf16 peak FLOP/s per device, for the MFU estimate (unknown devices report none).
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "L4": 121e12}


def epochs_done(epoch: int, consumed: int, samples_per_epoch: int) -> float:
    """The epoch a step's row reports: whole epochs and the share of the current one. An epoch is the
    sampler's (`GlobalBatchSampler.n`): a warm start's mixture sizes it by the new rows, not the prepared
    rows it draws from, so dividing by those made the epoch jump (0.35 -> 1.00) at the boundary."""
    return round(epoch + consumed / samples_per_epoch, 4)


def samples_said(samples_per_epoch: int, rows: int) -> str:
    """train.log's count of what an epoch trains: the epoch's samples, and the prepared rows when a
    mixture's epoch is another number."""
    shown = f"{samples_per_epoch} samples an epoch"
    return shown if samples_per_epoch == rows else f"{shown} (drawn from {rows} prepared rows)"


def truncate_metrics(path: Path, step: int) -> None:
    """On resume, drop lines logged after the checkpoint so every step appears exactly once."""
    if not path.exists():
        return
    keep = [row for row in read_metrics_file(path) if row["step"] <= step]
    path.write_text("".join(json.dumps(row) + "\n" for row in keep))


class Reporter:
    """Rank 0's metrics file, live MLflow rows and progress display for one `fit`, from `start_step`
    (0, or the step resumed from) to `total_steps`; `close` (idempotent) closes all three."""

    def __init__(self, out: Path, rank: int, start_step: int, total_steps: int, log_interval: int,
                 live_after_seconds: float, flops_per_token: float, peak_flops: float | None):
        self.total_steps, self.log_interval = total_steps, log_interval
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
        self.out, self.rank = out, rank
        self.file = self.live = self.bar = None
        if rank != 0:
            return
        path = out / METRICS_FILE
        truncate_metrics(path, start_step)
        # with MLFLOW_RUN_ID (set by the train stage) rows also go to that MLflow run while training runs
        self.live = RankZeroMetrics(path, start_step, total_steps, live_after_seconds)
        self.file = open(path, "a")
        if sys.stderr.isatty():  # a live bar when a person watches a terminal; under the flow, log lines
            from tqdm import tqdm
            self.bar = tqdm(total=total_steps, initial=start_step, desc="train", dynamic_ncols=True)

    def write_runtime(self, runtime: dict) -> None:
        """What `auto` resolved to on this machine: the train stage logs it to MLflow."""
        if self.rank == 0:
            (self.out / RUNTIME_FILE).write_text(json.dumps(runtime))

    def step_row(self, step: int, epoch: float, stats: dict, grad_norm: float, lr: float, seconds: float,
                 world: int) -> dict:
        """The metrics row of an optimizer step: `stats` (forward_backward's) between the step's place
        and its optimizer numbers, then throughput (and MFU on a device of known peak)."""
        row = {"step": step, "epoch": epoch, **stats, "grad_norm": grad_norm, "lr": lr,
               "tokens_per_s": stats["tokens"] / seconds, "step_time": seconds}
        if self.peak_flops:
            row["mfu"] = self.flops_per_token * row["tokens_per_s"] / (self.peak_flops * world)
        return row

    def report(self, row: dict) -> None:
        step = row["step"]
        if self.file is not None:
            self.file.write(json.dumps(row) + "\n")
            self.file.flush()
        if self.live is not None:
            self.live.log(row)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{row['loss']:.4f}", tok_s=f"{row['tokens_per_s']:.0f}")
        elif step % self.log_interval == 0 or step == self.total_steps:
            extra = (f" kl {row['kl']:.4f}" if "kl" in row else "") + (
                f" val_loss {row['val_loss']:.4f}" if "val_loss" in row else "")
            log(f"step {step}/{self.total_steps} epoch {row['epoch']:.2f} loss {row['loss']:.4f} "
                f"grad_norm {row['grad_norm']:.3f} lr {row['lr']:.2e} tok/s {row['tokens_per_s']:.0f}{extra}")

    def close(self) -> None:
        bar, file, live = self.bar, self.file, self.live
        self.bar = self.file = self.live = None
        if bar is not None:
            bar.close()
        if file is not None:
            file.close()
        if live is not None:
            live.close()
