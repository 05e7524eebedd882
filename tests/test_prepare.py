"""prepare: shards round-trip, bad rows are counted and quarantined, never silently dropped."""

import json

import pyarrow as pa

from conftest import demo_rows, sftflow, tiny_config_dict, write_config
from stages.config import load_config
from stages.pipeline import plan, run_stage
from stages.prepare.shards import ShardWriter, read_shards


def test_shard_round_trip_across_several_shards(tmp_path):
    rows = [{"input_ids": list(range(n + 1)), "loss_mask": [i % 2 for i in range(n + 1)], "length": n + 1,
             "source": f"f.jsonl:{n}", "messages": None} for n in range(7)]
    w = ShardWriter(tmp_path / "train", shard_rows=3)
    for r in rows:
        w.add(r)
    assert w.close() == ["shard-00000.arrow", "shard-00001.arrow", "shard-00002.arrow"]
    table = read_shards(tmp_path / "train")
    assert table.to_pylist() == rows
    assert table.schema.field("input_ids").type == pa.list_(pa.int32())


def test_bad_rows_are_counted_by_reason_and_quarantined(tmp_path):
    good = demo_rows("train.jsonl", 20)
    bad_lines = [
        "{not json",
        json.dumps({"messages": [{"role": "user", "content": "hi"}]}),                        # no assistant
        json.dumps({"messages": [{"role": "wizard", "content": "hi"}, {"role": "assistant", "content": "x"}]}),
        json.dumps({"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}]}),
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  "}]}),
        json.dumps({"messages": [{"role": "user", "content": "word " * 400}, {"role": "assistant", "content": "x"}]}),
    ]
    lines = [json.dumps(r, ensure_ascii=False) for r in good[:10]] + bad_lines + [json.dumps(r, ensure_ascii=False) for r in good[10:]]
    train = tmp_path / "messy.jsonl"
    train.write_text("\n".join(lines) + "\n", encoding="utf-8")
    raw = tiny_config_dict(tmp_path)
    raw["data"]["train_data_paths"] = [str(train)]
    cfg = load_config(write_config(tmp_path, raw))
    result = run_stage(plan(cfg), "prepare")
    manifest = json.loads((tmp_path / "artifacts" / "prepare" / result.fingerprint / "manifest.json").read_text())
    split = manifest["splits"]["train"]
    assert split["rows_read"] == 26 and split["rows_kept"] == 20
    assert split["dropped"] == {"malformed_json": 1, "no_assistant_turn": 1, "unknown_role": 1,
                                "non_string_content": 1, "empty_assistant_reply": 1, "too_long": 1}
    quarantine = [json.loads(line) for line in open(f"{result.path}/quarantine.jsonl", encoding="utf-8")]
    assert [q["source"].rsplit(":", 1)[1] for q in quarantine] == ["11", "12", "13", "14", "15", "16"]
    kept = read_shards(f"{result.path}/train")
    assert [s.rsplit(":", 1)[1] for s in kept.column("source").to_pylist()] == [str(i) for i in list(range(1, 11)) + list(range(17, 27))]
    assert sum(sum(m) for m in kept.column("loss_mask").to_pylist()) == manifest["metrics"]["train_trainable_tokens"]
    assert "[[" in open(f"{result.path}/preview.txt", encoding="utf-8").read()


def test_data_with_no_usable_rows_fails_in_one_line(tmp_path):
    train = tmp_path / "empty.jsonl"
    train.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    raw = tiny_config_dict(tmp_path)
    raw["data"]["train_data_paths"] = [str(train)]
    path = write_config(tmp_path, raw)
    proc = sftflow("stage", "prepare", "-c", str(path), cwd=tmp_path, timeout=300)
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-2000:]
    assert errors[0].startswith("error: prepare: no usable rows in the train split") and "no_assistant_turn" in errors[0]
