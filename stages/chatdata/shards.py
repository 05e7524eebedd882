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


def _list_parts(arr: pa.ListArray, dtype) -> tuple[np.ndarray, np.ndarray]:
    """(values, lengths) of a list column, slices included."""
    offsets = arr.offsets.to_numpy()
    values = arr.values.to_numpy(zero_copy_only=False)[offsets[0]:offsets[-1]]
    return values.astype(dtype, copy=False), np.diff(offsets).astype(np.int32, copy=False)


def _rebuilt_list(parts: list[tuple[np.ndarray, np.ndarray]], dtype) -> pa.Array:
    lengths = np.concatenate([n for _, n in parts])
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = np.concatenate([v for v, _ in parts]).astype(dtype, copy=False)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))


def _concat(segments: list[pa.RecordBatch]) -> pa.RecordBatch:
    """One record batch of the segments' rows, built exactly as `_rows_batch` builds one from the same
    values (fresh zero-based buffers), so where the rows came from never shows in the bytes."""
    ids = [_list_parts(s.column(0), np.int32) for s in segments]
    masks = [_list_parts(s.column(1), np.int8) for s in segments]
    return pa.record_batch([
        _rebuilt_list(ids, np.int32),
        _rebuilt_list(masks, np.int8),
        pa.array(np.concatenate([n for _, n in ids]), pa.int32()),
        pa.array([x for s in segments for x in s.column(3).to_pylist()], pa.string()),
        pa.array([x for s in segments for x in s.column(4).to_pylist()], pa.string()),
    ], schema=SCHEMA)


class ShardWriter:
    """Streams rows into `shard-00000.arrow`, `shard-00001.arrow`, ... of at most `shard_rows` rows each.

    Rows come one at a time (`add`) or as Arrow record batches of SCHEMA (`add_batch`: another
    writer's shards, read back); either way a batch is built from the same column values by the same
    code, so the files are byte-identical whichever way (or mix of ways) the rows arrived."""

    def __init__(self, folder: Path, shard_rows: int = 50_000, batch_rows: int = BATCH_ROWS):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.shard_rows, self.batch_rows = shard_rows, min(batch_rows, shard_rows)
        self.files: list[str] = []
        self._buf: dict[str, list] = {k: [] for k in SCHEMA.names}  # the latest rows, added one at a time
        self._segments: list[pa.RecordBatch] = []  # earlier buffered rows, as slices of added batches
        self._segment_rows = 0
        self._sink = self._writer = None
        self._in_shard = 0

    def _buffered(self) -> int:
        return self._segment_rows + len(self._buf["source"])

    def _room(self) -> int:
        """Rows the current record batch still takes."""
        return min(self.batch_rows, self.shard_rows - self._in_shard) - self._buffered()

    def add(self, row: dict) -> None:
        for k in SCHEMA.names:
            self._buf[k].append(row.get(k))
        if self._room() <= 0:
            self._write_batch()

    def add_batch(self, batch: pa.RecordBatch | pa.Table) -> None:
        """Appends every row of `batch` (SCHEMA's columns; `length` is recomputed from `input_ids`)."""
        if isinstance(batch, pa.Table):
            for b in batch.to_batches():
                self.add_batch(b)
            return
        if self._buf["source"]:  # rows added one at a time come first
            self._segments.append(self._rows_batch())
            self._segment_rows += len(self._buf["source"])
            self._buf = {k: [] for k in SCHEMA.names}
        start = 0
        while start < batch.num_rows:
            take = min(self._room(), batch.num_rows - start)
            self._segments.append(batch.slice(start, take))
            self._segment_rows += take
            start += take
            if self._room() <= 0:
                self._write_batch()

    def _rows_batch(self) -> pa.RecordBatch:
        """The rows added one at a time, as one record batch."""
        b = self._buf
        ids = [np.asarray(x, dtype=np.int32) for x in b["input_ids"]]
        return pa.record_batch([
            _list_array(ids, np.int32),
            _list_array([np.asarray(x, dtype=np.int8) for x in b["loss_mask"]], np.int8),
            pa.array([len(x) for x in ids], pa.int32()),
            pa.array(b["source"], pa.string()),
            pa.array(b["messages"], pa.string()),
        ], schema=SCHEMA)

    def _write_batch(self) -> None:
        n = self._buffered()
        if not n:
            return
        if self._writer is None:
            name = f"shard-{len(self.files):05d}.arrow"
            self._sink = pa.OSFile(str(self.folder / name), "wb")
            self._writer = pa.ipc.new_file(self._sink, SCHEMA)
            self.files.append(name)
        if not self._segments:  # rows added one at a time only (prepare's own pieces)
            batch = self._rows_batch()
        else:
            if self._buf["source"]:
                self._segments.append(self._rows_batch())
            batch = _concat(self._segments)
        self._writer.write_batch(batch)
        self._buf = {k: [] for k in SCHEMA.names}
        self._segments, self._segment_rows = [], 0
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
