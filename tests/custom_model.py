"""A non-Hugging-Face model plugged in the way docs/adding-a-model.md describes: a model type
(registered by name with `@register_model_type`, or named by its import path
`custom_model:build_tiny_mlp`) plus a worker subclass with its own data and outputs."""

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from stages.runtime.model_types import register_model_type
from stages.runtime.worker import SFTWorker, TrainOutput

N_CLASSES, DIM = 4, 8


@register_model_type("tiny_mlp")
def build_tiny_mlp(model_cfg: dict, weights_path: str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, 64), nn.ReLU(), nn.Linear(64, N_CLASSES))


class Blobs:
    """Gaussian blobs in 8-D; the label is the blob. One 'token' of loss per sample."""

    def __init__(self, n: int, seed: int):
        centers = np.random.default_rng(0).normal(size=(N_CLASSES, DIM)) * 3
        rng = np.random.default_rng(seed)
        self.y = rng.integers(0, N_CLASSES, n)
        self.x = (centers[self.y] + rng.normal(size=(n, DIM))).astype(np.float32)
        self.lengths = np.ones(n, dtype=np.int64)
        self.trainable = np.ones(n, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "y": int(self.y[i])}


class MLPWorker(SFTWorker):
    def build_dataloader(self, data_paths, eval_dataset: bool = False):
        return Blobs(96, seed=1) if eval_dataset else Blobs(512, seed=2)

    def collate(self, samples: list[dict]) -> dict:
        return {"x": torch.from_numpy(np.stack([s["x"] for s in samples])).to(self.device),
                "y": torch.tensor([s["y"] for s in samples], device=self.device)}

    def get_train_model_output(self, batch: dict) -> TrainOutput:
        logits = self.model(batch["x"])
        return TrainOutput(loss_sum=F.cross_entropy(logits, batch["y"], reduction="sum"), n_tokens=len(batch["y"]))

    def get_eval_model_output(self, batch: dict) -> dict:
        logits = self.model(batch["x"])
        return {"loss_sum": F.cross_entropy(logits, batch["y"], reduction="sum"), "n_tokens": len(batch["y"]),
                "correct": int((logits.argmax(-1) == batch["y"]).sum()), "total": len(batch["y"])}


class BrokenWorker(MLPWorker):
    """The common mistake: the batch lacks a key the outputs read."""

    def collate(self, samples: list[dict]) -> dict:
        return {"x": torch.from_numpy(np.stack([s["x"] for s in samples])).to(self.device)}


class RefusingRankOne(MLPWorker):
    """Rank 1 stops with one of the project's errors once set up; rank 0 goes on until it is stopped."""

    def setup(self) -> None:
        super().setup()
        if self.rank == 1:
            from stages.core.errors import ConfigError
            raise ConfigError("custom.key: rank one refuses")
