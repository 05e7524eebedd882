"""Arrow shards: the on-disk form of prepared samples.

One row = one conversation: `input_ids` (list<int32>), `loss_mask` (list<int8>, 1 on
trainable tokens: assistant replies and their end-of-turn marker), `length` (int32),
`source` ("file:line", "#k" appended for the k-th conversation of a multi-conversation row).
The val split also keeps `messages` (JSON) so evaluate can rebuild prompts and references.

Shards are Arrow IPC files written a record batch at a time, so prepare holds at most one
batch in memory whatever the dataset size, and the train stage memory-maps them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import numpy as np
import pyarrow as pa

SCHEMA = pa.schema([
    ("input_ids", pa.list_(pa.int32())),
    ("loss_mask", pa.list_(pa.int8())),
    ("length", pa.int32()),
    ("source", pa.string()),
    ("messages", pa.string()),
])
BATCH_ROWS = 1024


def _list_array(parts: list[np.ndarray], dtype) -> pa.Array:
    offsets = np.zeros(len(parts) + 1, dtype=np.int32)
    np.cumsum([len(p) for p in parts], out=offsets[1:])
    values = np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype=dtype)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))


class ShardWriter:
    """Streams rows into `shard-00000.arrow`, `shard-00001.arrow`, ... of at most `shard_rows` rows each."""

    def __init__(self, folder: Path, shard_rows: int = 50_000, batch_rows: int = BATCH_ROWS):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.shard_rows, self.batch_rows = shard_rows, min(batch_rows, shard_rows)
        self.files: list[str] = []
        self._buf: dict[str, list] = {k: [] for k in SCHEMA.names}
        self._sink = self._writer = None
        self._in_shard = 0

    def add(self, row: dict) -> None:
        for k in SCHEMA.names:
            self._buf[k].append(row.get(k))
        if len(self._buf["source"]) >= min(self.batch_rows, self.shard_rows - self._in_shard):
            self._write_batch()

    def _write_batch(self) -> None:
        n = len(self._buf["source"])
        if not n:
            return
        if self._writer is None:
            name = f"shard-{len(self.files):05d}.arrow"
            self._sink = pa.OSFile(str(self.folder / name), "wb")
            self._writer = pa.ipc.new_file(self._sink, SCHEMA)
            self.files.append(name)
        b = self._buf
        ids = [np.asarray(x, dtype=np.int32) for x in b["input_ids"]]
        batch = pa.record_batch([
            _list_array(ids, np.int32),
            _list_array([np.asarray(x, dtype=np.int8) for x in b["loss_mask"]], np.int8),
            pa.array([len(x) for x in ids], pa.int32()),
            pa.array(b["source"], pa.string()),
            pa.array(b["messages"], pa.string()),
        ], schema=SCHEMA)
        self._writer.write_batch(batch)
        self._buf = {k: [] for k in SCHEMA.names}
        self._in_shard += n
        if self._in_shard >= self.shard_rows:
            self._close_shard()

    def _close_shard(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._sink.close()
        self._writer = self._sink = None
        self._in_shard = 0

    def close(self) -> list[str]:
        self._write_batch()
        self._close_shard()
        if not self.files:  # an empty split still has one (empty) shard, so readers need no special case
            name = "shard-00000.arrow"
            with pa.OSFile(str(self.folder / name), "wb") as sink, pa.ipc.new_file(sink, SCHEMA):
                pass
            self.files.append(name)
        return self.files


def read_shards(folder: Path, columns: Iterable[str] | None = None) -> pa.Table:
    """All shards of a split as one table, memory-mapped (no copy into RAM)."""
    tables = []
    for f in sorted(Path(folder).glob("shard-*.arrow")):
        reader = pa.ipc.open_file(pa.memory_map(str(f), "r"))
        t = reader.read_all()
        tables.append(t.select(list(columns)) if columns else t)
    if not tables:
        return SCHEMA.empty_table() if not columns else SCHEMA.empty_table().select(list(columns))
    return pa.concat_tables(tables)


def count_rows(folder: Path, what: str) -> int:
    """Rows in a split's shards, > 0; a missing, unreadable or empty split is a ValueError naming
    `folder` (`what` says what the rows are for)."""
    try:
        n = read_shards(folder, ["length"]).num_rows
    except (OSError, pa.ArrowException, KeyError) as e:
        raise ValueError(f"the shards in {folder} can't be read "
                         f"({type(e).__name__}: {str(e).splitlines()[0]})") from None
    if n == 0:
        raise ValueError(f"no {what} in {folder}")
    return n
