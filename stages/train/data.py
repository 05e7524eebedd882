"""Samples -> global batches -> this rank's micro-batches.

The data position is `(epoch, consumed)`: how many samples of the epoch's permutation the
finished global steps have used, counted globally. It does not depend on world size, and
resuming from it is O(1): the epoch's permutation is a pure function of (seed, epoch).

A global step takes the next `global_batch_size` samples of the permutation (the last step
of an epoch takes what is left, never samples of the next epoch). Rank r takes every
world-th of them; its share is cut into `micro_batch_size` micro-batches. Every rank runs
the same number of micro-batches (FSDP's collectives need it): short ranks get empty ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

IGNORE_INDEX = -100


@dataclass
class DataPosition:
    epoch: int = 0
    consumed: int = 0

    def to_dict(self) -> dict:
        return {"epoch": self.epoch, "consumed": self.consumed}


class SFTDataset:
    """Prepared Arrow shards, memory-mapped; rows are read on demand."""

    def __init__(self, folder):
        from stages.prepare.shards import read_shards
        self.table = read_shards(folder, ["input_ids", "loss_mask", "length"])
        self.lengths = np.asarray(self.table.column("length").to_numpy(), dtype=np.int64)
        self._ids = self.table.column("input_ids")
        self._mask = self.table.column("loss_mask")
        self.trainable = self._trainable_counts()

    def _trainable_counts(self) -> np.ndarray:
        """Per-row sum of loss_mask, vectorized over the flat values of each chunk."""
        out = []
        for chunk in self._mask.chunks:
            offsets = chunk.offsets.to_numpy()
            flat = np.asarray(chunk.values.to_numpy(zero_copy_only=False), dtype=np.int64)
            csum = np.concatenate([[0], np.cumsum(flat)])
            out.append(csum[offsets[1:]] - csum[offsets[:-1]])
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self._ids[int(i)].values.to_numpy(), "loss_mask": self._mask[int(i)].values.to_numpy()}


class GlobalBatchSampler:
    def __init__(self, n: int, global_batch_size: int, micro_batch_size: int, world_size: int, seed: int):
        self.n, self.gbs, self.mbs, self.world, self.seed = n, global_batch_size, micro_batch_size, world_size, seed
        self.accum = global_batch_size // (micro_batch_size * world_size)
        self._perm_epoch, self._perm = -1, None

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self.n / self.gbs)

    def permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.n)
            self._perm_epoch = epoch
        return self._perm

    def global_batch(self, pos: DataPosition) -> np.ndarray:
        return self.permutation(pos.epoch)[pos.consumed: pos.consumed + self.gbs]

    def advance(self, pos: DataPosition, taken: int) -> DataPosition:
        consumed = pos.consumed + taken
        return DataPosition(pos.epoch + 1, 0) if consumed >= self.n else DataPosition(pos.epoch, consumed)

    def rank_micro_batches(self, batch: np.ndarray, rank: int) -> list[np.ndarray]:
        mine = batch[rank:: self.world]
        return [mine[k * self.mbs: (k + 1) * self.mbs] for k in range(self.accum)]


def collate_padded(samples: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded batch; `labels` are input_ids where trainable, else IGNORE_INDEX (not shifted)."""
    longest = max(len(s["input_ids"]) for s in samples)
    ids = torch.full((len(samples), longest), pad_id, dtype=torch.long)
    labels = torch.full((len(samples), longest), IGNORE_INDEX, dtype=torch.long)
    attn = torch.zeros((len(samples), longest), dtype=torch.long)
    for b, s in enumerate(samples):
        x = torch.tensor(s["input_ids"], dtype=torch.long)
        m = torch.tensor(s["loss_mask"], dtype=torch.bool)
        ids[b, : len(x)] = x
        labels[b, : len(x)] = torch.where(m, x, IGNORE_INDEX)
        attn[b, : len(x)] = 1
    return {"input_ids": ids, "attention_mask": attn, "labels": labels}
