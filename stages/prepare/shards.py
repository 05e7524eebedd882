"""Arrow shards: the on-disk form of prepared samples.

One row = one conversation: `input_ids` (list<int32>), `loss_mask` (list<int8>, 1 on
trainable tokens: assistant replies and their end-of-turn marker), `length` (int32),
`source` ("file:line"). The val split also keeps `messages` (JSON) so evaluate can rebuild
prompts and references. Shards are Arrow IPC files so the train stage memory-maps them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import pyarrow as pa

SCHEMA = pa.schema([
    ("input_ids", pa.list_(pa.int32())),
    ("loss_mask", pa.list_(pa.int8())),
    ("length", pa.int32()),
    ("source", pa.string()),
    ("messages", pa.string()),
])


class ShardWriter:
    """Buffers rows and writes `shard-00000.arrow`, `shard-00001.arrow`, ... of `shard_rows` rows each."""

    def __init__(self, folder: Path, shard_rows: int = 50_000):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.shard_rows = shard_rows
        self.rows: list[dict] = []
        self.files: list[str] = []

    def add(self, row: dict) -> None:
        self.rows.append(row)
        if len(self.rows) >= self.shard_rows:
            self.flush()

    def flush(self) -> None:
        if not self.rows and self.files:
            return
        name = f"shard-{len(self.files):05d}.arrow"
        table = pa.Table.from_pylist(self.rows, schema=SCHEMA)
        with pa.OSFile(str(self.folder / name), "wb") as sink, pa.ipc.new_file(sink, SCHEMA) as w:
            w.write_table(table)
        self.files.append(name)
        self.rows = []

    def close(self) -> list[str]:
        self.flush()
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
