"""A weighted mixture's epochs: which rows of which source each epoch holds.

Contract (docs/data.md, "Mixtures"): an epoch has as many samples as the sources hold together;
source i gets `quotas(...)[i]` of them, its weight's share (largest remainders, so the quotas add up
exactly). A source is read as an endless stream of its own shuffles, and epoch e takes the stream's
next quota: a source above its natural share is upsampled (its rows repeat, each pass in a new
order), one below it is downsampled (a different subset every epoch, every row before any repeats).
The epoch's samples are then shuffled together. A warm start that rehearses sizes the epoch by its
new rows instead (`new_data_epoch`: `total`), so a day's training follows what is new, not the
history. Everything is a pure function of (seed, epoch, weights, sizes, total): resuming at (epoch,
consumed) is O(1) and does not depend on the world size. numpy only, so planning and `sftflow
show` can compute the counts without torch.
"""

from __future__ import annotations

import hashlib

import numpy as np

# keeps a source's shuffles apart from the epoch's own (rng([seed, epoch])) and from other sources'
_SOURCE_STREAM = 0x5EED


def quotas(weights: list[float], sizes: list[int], total: int | None = None) -> list[int]:
    """Samples per epoch of each source: `total` (default sum(sizes)) split by weight, largest remainders first."""
    total = int(sum(sizes)) if total is None else int(total)
    shares = np.asarray(weights, dtype=np.float64) / float(sum(weights)) * total
    out = np.floor(shares).astype(np.int64)
    for i in np.argsort(-(shares - out), kind="stable")[: total - int(out.sum())]:
        out[i] += 1
    return [int(x) for x in out]


def _stream(seed: int, source: int, size: int, start: int, count: int) -> np.ndarray:
    """Items [start, start + count) of the source's endless stream of shuffles of range(size)."""
    out, first, last = [], start // size, (start + count - 1) // size
    for block in range(first, last + 1):
        perm = np.random.default_rng([seed, _SOURCE_STREAM, source, block]).permutation(size)
        lo = max(start - block * size, 0)
        hi = min(start + count - block * size, size)
        out.append(perm[lo:hi])
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


def new_data_epoch(weights: list[float], sizes: list[int], passes: float) -> int:
    """An epoch's samples when it is sized by the new rows (source 0, `train`): each new row `passes`
    times, the other sources filling their weights' shares around them."""
    return max(1, round(passes * sizes[0] * float(sum(weights)) / float(weights[0])))


def epoch_samples(seed: int, epoch: int, weights: list[float], sizes: list[int],
                  total: int | None = None) -> np.ndarray:
    """Row indices of epoch `epoch` into the concatenated sources (source i's rows start after the
    sizes before it), shuffled."""
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    parts = [offsets[i] + _stream(seed, i, size, epoch * k, k)
             for i, (size, k) in enumerate(zip(sizes, quotas(weights, sizes, total))) if k > 0]
    picks = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    return picks[np.random.default_rng([seed, epoch]).permutation(len(picks))]


def describe(names: list[str], weights: list[float], sizes: list[int], total: int | None = None) -> list[dict]:
    """Per source: rows, weight, samples per epoch, and how often a row is seen per epoch."""
    return [{"source": n, "rows": s, "weight": w, "per_epoch": k, "passes": round(k / s, 3) if s else 0.0}
            for n, w, s, k in zip(names, weights, sizes, quotas(weights, sizes, total))]


def summary_line(rows: list[dict]) -> str:
    """One line for train.log and `sftflow show`."""
    total = sum(r["per_epoch"] for r in rows)
    parts = [f"{r['source']} {r['per_epoch']} ({100 * r['per_epoch'] / max(total, 1):.0f}%, "
             f"{r['rows']} rows x{r['passes']:g})" for r in rows]
    return f"mixture: {total} samples per epoch: " + ", ".join(parts)


def held_out_rule(source: str, val_fraction: float, val_files: bool) -> str:
    """How a source's validation rows are chosen (docs/data.md, "Validation by source"): the `train`
    source's are data.val_data_paths when given; every other source's, and train's without them, are
    the rows whose content hash falls in data.val_fraction."""
    if source == "train" and val_files:
        return "data.val_data_paths"
    return f"{val_fraction:g} by content hash" if val_fraction > 0 else "none held out"


def held_out_line(val_mix: list[dict], val_fraction: float, val_files: bool) -> str:
    """One line for train.log and `sftflow show`: the held-out rows of each mixture source and how they
    were chosen."""
    total = sum(m["rows"] for m in val_mix)
    parts = [f"{m['source']} {m['rows']} ({held_out_rule(m['source'], val_fraction, val_files)})" for m in val_mix]
    return f"validation: {total} held-out rows, scored per source: " + ", ".join(parts)


def held_out(content_key: bytes, fraction: float) -> bool:
    """Whether a row is held out for validation: the first 8 bytes of the BLAKE2b digest of its content
    (chatdata.readers.row_content_key: a JSONL line's stripped bytes) fall below fraction x 2^64. By
    content, so a row stays on its side when rows are added, removed or reordered, and a file rehearsed
    later holds out the rows it held out the day it was new (at the same fraction)."""
    h = hashlib.blake2b(content_key, digest_size=8).digest()
    return int.from_bytes(h, "big") < fraction * 2**64

