"""Samples -> global batches -> this rank's micro-batches.

The data position is `(epoch, consumed)`: how many samples of the epoch's permutation the
finished global steps have used, counted globally. It does not depend on world size, and
resuming from it is O(1): the epoch's permutation is a pure function of (seed, epoch).

A global step takes the next `global_batch_size` samples of the permutation; the last step
of an epoch takes what is left (never samples of the next epoch, never a stale batch).
The step's samples are dealt to ranks balanced by token count (longest first, snake
order), so every rank gets the same number of samples and nearly the same tokens. A
rank's share is cut into micro-batches of `micro_batch_size` samples, or filled up to
`max_tokens_per_micro_batch` tokens. Every rank runs the same number of micro-batches
(FSDP's collectives need it): the orchestration pads short ranks with empty ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from stages.chatdata.shards import read_shards

from .loss import IGNORE_INDEX
from .mixture import epoch_samples


def pad_token_id(tok) -> int:
    """The id batches are padded with, decided once for training and evaluation: the tokenizer's pad
    token, else its eos (Llama 3 and Mistral have no pad token), else 0. Pads are masked out of
    attention and loss, so only a valid id matters, not which."""
    for token_id in (tok.pad_token_id, tok.eos_token_id):
        if token_id is not None:
            return int(token_id)
    return 0


@dataclass
class DataPosition:
    epoch: int = 0
    consumed: int = 0

    def to_dict(self) -> dict:
        return {"epoch": self.epoch, "consumed": self.consumed}


class SFTDataset:
    """Prepared Arrow shards, memory-mapped; rows are read on demand.

    The worker needs three things of any dataset: `len()`, `ds[i]`, and two int arrays,
    `lengths` (tokens per sample, for balancing) and `trainable` (loss-bearing tokens per
    sample, for exact loss weighting)."""

    def __init__(self, folder):
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


def balanced_shares(indices: np.ndarray, lengths: np.ndarray, world: int) -> list[np.ndarray]:
    """Deal samples to ranks longest-first in snake order (0,1,..,w-1,w-1,..,0,...)."""
    order = indices[np.argsort(-lengths[indices], kind="stable")]
    shares: list[list[int]] = [[] for _ in range(world)]
    for k, idx in enumerate(order):
        lap, pos = divmod(k, world)
        shares[pos if lap % 2 == 0 else world - 1 - pos].append(int(idx))
    return [np.asarray(s, dtype=np.int64) for s in shares]


def split_micro_batches(share: np.ndarray, lengths: np.ndarray, micro_batch_size: int, max_tokens: int,
                        interleave: bool = False) -> list[np.ndarray]:
    """Cuts a longest-first share into micro-batches: contiguous runs (similar lengths, least
    padding) or, with `interleave`, every n-th sample (equal token totals: packed attention
    costs the square of a row's length, so no row should hold all the long samples)."""
    if max_tokens <= 0:
        if interleave:
            n = math.ceil(len(share) / micro_batch_size)
            return [share[k::n] for k in range(n)]
        return [share[i:i + micro_batch_size] for i in range(0, len(share), micro_batch_size)]
    out, cur, tokens = [], [], 0
    for idx in share:
        n = int(lengths[idx])
        if cur and tokens + n > max_tokens:
            out.append(np.asarray(cur))
            cur, tokens = [], 0
        cur.append(int(idx))
        tokens += n
    if cur:
        out.append(np.asarray(cur))
    return out


class GlobalBatchSampler:
    """`mixture` = (weights, sizes) or (weights, sizes, samples per epoch) of the sources the dataset's rows
    hold in order (stages/runtime/mixture.py): an epoch is then the mixture's samples instead of a
    permutation of every row."""

    def __init__(self, lengths: np.ndarray, global_batch_size: int, micro_batch_size: int, world_size: int,
                 seed: int, max_tokens_per_micro_batch: int = 0, interleave: bool = False,
                 mixture: tuple | None = None):
        self.lengths = np.asarray(lengths)
        self.mixture = mixture
        if mixture is not None and sum(mixture[1]) != len(self.lengths):
            raise ValueError(f"the mixture's sources hold {sum(mixture[1])} rows, the dataset {len(self.lengths)}")
        self.n = len(self.lengths)  # samples per epoch
        if mixture is not None and len(mixture) > 2 and mixture[2]:
            self.n = int(mixture[2])
        self.gbs, self.mbs, self.world, self.seed = global_batch_size, micro_batch_size, world_size, seed
        self.max_tokens = max_tokens_per_micro_batch
        self.interleave = interleave
        self.accum = global_batch_size // (micro_batch_size * world_size)
        self._perm_epoch, self._perm = -1, None

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self.n / self.gbs)

    def permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            self._perm = (np.random.default_rng([self.seed, epoch]).permutation(len(self.lengths))
                          if self.mixture is None
                          else epoch_samples(self.seed, epoch, *self.mixture))
            self._perm_epoch = epoch
        return self._perm

    def global_batch(self, pos: DataPosition) -> np.ndarray:
        return self.permutation(pos.epoch)[pos.consumed: pos.consumed + self.gbs]

    def advance(self, pos: DataPosition, taken: int) -> DataPosition:
        consumed = pos.consumed + taken
        return DataPosition(pos.epoch + 1, 0) if consumed >= self.n else DataPosition(pos.epoch, consumed)

    def rank_share(self, batch: np.ndarray, rank: int) -> np.ndarray:
        return balanced_shares(batch, self.lengths, self.world)[rank]

    def rank_micro_batches(self, batch: np.ndarray, rank: int) -> list[np.ndarray]:
        return split_micro_batches(self.rank_share(batch, rank), self.lengths, self.mbs, self.max_tokens,
                                   self.interleave)


def sample_of_trained(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """For each trained position of a collated batch (labels[:, 1:] not IGNORE_INDEX, row-major: the
    order `loss.model_loss` reports its `hits` in) the index of the sample it belongs to: the row of a
    padded batch; within a packed row, where `position_ids` restart at 0."""
    labels = batch["labels"]
    rows = torch.arange(labels.size(0), device=labels.device)[:, None].expand_as(labels)
    if "position_ids" in batch:  # packed: one row, samples told apart by their position restart
        rows = rows * labels.size(1) + (batch["position_ids"] == 0).cumsum(-1) - 1
    return rows[:, 1:][labels[:, 1:] != IGNORE_INDEX]


def _labels(s: dict) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.tensor(s["input_ids"], dtype=torch.long)
    m = torch.tensor(s["loss_mask"], dtype=torch.bool)
    return x, torch.where(m, x, IGNORE_INDEX)


def collate_padded(samples: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded batch; `labels` are input_ids where trainable, else IGNORE_INDEX (not shifted)."""
    longest = max(len(s["input_ids"]) for s in samples)
    ids = torch.full((len(samples), longest), pad_id, dtype=torch.long)
    labels = torch.full((len(samples), longest), IGNORE_INDEX, dtype=torch.long)
    attn = torch.zeros((len(samples), longest), dtype=torch.long)
    for b, s in enumerate(samples):
        x, y = _labels(s)
        ids[b, : len(x)], labels[b, : len(x)], attn[b, : len(x)] = x, y, 1
    out = {"input_ids": ids, "attention_mask": attn, "labels": labels}
    if "kl" in samples[0]:  # which rows the KL to the starting model holds (a warm start's earlier sources)
        out["kl_mask"] = torch.tensor([s["kl"] for s in samples], dtype=torch.bool)[:, None].expand_as(labels).clone()
    return out


def collate_packed(samples: list[dict]) -> dict[str, torch.Tensor]:
    """One row of concatenated samples; `position_ids` restart at 0 per sample, which is how
    transformers finds the sample boundaries (no attention across them). Each sample's first
    label is ignored so no token is ever predicted from the previous sample."""
    ids, labels, pos = [], [], []
    for s in samples:
        x, y = _labels(s)
        y[0] = IGNORE_INDEX
        ids.append(x)
        labels.append(y)
        pos.append(torch.arange(len(x)))
    out = {"input_ids": torch.cat(ids)[None], "labels": torch.cat(labels)[None], "position_ids": torch.cat(pos)[None]}
    if "kl" in samples[0]:  # as collate_padded
        out["kl_mask"] = torch.cat([torch.full((len(x),), bool(s["kl"])) for x, s in zip(ids, samples)])[None]
    return out
