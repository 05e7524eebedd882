"""prepare: every format and file type, bad rows counted and quarantined (never silently
dropped), strict mode, identical output for any num_proc, the held-out split, real data."""

import csv
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import (REAL_TEMPLATES, REALDATA, base_model, demo_rows, family_tokenizer, sftflow, tiny_config_dict,
                      write_config, write_jsonl)
from stages.core.config import config_from_dict, load_config
from stages.core.errors import DataError
from stages.pipeline import plan, run_stage
from stages.chatdata.shards import ShardWriter, read_shards

# A template that rejects a conversation, as real ones do with raise_exception.
STRICT_SYSTEM = "{% if messages[1:] | selectattr('role', 'equalto', 'system') | list %}" \
                "{{ raise_exception('System message must be first') }}{% endif %}"


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """The builtin tokenizer alone, as a local model folder: prepare needs nothing else."""
    from transformers import AutoTokenizer
    tmp = tmp_path_factory.mktemp("tok")
    tok = AutoTokenizer.from_pretrained(base_model(load_config(write_config(tmp, tiny_config_dict(tmp)))))
    tok.chat_template = STRICT_SYSTEM + tok.chat_template
    tok.save_pretrained(tmp / "tokenizer")
    return tmp / "tokenizer"


def prepare(tmp: Path, model: Path, train, val=None, **data):
    tmp.mkdir(parents=True, exist_ok=True)
    raw = tiny_config_dict(tmp)
    raw["actor"]["model"] = {"model_path": str(model)}
    raw["data"].update({"train_data_paths": [str(p) for p in train], "format": "auto", **data})
    raw["data"]["val_data_paths"] = ([str(p) for p in val] if val
                                     else ([] if "val_fraction" in data else raw["data"]["val_data_paths"]))
    result = run_stage(plan(config_from_dict(raw)), "prepare")
    return result, json.loads((Path(result.path) / "manifest.json").read_text())


def shard_rows(result, split="train") -> list[dict]:
    return read_shards(Path(result.path) / split).to_pylist()


def test_shard_round_trip_across_several_shards(tmp_path):
    rows = [{"input_ids": list(range(n + 1)), "loss_mask": [i % 2 for i in range(n + 1)], "length": n + 1,
             "source": f"f.jsonl:{n}", "messages": None} for n in range(7)]
    w = ShardWriter(tmp_path / "train", shard_rows=3, batch_rows=2)
    for r in rows:
        w.add(r)
    assert w.close() == ["shard-00000.arrow", "shard-00001.arrow", "shard-00002.arrow"]
    assert [pa.ipc.open_file(str(f)).read_all().num_rows for f in sorted((tmp_path / "train").iterdir())] == [3, 3, 1]
    table = read_shards(tmp_path / "train")
    assert table.to_pylist() == rows
    assert table.schema.field("input_ids").type == pa.list_(pa.int32())


def test_every_format_and_file_type_yields_the_same_samples(tmp_path, tokenizer_dir):
    convs = [r["messages"] for r in demo_rows("train.jsonl", 60) if len(r["messages"]) == 2][:12]
    pairs = [(c[0]["content"], c[1]["content"]) for c in convs]
    d = tmp_path / "data"
    (d / "nested").mkdir(parents=True)
    write_jsonl(d / "messages.jsonl", [{"messages": c} for c in convs])
    # a BOM, as Windows writes
    (d / "messages.jsonl").write_bytes(b"\xef\xbb\xbf" + (d / "messages.jsonl").read_bytes())
    (d / "part-empty.jsonl").write_text("")  # an empty part of a sharded export: no rows, no error
    (d / "sharegpt.json").write_text(json.dumps([{"conversations": [{"from": "human", "value": u},
                                                                    {"from": "gpt", "value": a}]}
                                                 for u, a in pairs]))
    pq.write_table(pa.Table.from_pylist([{"prompt": u, "completion": a} for u, a in pairs]),
                   d / "nested" / "pc.parquet")
    pq.write_table(pa.Table.from_pylist([{"prompt": [c[0]], "completion": [c[1]]} for c in convs]),
                   d / "pc_lists.parquet")
    with open(d / "alpaca.csv", "w", newline="", encoding="utf-8-sig") as f:  # Excel's "CSV UTF-8"
        w = csv.DictWriter(f, ["instruction", "input", "output"])
        w.writeheader()
        w.writerows({"instruction": u, "input": "", "output": a} for u, a in pairs)
    write_jsonl(d / "conversation.jsonl", [{"conversation": [convs[i], convs[i + 1]]} for i in range(0, 12, 2)])
    with open(d / "nested" / "conversations.csv", "w", newline="", encoding="utf-8") as f:  # JSON text in a cell
        w = csv.DictWriter(f, ["conversations"])
        w.writeheader()
        w.writerows({"conversations": json.dumps([convs[i], convs[i + 1]], ensure_ascii=False)}
                    for i in range(0, 12, 2))
    import datasets
    datasets.Dataset.from_list([{"messages": c} for c in convs]).save_to_disk(str(d / "hfds"))  # one input
    (d / "notes.md").write_text("a directory's non-data files are not inputs")

    result, manifest = prepare(tmp_path, tokenizer_dir, [d])
    formats = {Path(s["ref"]).name: s["format"] for s in manifest["sources"] if s["split"] == "train"}
    assert formats == {"messages.jsonl": "messages", "sharegpt.json": "sharegpt", "pc.parquet": "prompt_completion",
                       "pc_lists.parquet": "prompt_completion", "alpaca.csv": "alpaca",
                       "conversation.jsonl": "conversation", "conversations.csv": "conversation",
                       "part-empty.jsonl": "auto", "hfds": "messages"}
    by_file: dict[str, list] = {}
    for r in shard_rows(result):
        by_file.setdefault(Path(r["source"].rsplit(":", 1)[0]).name, []).append(r)
    reference = [(r["input_ids"], r["loss_mask"]) for r in by_file["messages.jsonl"]]
    assert len(reference) == 12 and manifest["splits"]["train"]["dropped"] == {}
    for name, rows in by_file.items():
        assert [(r["input_ids"], r["loss_mask"]) for r in rows] == reference, name
    assert [r["source"].rsplit(":", 1)[1] for r in by_file["conversation.jsonl"][:3]] == ["1#0", "1#1", "2#0"]


def test_custom_field_names_and_ambiguous_files(tmp_path, tokenizer_dir):
    rows = [{"dialog": [{"speaker": "user", "text": "hi"}, {"speaker": "assistant", "text": "hello"}]}] * 3
    custom = write_jsonl(tmp_path / "custom.jsonl", rows)
    with pytest.raises(DataError) as e:  # bad input: exit code 2 from the CLI
        prepare(tmp_path, tokenizer_dir, [custom])
    assert "custom.jsonl: cannot detect the format" in str(e.value) and "\n" not in str(e.value)
    result, manifest = prepare(tmp_path, tokenizer_dir, [custom],
                               columns={"messages": "dialog", "role": "speaker", "content": "text"})
    assert manifest["splits"]["train"]["rows_kept"] == 3
    both = write_jsonl(tmp_path / "both.jsonl", [{"messages": [], "conversations": []}])
    with pytest.raises(DataError, match=r"both.jsonl: ambiguous format, .*messages and sharegpt; set data.format"):
        prepare(tmp_path, tokenizer_dir, [both])


BAD_LINES = {  # reason -> a line of a JSONL file
    "malformed_json": b"{not json",
    "invalid_utf8": b'{"messages": [{"role": "user", "content": "caf\xe9"}, {"role": "assistant", "content": "x"}]}',
    "not_an_object": b"[1, 2]",
    "missing_key": json.dumps({"text": "hello"}).encode(),  # the file is `messages`; this row has none
    "missing_role": json.dumps({"messages": [{"content": "hi"}, {"role": "assistant", "content": "x"}]}).encode(),
    "unknown_role": json.dumps({"messages": [{"role": "wizard", "content": "hi"},
                                             {"role": "assistant", "content": "x"}]}).encode(),
    "non_string_content": json.dumps({"messages": [{"role": "user", "content": 3},
                                                   {"role": "assistant", "content": "x"}]}).encode(),
    "empty_assistant_reply": json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                      {"role": "assistant", "content": " "}]}).encode(),
    "no_assistant_turn": json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode(),
    "empty_conversation": json.dumps({"messages": []}).encode(),
    "template_error": json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": "late"},
                                               {"role": "assistant", "content": "x"}]}).encode(),
    "too_long": json.dumps({"messages": [{"role": "user", "content": "word " * 400},
                                         {"role": "assistant", "content": "x"}]}).encode(),
}


def messy_corpus(tmp: Path) -> tuple[Path, Path, list[int]]:
    good = [json.dumps(r, ensure_ascii=False).encode() for r in demo_rows("train.jsonl", 20)]
    lines, bad_at = good[:10], []
    for line in BAD_LINES.values():
        lines.append(line)
        bad_at.append(len(lines))
    lines += good[10:]
    (tmp / "messy.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    (tmp / "clean.jsonl").write_bytes(b"\n".join(good) + b"\n")
    return tmp / "messy.jsonl", tmp / "clean.jsonl", bad_at


def test_every_kind_of_bad_row_is_counted_quarantined_and_never_changes_good_rows(tmp_path, tokenizer_dir):
    messy, clean, bad_at = messy_corpus(tmp_path)
    result, manifest = prepare(tmp_path, tokenizer_dir, [messy])
    split = manifest["splits"]["train"]
    assert split["rows_read"] == 20 + len(BAD_LINES) and split["rows_kept"] == 20
    assert split["dropped"] == {reason: 1 for reason in BAD_LINES}
    quarantine = [json.loads(line) for line in open(f"{result.path}/quarantine.jsonl", encoding="utf-8")]
    assert [(q["line"], q["reason"]) for q in quarantine] == list(zip(bad_at, BAD_LINES))
    assert all(q["file"] == str(messy) and q["split"] == "train" and q["raw"] for q in quarantine)

    clean_result, _ = prepare(tmp_path, tokenizer_dir, [clean])
    kept, ref = shard_rows(result), shard_rows(clean_result)
    assert [(r["input_ids"], r["loss_mask"]) for r in kept] == [(r["input_ids"], r["loss_mask"]) for r in ref]
    assert sum(sum(r["loss_mask"]) for r in kept) == manifest["metrics"]["train_trainable_tokens"]
    assert "[[" in open(f"{result.path}/preview.txt", encoding="utf-8").read()


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_api")
def test_strict_mode_stops_at_the_first_bad_row_in_one_line(tmp_path, tokenizer_dir):
    messy, _, bad_at = messy_corpus(tmp_path)
    raw = tiny_config_dict(tmp_path)
    raw["actor"]["model"] = {"model_path": str(tokenizer_dir)}
    raw["data"].update({"train_data_paths": [str(messy)], "format": "auto"})
    path = write_config(tmp_path, raw)
    # bad input is a usage error: exit 2, its one line last, no traceback, and never retried
    proc = sftflow("stage", "prepare", "-c", str(path), "data.strict=true", "flow.retries=2",
                   "flow.retry_delay_seconds=0", cwd=tmp_path, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-2000:]
    assert errors[0].startswith(f"error: {messy}:{bad_at[0]}: malformed_json"), errors[0]
    assert proc.stderr.strip().splitlines()[-1] == errors[0]
    assert "Traceback" not in proc.stdout + proc.stderr and "Retry" not in proc.stdout + proc.stderr


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_api")
def test_a_file_mixing_formats_is_one_line_and_exit_2(tmp_path, tokenizer_dir):
    mixed = write_jsonl(tmp_path / "mixed.jsonl", [
        {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
        {"prompt": "a", "completion": "b"}])
    raw = tiny_config_dict(tmp_path)
    raw["actor"]["model"] = {"model_path": str(tokenizer_dir)}
    raw["data"].update({"train_data_paths": [str(mixed)], "format": "auto"})
    proc = sftflow("stage", "prepare", "-c", str(write_config(tmp_path, raw)), cwd=tmp_path, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: {mixed}: rows mix formats")
    assert "Traceback" not in proc.stdout + proc.stderr


def test_output_is_identical_for_any_num_proc_and_shard_size_is_bounded(tmp_path, tokenizer_dir):
    train = write_jsonl(tmp_path / "train.jsonl", demo_rows("train.jsonl", 700))
    one, m1 = prepare(tmp_path / "a", tokenizer_dir, [train], shard_rows=300)
    two, m2 = prepare(tmp_path / "b", tokenizer_dir, [train], shard_rows=300, num_proc=2)
    assert one.fingerprint == two.fingerprint  # num_proc is not part of the fingerprint
    files = m1["splits"]["train"]["shards"]
    assert files == ["shard-00000.arrow", "shard-00001.arrow", "shard-00002.arrow"] == m2["splits"]["train"]["shards"]
    for f in files:
        assert (Path(one.path) / "train" / f).read_bytes() == (Path(two.path) / "train" / f).read_bytes()
    assert (Path(one.path) / "quarantine.jsonl").read_bytes() == (Path(two.path) / "quarantine.jsonl").read_bytes()

    from stages.runtime.batches import SFTDataset  # what training reads: memory-mapped, several record batches
    ds, rows = SFTDataset(Path(one.path) / "train"), shard_rows(one)
    assert len(ds) == len(rows) == m1["splits"]["train"]["rows_kept"]
    assert ds.trainable.tolist() == [sum(r["loss_mask"]) for r in rows]
    assert ds[len(rows) - 1]["input_ids"].tolist() == rows[-1]["input_ids"]


def test_held_out_split_by_row_hash_is_stable_when_rows_are_appended(tmp_path, tokenizer_dir):
    rows = demo_rows("train.jsonl", 400)
    train = write_jsonl(tmp_path / "rows.jsonl", rows[:300])
    first, m1 = prepare(tmp_path, tokenizer_dir, [train], val_fraction=0.2)
    assert (30 <= m1["splits"]["val"]["rows_kept"] <= 90
            and m1["splits"]["val"]["rows_kept"] + m1["splits"]["train"]["rows_kept"] == 300)
    val_before = {r["source"] for r in shard_rows(first, "val")}
    write_jsonl(train, rows)  # 100 rows appended
    second, m2 = prepare(tmp_path, tokenizer_dir, [train], val_fraction=0.2)
    assert second.fingerprint != first.fingerprint
    val_after = {r["source"] for r in shard_rows(second, "val")}
    lines = lambda sources: {int(s.rsplit(":", 1)[1]) for s in sources}  # noqa: E731
    assert {n for n in lines(val_after) if n <= 300} == lines(val_before)
    held_out = shard_rows(second, "val")
    assert held_out and all(json.loads(r["messages"]) for r in held_out)  # evaluate's prompts


@pytest.mark.skipif(not (REALDATA / "sharegpt_identity.json").is_file(), reason="../shared/realdata absent")
@pytest.mark.parametrize("template", ["llama-3-instruct", "qwen2.5-instruct"])
def test_real_sharegpt_file_with_real_templates(tmp_path, tokenizer_dir, template):
    """500 real conversations, 1,000 assistant turns: every row kept, every turn trainable."""
    from transformers import AutoTokenizer
    tok = family_tokenizer(AutoTokenizer.from_pretrained(tokenizer_dir), template)
    tok.save_pretrained(tmp_path / "tok")
    source = REALDATA / "sharegpt_identity.json"
    result, manifest = prepare(tmp_path, tmp_path / "tok", [source], val=[source], format="sharegpt", max_length=4096)
    rows = json.loads(source.read_text())
    turns = sum(1 for r in rows for m in r["conversations"] if m["from"] == "gpt")
    assert manifest["splits"]["train"]["rows_read"] == len(rows) == manifest["splits"]["train"]["rows_kept"] == 500
    assert turns == 1000
    marker = REAL_TEMPLATES[template][1]
    marker_id = tok.convert_tokens_to_ids(marker)
    trained_turns = 0
    for r in shard_rows(result):
        conv = rows[int(r["source"].rsplit(":", 1)[1]) - 1]["conversations"]
        ids, mask = r["input_ids"], r["loss_mask"]
        runs = [k for k in range(len(mask)) if mask[k] and (k + 1 == len(mask) or not mask[k + 1])]
        assert len(runs) == sum(m["from"] == "gpt" for m in conv)
        assert all(ids[k] == marker_id for k in runs)  # every run ends on the end-of-turn token
        trained_turns += len(runs)
    assert trained_turns == 1000


def test_show_preview_highlights_trainable_spans(tmp_path, tokenizer_dir):
    raw = tiny_config_dict(tmp_path)
    raw["actor"]["model"] = {"model_path": str(tokenizer_dir)}
    path = write_config(tmp_path, raw)
    proc = sftflow("show", "-c", str(path), "--preview", "2", cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    first = demo_rows("train.jsonl", 1)[0]["messages"]
    assert first[1]["content"] in proc.stdout and "train.jsonl:1" in proc.stdout and "train.jsonl:2" in proc.stdout
    assert "first rows, prepared on the fly" in proc.stdout
    # piped (no colours), the trained spans are marked as in preview.txt, and the legend says so
    assert f"[[{first[-1]['content']}" in proc.stdout and "[[ ]] = trained" in proc.stdout
    assert first[0]["role"] == "user" and f"[[{first[0]['content']}" not in proc.stdout  # not trained


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_api")
def test_data_with_no_usable_rows_fails_in_one_line(tmp_path, tokenizer_dir):
    train = tmp_path / "empty.jsonl"
    train.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    raw = tiny_config_dict(tmp_path)
    raw["actor"]["model"] = {"model_path": str(tokenizer_dir)}
    raw["data"]["train_data_paths"] = [str(train)]
    path = write_config(tmp_path, raw)
    proc = sftflow("stage", "prepare", "-c", str(path), cwd=tmp_path, timeout=300)
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-2000:]
    assert (errors[0].startswith("error: prepare: no usable rows in the train split")
            and "no_assistant_turn" in errors[0])


def test_prompt_and_completion_strings_are_text_even_when_they_look_like_json(tmp_path, tokenizer_dir):
    """A string in a prompt/completion field is text in every file type; only structured values are turns."""
    looks_like_turns = json.dumps([{"role": "assistant", "content": "SECRET user text"}])
    completion = json.dumps([{"role": "user", "content": "hi"}])
    rows = [{"prompt": looks_like_turns, "completion": "ok"}, {"prompt": "q", "completion": completion}]
    d = tmp_path / "data"
    d.mkdir()
    write_jsonl(d / "pc.jsonl", rows)
    pq.write_table(pa.Table.from_pylist(rows), d / "pc.parquet")
    with open(d / "pc.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, ["prompt", "completion"])
        w.writeheader()
        w.writerows(rows)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    for name in ("pc.jsonl", "pc.parquet", "pc.csv"):
        result, manifest = prepare(tmp_path / name, tokenizer_dir, [d / name], val=[d / name])
        assert manifest["splits"]["train"]["rows_kept"] == 2, (name, manifest["splits"]["train"]["dropped"])
        got = [json.loads(r["messages"]) for r in shard_rows(result, "val")]
        assert got == [[{"role": "user", "content": looks_like_turns}, {"role": "assistant", "content": "ok"}],
                       [{"role": "user", "content": "q"}, {"role": "assistant", "content": completion}]], name
        trained = [tok.decode([i for i, m in zip(r["input_ids"], r["loss_mask"]) if m]) for r in shard_rows(result)]
        assert trained == ["ok<|im_end|>", completion + "<|im_end|>"], name  # the user's text is never trained
