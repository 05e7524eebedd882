"""The data gate (data.max_bad_fraction): prepare fails in one line, before anything trains, when more
than that share of a training file's rows, or of a training split's, was quarantined; the quarantine
file it names is kept."""

import json
from pathlib import Path

import pytest

from conftest import demo_rows, tiny_config_dict, write_jsonl
from stages.core.config import config_from_dict
from stages.core.errors import DataError
from stages.pipeline import plan, run_stage


def messy(path: Path, good: int = 70, malformed: int = 28, missing: int = 2) -> tuple[Path, list[int]]:
    """`good` rows, then every 10th-ish line a bad one: `malformed` unparsable, `missing` without messages."""
    lines = [json.dumps(r).encode() for r in demo_rows("train.jsonl", good)]
    bad = [b"{not json"] * malformed + [json.dumps({"text": "no messages"}).encode()] * missing
    for k, line in enumerate(bad):
        lines.insert(min(3 * k + 1, len(lines)), line)
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path, [n for n, line in enumerate(lines, start=1) if line in bad]


def config(tmp: Path, model: Path, train: Path, **data):
    raw = tiny_config_dict(tmp)  # writes tmp/train.jsonl and tmp/val.jsonl
    raw["actor"]["model"] = {"model_path": str(model)}
    raw["data"].update({"train_data_paths": [str(train)], "format": "messages", **data})
    return config_from_dict(raw)


def test_too_many_quarantined_rows_stop_prepare_in_one_line(tmp_path, tokenizer_dir):
    train, bad_lines = messy(tmp_path / "messy.jsonl")
    p = plan(config(tmp_path, tokenizer_dir, train, max_bad_fraction=0.1))
    with pytest.raises(DataError) as e:
        run_stage(p, "prepare")
    msg = str(e.value)
    rejected = tmp_path / "artifacts" / "prepare" / f"{p.fingerprints['prepare']}.rejected" / "quarantine.jsonl"
    assert msg == (f"prepare: 30 of 100 rows (30.0%) in {train} were quarantined, above "
                   "data.max_bad_fraction=0.1 (malformed_json 28, missing_key 2); nothing was trained; "
                   f"see {rejected}")
    assert "\n" not in msg
    records = [json.loads(line) for line in rejected.read_text().splitlines()]
    assert [r["line"] for r in records] == bad_lines and {r["file"] for r in records} == {str(train)}
    assert [r["reason"] for r in records].count("malformed_json") == 28
    assert p.status("prepare") == "missing" and not p.folder("prepare").exists()
    assert not (tmp_path / "artifacts" / "prepare" / f".{p.fingerprints['prepare']}.partial").exists()

    # the same data with a looser gate: the fingerprint is the same (the gate is not in it), the folder is
    # written, and the rejected quarantine file goes (the folder has its own)
    loose = plan(config(tmp_path, tokenizer_dir, train, max_bad_fraction=0.5))
    assert loose.fingerprints["prepare"] == p.fingerprints["prepare"]
    run_stage(loose, "prepare")
    assert loose.status("prepare") == "complete" and not rejected.parent.exists()
    assert (p.folder("prepare") / "quarantine.jsonl").read_text() == "".join(
        json.dumps(r, ensure_ascii=False) + "\n" for r in records)


def test_exactly_at_the_threshold_passes(tmp_path, tokenizer_dir):
    train, _ = messy(tmp_path / "messy.jsonl")
    result = run_stage(plan(config(tmp_path, tokenizer_dir, train, max_bad_fraction=0.3)), "prepare")
    m = json.loads((Path(result.path) / "manifest.json").read_text())
    assert m["splits"]["train"]["rows_read"] == 100 and m["splits"]["train"]["dropped"] == {
        "malformed_json": 28, "missing_key": 2}
    # a share whose float product would round below it: 29 of 100 at 0.29
    train, _ = messy(tmp_path / "messy29.jsonl", good=71, malformed=27, missing=2)
    run_stage(plan(config(tmp_path, tokenizer_dir, train, max_bad_fraction=0.29)), "prepare")


def test_unset_any_share_is_quarantined_and_counted(tmp_path, tokenizer_dir):
    train, _ = messy(tmp_path / "messy.jsonl", good=10, malformed=60, missing=30)
    result = run_stage(plan(config(tmp_path, tokenizer_dir, train)), "prepare")
    m = json.loads((Path(result.path) / "manifest.json").read_text())
    assert m["splits"]["train"]["dropped"] == {"malformed_json": 60, "missing_key": 30}


def test_the_val_split_is_gated_too(tmp_path, tokenizer_dir):
    train = write_jsonl(tmp_path / "clean.jsonl", demo_rows("train.jsonl", 50))
    val, _ = messy(tmp_path / "messy-val.jsonl", good=8, malformed=2, missing=0)  # not val.jsonl: the config's own
    p = plan(config(tmp_path, tokenizer_dir, train, val_data_paths=[str(val)], max_bad_fraction=0.1))
    with pytest.raises(DataError, match=r"^prepare: 2 of 10 rows \(20.0%\) in .*messy-val.jsonl were quarantined, "
                                        r"above data.max_bad_fraction=0.1 \(malformed_json 2\)"):
        run_stage(p, "prepare")


def test_a_bad_drop_is_stopped_even_when_the_split_is_mostly_good(tmp_path, tokenizer_dir):
    """A day's drop with 30% bad rows among a long clean history: 3 of 130 rows split-wide (2.3%), but
    30% of that file's rows, so the gate stops it and names the file."""
    history = write_jsonl(tmp_path / "history.jsonl", demo_rows("train.jsonl", 120))
    drop, _ = messy(tmp_path / "drop.jsonl", good=7, malformed=3, missing=0)
    raw = tiny_config_dict(tmp_path)
    raw["actor"]["model"] = {"model_path": str(tokenizer_dir)}
    raw["data"].update({"train_data_paths": [str(history), str(drop)], "max_bad_fraction": 0.1})
    p = plan(config_from_dict(raw))
    with pytest.raises(DataError, match=rf"^prepare: 3 of 10 rows \(30.0%\) in {drop} were quarantined, above "
                                        r"data.max_bad_fraction=0.1 \(malformed_json 3\)"):
        run_stage(p, "prepare")
    raw["data"]["train_data_paths"] = [str(history)]  # the operator takes the drop out
    assert run_stage(plan(config_from_dict(raw)), "prepare").metrics["train_rows_kept"] == 120
