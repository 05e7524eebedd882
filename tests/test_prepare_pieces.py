"""prepare's per-file pieces (stages/prepare/pieces.py): a prepare after new data tokenizes the new
file only, and what it writes is byte-identical to a prepare from scratch with the cache emptied;
an edited file or a changed setting rebuilds what it shapes; a damaged piece is rebuilt, never
trusted; data.strict still stops at the first bad row; two prepares building one piece agree."""

import json
import os
from pathlib import Path

import pytest

from conftest import demo_rows, tiny_config_dict, write_jsonl
from stages.core.config import config_from_dict
from stages.core.errors import DataError
from stages.pipeline import plan, run_stage
from stages.prepare import pieces as pieces_mod
from stages.prepare import rows as rows_mod
from stages.prepare import stage as stage_mod

VOLATILE = ("created_at", "seconds", "pieces")  # manifest keys that say when and how, not what
ROWS = demo_rows("train.jsonl", 400)
BAD = [b"{not json", json.dumps({"messages": [{"role": "wizard", "content": "hi"},
                                              {"role": "assistant", "content": "x"}]}).encode(),
       json.dumps({"text": "no messages here"}).encode()]


@pytest.fixture
def data(tmp_path) -> dict[str, Path]:
    """A: rows with 3 bad lines among them; B, C: clean; M: a mixture source's file; V: validation rows."""
    d = tmp_path / "data"
    d.mkdir()
    lines = [json.dumps(r).encode() for r in ROWS[:70]]
    for at, bad in zip((3, 30, 61), BAD):
        lines.insert(at, bad)
    (d / "a.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    write_jsonl(d / "b.jsonl", ROWS[100:160])
    write_jsonl(d / "c.jsonl", ROWS[200:245])
    write_jsonl(d / "m.jsonl", ROWS[300:330])
    write_jsonl(d / "v.jsonl", ROWS[350:370])
    return {k: d / f"{k.lower()}.jsonl" for k in "ABCMV"}


def prepare(artifacts: Path, model: Path, train: list[Path], mix: list[Path] | None = None, force: bool = False,
            stage: str = "prepare", sets: dict | None = None, **data):
    cfg_dir = artifacts.parent / f"{artifacts.name}-cfg"
    cfg_dir.mkdir(parents=True, exist_ok=True)
    raw = tiny_config_dict(cfg_dir)
    raw["artifacts_dir"] = str(artifacts)
    raw["actor"]["model"] = {"model_path": str(model)}
    val = [] if "val_fraction" in data else [str(train[0].parent / "v.jsonl")]  # the data fixture's V
    raw["data"].update({"train_data_paths": [str(p) for p in train], "val_data_paths": val, "format": "auto",
                        "shard_rows": 40, **data})
    if mix:
        raw["data"]["mix"] = {"train": {"weight": 0.5}, "extra": {"weight": 0.5, "paths": [str(p) for p in mix]}}
    if sets:
        raw["eval"]["sets"] = {name: {"data_paths": [str(p) for p in paths]} for name, paths in sets.items()}
    result = run_stage(plan(config_from_dict(raw)), stage, force=force)
    return Path(result.path), json.loads((Path(result.path) / "manifest.json").read_text())


def assert_same_output(a: Path, b: Path) -> None:
    """Every file of two stage folders byte-identical; their manifests equal but for timing and the cache."""
    files = lambda f: {str(p.relative_to(f)): p.read_bytes() for p in sorted(f.rglob("*"))  # noqa: E731
                       if p.is_file() and p.name != "manifest.json"}
    fa, fb = files(a), files(b)
    assert sorted(fa) == sorted(fb)
    for name in fa:
        assert fa[name] == fb[name], name
    def core(f: Path) -> dict:  # a source's piece is the cache's bookkeeping (a hub source has none)
        m = {k: v for k, v in json.loads((f / "manifest.json").read_text()).items() if k not in VOLATILE}
        m["sources"] = [{k: v for k, v in src.items() if k != "piece"} for src in m.get("sources", [])]
        return m
    assert core(a) == core(b)


def piece_dirs(artifacts: Path) -> set[str]:
    root = artifacts / "prepare_pieces"
    return {p.name for p in root.iterdir() if not p.name.startswith(".")} if root.is_dir() else set()


def piece_of(artifacts: Path, ref: Path) -> Path:
    (found,) = [p for p in (artifacts / "prepare_pieces").iterdir() if not p.name.startswith(".")
                and json.loads((p / "piece.json").read_text())["ref"] == str(ref)]
    return found


@pytest.fixture
def tokenized_files(monkeypatch) -> set[str]:
    """The files whose records reach the tokenizing code (num_proc 1: this process does it all)."""
    seen: set[str] = set()
    real = rows_mod.process_chunk

    def counting(chunk):
        seen.update(file for _, _, file, _, _ in chunk)
        return real(chunk)
    monkeypatch.setattr(rows_mod, "process_chunk", counting)
    return seen


def test_prepare_after_a_new_file_equals_a_prepare_from_scratch(tmp_path, tokenizer_dir, data, monkeypatch):
    """Bad rows, a held-out split by row hash, a mixture source and shards that cut across files; the
    incremental prepare tokenizes with 2 processes, the one from scratch with 1."""
    monkeypatch.setattr(stage_mod, "WORKER_MIN_BYTES", 1)  # a spawned worker even for little new data
    A, B, C, M = data["A"], data["B"], data["C"], data["M"]
    opts = dict(val_fraction=0.2, mix=[M])
    _, first = prepare(tmp_path / "x", tokenizer_dir, [A, B], **opts)
    assert first["pieces"]["built"] == 3 and first["pieces"]["reused"] == 0
    after, m = prepare(tmp_path / "x", tokenizer_dir, [A, B, C], num_proc=2, **opts)
    assert (m["pieces"]["reused"], m["pieces"]["built"], m["pieces"]["uncached"]) == (3, 1, 0)
    scratch, m0 = prepare(tmp_path / "y", tokenizer_dir, [A, B, C], num_proc=1, **opts)
    assert m0["pieces"]["built"] == 4
    assert_same_output(after, scratch)
    # what the comparison covered: several shards, both splits, quarantined rows, the mixture
    assert len(m["splits"]["train"]["shards"]) >= 3 and m["splits"]["val"]["rows_kept"] > 0
    dropped = {r: n for split in m["splits"].values() for r, n in split["dropped"].items()}  # by hash, either split
    assert dropped == {"malformed_json": 1, "missing_key": 1, "unknown_role": 1}
    assert [q["line"] for q in map(json.loads, (after / "quarantine.jsonl").read_text().splitlines())] == [4, 31, 62]
    # the mixture source holds out its own share by hash too (docs/data.md, "Validation by source"), in
    # heldout/extra/: its 30 rows are split between training and there
    held = {v["source"]: v["rows"] for v in m["val_mix"]}
    assert 0 < held["extra"] < 30 and (after / "heldout" / "extra").is_dir()
    assert m["mix"] == [{"source": "train", "rows": m["metrics"]["train_rows_kept"] - (30 - held["extra"])},
                        {"source": "extra", "rows": 30 - held["extra"]}]
    assert held["train"] == m["splits"]["val"]["rows_kept"]
    assert (after / "preview.txt").read_text().startswith(f"--- {A}:")


def test_adding_a_file_tokenizes_only_that_file(tmp_path, tokenizer_dir, data, tokenized_files):
    A, B, C = data["A"], data["B"], data["C"]
    prepare(tmp_path / "x", tokenizer_dir, [A, B])
    assert tokenized_files == {str(A), str(B), str(data["V"])}
    before = piece_dirs(tmp_path / "x")
    tokenized_files.clear()
    _, m = prepare(tmp_path / "x", tokenizer_dir, [A, B, C])
    assert tokenized_files == {str(C)}
    assert (m["pieces"]["reused"], m["pieces"]["built"]) == (3, 1)  # A, B and the val file V; C
    new = piece_dirs(tmp_path / "x") - before
    assert len(new) == 1 and piece_of(tmp_path / "x", C).name in new


def test_an_edited_file_rebuilds_its_piece_and_max_length_rebuilds_all(tmp_path, tokenizer_dir, data,
                                                                       tokenized_files):
    A, B, C = data["A"], data["B"], data["C"]
    prepare(tmp_path / "x", tokenizer_dir, [A, B, C])
    write_jsonl(B, ROWS[100:150] + ROWS[390:400])  # same name, new contents
    tokenized_files.clear()
    edited, m = prepare(tmp_path / "x", tokenizer_dir, [A, B, C])
    assert tokenized_files == {str(B)} and (m["pieces"]["reused"], m["pieces"]["built"]) == (3, 1)
    assert_same_output(edited, prepare(tmp_path / "y", tokenizer_dir, [A, B, C])[0])

    tokenized_files.clear()
    shorter, m = prepare(tmp_path / "x", tokenizer_dir, [A, B, C], max_length=40)
    assert tokenized_files == {str(A), str(B), str(C), str(data["V"])}
    assert (m["pieces"]["reused"], m["pieces"]["built"]) == (0, 4)
    assert m["splits"]["train"]["dropped"].get("too_long")  # the setting did change the rows
    assert_same_output(shorter, prepare(tmp_path / "z", tokenizer_dir, [A, B, C], max_length=40)[0])


def _truncate(piece: Path) -> None:
    shard = piece / "split-0" / "shard-00000.arrow"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])


def _footer(piece: Path) -> None:  # same size, the Arrow footer overwritten
    shard = piece / "split-0" / "shard-00000.arrow"
    raw = bytearray(shard.read_bytes())
    raw[-64:] = bytes(64)
    shard.write_bytes(bytes(raw))


def _manifest(piece: Path) -> None:
    (piece / "piece.json").write_text('{"key": ')


def _quarantine(piece: Path) -> None:
    (piece / "quarantine.jsonl").unlink()


@pytest.mark.parametrize("damage", [_truncate, _footer, _manifest, _quarantine])
def test_a_damaged_piece_is_rebuilt(tmp_path, tokenizer_dir, data, tokenized_files, damage):
    A, B = data["A"], data["B"]
    prepare(tmp_path / "x", tokenizer_dir, [A, B])
    damage(piece_of(tmp_path / "x", A))
    tokenized_files.clear()
    rebuilt, m = prepare(tmp_path / "x", tokenizer_dir, [A, B], force=True)
    assert tokenized_files == {str(A)} and (m["pieces"]["reused"], m["pieces"]["built"]) == (2, 1)
    assert_same_output(rebuilt, prepare(tmp_path / "y", tokenizer_dir, [A, B])[0])


def test_a_piece_that_fails_while_it_is_read_is_rebuilt_once(tmp_path, tokenizer_dir, data, monkeypatch):
    """Damage open_piece's checks can't see (they check sizes and the footer, not every byte)."""
    A, B = data["A"], data["B"]
    prepare(tmp_path / "x", tokenizer_dir, [A, B])
    bad = piece_of(tmp_path / "x", B)
    real, failed = pieces_mod.Piece.batches, []

    def failing(self, split):
        if self.folder == bad and not failed:
            failed.append(json.loads((bad / "piece.json").read_text())["created_at"])
            raise pieces_mod.PieceDamaged(self.folder, "a flipped bit")
        return real(self, split)
    monkeypatch.setattr(pieces_mod.Piece, "batches", failing)
    rebuilt, m = prepare(tmp_path / "x", tokenizer_dir, [A, B], force=True)
    assert failed and (m["pieces"]["reused"], m["pieces"]["built"]) == (2, 1)  # B's piece built again
    assert piece_of(tmp_path / "x", B) == bad
    assert_same_output(rebuilt, prepare(tmp_path / "y", tokenizer_dir, [A, B])[0])


def test_strict_stops_at_the_first_bad_row_whether_its_piece_is_reused_or_built(tmp_path, tokenizer_dir, data,
                                                                                tokenized_files):
    A, B, C = data["A"], data["B"], data["C"]
    prepare(tmp_path / "x", tokenizer_dir, [B, A])  # A's piece holds its quarantined rows
    tokenized_files.clear()
    with pytest.raises(DataError) as reused:
        prepare(tmp_path / "x", tokenizer_dir, [B, A, C], strict=True)
    assert tokenized_files == set()  # C comes after the bad row: not tokenized
    with pytest.raises(DataError) as built:
        prepare(tmp_path / "y", tokenizer_dir, [B, A, C], strict=True)
    assert str(reused.value) == str(built.value)
    assert str(reused.value).startswith(f"{A}:4: malformed_json") and "data.strict=true" in str(reused.value)
    # A's piece was left unfinished: neither kept nor left behind half-written
    assert piece_dirs(tmp_path / "y") == {piece_of(tmp_path / "x", B).name}
    assert not [p for p in (tmp_path / "y" / "prepare_pieces").iterdir() if p.name.startswith(".")]


def test_two_prepares_building_one_piece_keep_one(tmp_path, tokenizer_dir, data):
    """The second to finish finds the name taken and keeps the first's piece, dropping its own."""
    from stages.prepare.stage import Source
    from stages.prepare.rows import Item
    import numpy as np
    root = tmp_path / "prepare_pieces"
    src = Source(str(data["B"]), "train", "messages")
    one, two = (pieces_mod.PieceBuilder(root, "k" * 64, src, strict=False) for _ in range(2))
    for b, n in ((one, 3), (two, 5)):
        for line in range(n):
            b.add(Item("train", src.ref, line + 1, None, True, ids=np.arange(4, dtype=np.int32),
                       mask=np.array([0, 1, 1, 0], dtype=np.int8)))
    first, second = one.commit(), two.commit()
    assert first.folder == second.folder == root / ("k" * 64)
    assert second.splits["train"]["rows_kept"] == 3  # the first one's
    assert [p.name for p in root.iterdir()] == ["k" * 64]  # no temporary folder left


def test_prepare_eval_reuses_the_pieces_of_unchanged_sets(tmp_path, tokenizer_dir, data):
    rows = demo_rows("eval.jsonl", 60)
    e1, e2 = write_jsonl(tmp_path / "e1.jsonl", rows[:30]), write_jsonl(tmp_path / "e2.jsonl", rows[30:])
    prepare(tmp_path / "x", tokenizer_dir, [data["B"]], stage="prepare_eval", sets={"one": [e1]})
    two, m = prepare(tmp_path / "x", tokenizer_dir, [data["B"]], stage="prepare_eval", sets={"one": [e1], "two": [e2]})
    assert (m["pieces"]["reused"], m["pieces"]["built"]) == (1, 1)
    scratch, _ = prepare(tmp_path / "y", tokenizer_dir, [data["B"]], stage="prepare_eval",
                         sets={"one": [e1], "two": [e2]})
    assert_same_output(two, scratch)


def test_the_cache_can_be_deleted(tmp_path, tokenizer_dir, data):
    A, B = data["A"], data["B"]
    first, _ = prepare(tmp_path / "x", tokenizer_dir, [A, B])
    import shutil
    shutil.rmtree(tmp_path / "x" / "prepare_pieces")
    again, m = prepare(tmp_path / "x", tokenizer_dir, [A, B], force=True)
    assert m["pieces"]["built"] == 3 and os.listdir(again)
    assert_same_output(again, prepare(tmp_path / "y", tokenizer_dir, [A, B])[0])


def test_a_source_that_is_not_cached_is_tokenized_every_time(tmp_path, tokenizer_dir, data, tokenized_files,
                                                             monkeypatch):
    """Hub datasets (`hf:`) get a piece for one prepare only; C stands in for one here."""
    A, C = data["A"], data["C"]
    monkeypatch.setattr(stage_mod, "HUB_PREFIX", str(C))
    for force in (False, True):
        tokenized_files.clear()
        out, m = prepare(tmp_path / "x", tokenizer_dir, [A, C], force=force)
        assert m["pieces"]["uncached"] == 1 and str(C) in tokenized_files
    assert (m["pieces"]["reused"], m["pieces"]["built"]) == (2, 0) and tokenized_files == {str(C)}
    assert len(piece_dirs(tmp_path / "x")) == 2  # A and V
    assert not [p for p in (tmp_path / "x" / "prepare_pieces").iterdir() if p.name.startswith(".")]  # scratch gone
    monkeypatch.undo()
    assert_same_output(out, prepare(tmp_path / "y", tokenizer_dir, [A, C])[0])
