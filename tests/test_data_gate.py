"""The data gate (data.max_bad_fraction): prepare fails in one line, before anything trains, when more
than that share of a training file's rows, or of a training split's, was quarantined; the quarantine
file it names is kept. It holds on a reused (cached) folder as on a prepare that runs, and on the
named eval sets (prepare_eval) as on the training data."""

import json
from pathlib import Path

import pytest

from conftest import demo_rows, sftflow, tiny_config_dict, write_config, write_jsonl
from stages.core.cache.artifacts import read_manifest
from stages.core.config import config_from_dict
from stages.core.errors import DataError
from stages.core.quarantine import folder_checks
from stages.pipeline import plan, require_upstream, run_stage


def messy(path: Path, good: int = 70, malformed: int = 28, missing: int = 2,
          demo: str = "train.jsonl") -> tuple[Path, list[int]]:
    """`good` rows (of the demo file `demo`), with a bad one every third line: `malformed` unparsable,
    `missing` without messages."""
    lines = [json.dumps(r).encode() for r in demo_rows(demo, good)]
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


# --------------------------------------------------------------------------- the gate on a cached folder


def gate_line(stage: str, what, n: int, of: int, limit: float, reasons: str, quarantine: Path) -> str:
    return (f"{stage}: {n} of {of} rows ({100 * n / of:.1f}%) in {what} were quarantined, above "
            f"data.max_bad_fraction={limit} ({reasons}); nothing was trained; see {quarantine}")


def test_a_tighter_gate_holds_on_the_cached_folder(tmp_path, tokenizer_dir):
    """Prepared under a loose gate, the same data under a tighter one fails on the reused folder with the
    line a running prepare gives (naming the folder's own quarantine.jsonl); the fingerprint is the same
    and the complete folder is kept. A stage reading the folder (train) is stopped the same way."""
    train, _ = messy(tmp_path / "messy.jsonl")
    loose = plan(config(tmp_path, tokenizer_dir, train, max_bad_fraction=0.5))
    first = run_stage(loose, "prepare")
    assert not first.cached
    source = read_manifest(Path(first.path))["sources"][0]  # each source's counts, for the gate on reuse
    assert (source["ref"], source["rows_read"], source["rows_kept"], source["dropped"]) == (
        str(train), 100, 70, {"malformed_json": 28, "missing_key": 2})
    assert run_stage(loose, "prepare").cached  # the loose gate still passes it

    tight = plan(config(tmp_path, tokenizer_dir, train, max_bad_fraction=0.1))
    assert tight.fingerprints["prepare"] == loose.fingerprints["prepare"]
    folder = tight.folder("prepare")
    expected = gate_line("prepare", train, 30, 100, 0.1, "malformed_json 28, missing_key 2",
                         folder / "quarantine.jsonl")
    with pytest.raises(DataError) as e:
        run_stage(tight, "prepare")
    assert str(e.value) == expected and "\n" not in str(e.value)
    assert tight.status("prepare") == "complete" and (folder / "quarantine.jsonl").is_file()
    assert not (folder.parent / f"{tight.fingerprints['prepare']}.rejected").exists()
    with pytest.raises(DataError) as e:  # `sftflow stage train` on the folder: the same line
        require_upstream(tight, "train")
    assert str(e.value) == expected
    assert run_stage(loose, "prepare").cached  # nothing was deleted: the loose gate reuses it


def test_a_folder_without_each_files_counts_is_gated_from_its_quarantine(tmp_path, tokenizer_dir):
    """A folder written before the manifest held each source's counts: each file's counts come from its
    quarantine.jsonl and its kept rows, the same as the manifest's, so a drop is still named."""
    history = write_jsonl(tmp_path / "history.jsonl", demo_rows("train.jsonl", 120))
    drop, _ = messy(tmp_path / "drop.jsonl", good=7, malformed=2, missing=1)
    raw = tiny_config_dict(tmp_path)
    raw["actor"]["model"] = {"model_path": str(tokenizer_dir)}
    raw["data"].update({"train_data_paths": [str(history), str(drop)], "max_bad_fraction": 0.5})
    loose = run_stage(plan(config_from_dict(raw)), "prepare")
    folder = Path(loose.path)
    counted = folder_checks(folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    for s in manifest["sources"]:
        for key in ("rows_read", "rows_kept", "dropped"):
            del s[key]
    (folder / "manifest.json").write_text(json.dumps(manifest))
    assert folder_checks(folder) == counted
    assert [c[:2] for c in counted] == [(str(history), 120), (str(drop), 10), (str(tmp_path / "val.jsonl"), 12),
                                        ("the train split", 130), ("the val split", 12)]
    raw["data"]["max_bad_fraction"] = 0.1
    with pytest.raises(DataError) as e:
        run_stage(plan(config_from_dict(raw)), "prepare")
    assert str(e.value) == gate_line("prepare", drop, 3, 10, 0.1, "malformed_json 2, missing_key 1",
                                     folder / "quarantine.jsonl")


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_api")
def test_the_cli_stops_on_the_cached_folder_in_one_line(tmp_path, tokenizer_dir):
    """`sftflow stage prepare`, `sftflow run` (the flows' prepare task) and `sftflow stage train` with a
    tighter gate on data prepared under a looser one: exit 2, the gate's line last on stderr, no traceback."""
    train, _ = messy(tmp_path / "messy.jsonl")
    raw = tiny_config_dict(tmp_path)
    raw["actor"]["model"] = {"model_path": str(tokenizer_dir)}
    raw["data"].update({"train_data_paths": [str(train)], "max_bad_fraction": 0.5})
    path = write_config(tmp_path, raw)
    p = plan(config_from_dict(raw))
    run_stage(p, "prepare")
    expected = "error: " + gate_line("prepare", train, 30, 100, 0.1, "malformed_json 28, missing_key 2",
                                     p.folder("prepare") / "quarantine.jsonl")
    for command in (["stage", "prepare"], ["run"], ["stage", "train"]):
        proc = sftflow(*command, "-c", str(path), "data.max_bad_fraction=0.1", "flow.retries=2",
                       "flow.retry_delay_seconds=0", cwd=tmp_path, timeout=300)
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert proc.stderr.strip().splitlines()[-1] == expected, proc.stderr[-3000:]
        assert "Traceback" not in proc.stdout + proc.stderr and "Retry" not in proc.stdout + proc.stderr
        assert p.status("prepare") == "complete"


# --------------------------------------------------------------------------- eval sets


def test_an_eval_set_with_too_many_bad_rows_fails_prepare_eval(tmp_path, tokenizer_dir):
    """The named eval sets share data.max_bad_fraction: prepare_eval fails on a set's file with too many
    bad rows, when it runs and on its reused folder; the training data's prepare is not held by it."""
    qa, bad_lines = messy(tmp_path / "qa.jsonl", good=42, malformed=17, missing=1, demo="eval.jsonl")

    def eval_plan(limit: float):
        raw = tiny_config_dict(tmp_path)  # its training data is clean
        raw["actor"]["model"] = {"model_path": str(tokenizer_dir)}
        raw["data"]["max_bad_fraction"] = limit
        raw["eval"]["sets"] = {"qa": {"data_paths": [str(qa)]}}
        return plan(config_from_dict(raw))

    p = eval_plan(0.1)
    rejected = p.folder("prepare_eval").parent / f"{p.fingerprints['prepare_eval']}.rejected" / "quarantine.jsonl"
    with pytest.raises(DataError) as e:  # a prepare_eval that runs
        run_stage(p, "prepare_eval")
    assert str(e.value) == gate_line("prepare_eval", qa, 18, 60, 0.1, "malformed_json 17, missing_key 1", rejected)
    assert [json.loads(line)["line"] for line in rejected.read_text().splitlines()] == bad_lines
    assert p.status("prepare_eval") == "missing"
    assert not run_stage(p, "prepare").cached  # the training data passes

    loose = eval_plan(0.5)
    assert loose.fingerprints == p.fingerprints
    run_stage(loose, "prepare_eval")
    assert loose.status("prepare_eval") == "complete" and not rejected.parent.exists()

    folder = p.folder("prepare_eval")
    expected = gate_line("prepare_eval", qa, 18, 60, 0.1, "malformed_json 17, missing_key 1",
                         folder / "quarantine.jsonl")
    with pytest.raises(DataError) as e:  # the same gate on the reused folder
        run_stage(p, "prepare_eval")
    assert str(e.value) == expected
    assert p.status("prepare_eval") == "complete"
    assert run_stage(p, "prepare").cached


# --------------------------------------------------------------------------- a drop the gate stops, in MLflow


def gate_runs(tmp: Path) -> list:
    from mlflow.tracking import MlflowClient
    client = MlflowClient(f"sqlite:///{tmp / 'artifacts' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("sftflow")
    return client.search_runs([exp.experiment_id], "tags.`sftflow.gate` = 'rejected'") if exp else []


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_api")
def test_a_gated_drop_is_recorded_in_mlflow_and_a_served_run_moves_it_aside(tmp_path, tokenizer_dir, monkeypatch):
    """Issue 57: the gate's stop left no trace in MLflow, and the drop stayed where the config's glob finds
    it, failing every later run. Now each stop is a failed MLflow run tagged `sftflow.gate=rejected`; a
    served run (the loop that retrains on arrival) moves the file to `<folder>/rejected/`, a run a person
    starts leaves it where it is."""
    from flows.sft import PROTECTED_ENV, SERVED_CONFIG_ENV, sft_stage
    drops = tmp_path / "drops"
    drops.mkdir()
    write_jsonl(drops / "day1.jsonl", demo_rows("train.jsonl", 60))
    bad, _ = messy(drops / "day2.jsonl")
    raw = tiny_config_dict(tmp_path)
    raw["actor"]["model"] = {"model_path": str(tokenizer_dir)}
    raw["data"].update({"train_data_paths": [str(drops / "*.jsonl")], "format": "messages", "max_bad_fraction": 0.1})
    path = write_config(tmp_path, raw)
    line = f"prepare: 30 of 100 rows (30.0%) in {bad} were quarantined, above data.max_bad_fraction=0.1"

    # a run a person starts: recorded, the file left where it is, the line as before
    with pytest.raises(DataError) as e:
        sft_stage("prepare", config_path=str(path))
    assert str(e.value).startswith(line) and "moved" not in str(e.value)
    assert bad.is_file()
    (run,) = gate_runs(tmp_path)
    assert run.info.status == "FAILED" and run.info.run_name == "rejected day2.jsonl"
    assert run.data.tags["mlflow.note.content"] == str(e.value) and run.data.tags["sftflow.gate_file"] == str(bad)
    assert run.data.metrics["data.rows_read"] == 100 and run.data.metrics["data.quarantined.malformed_json"] == 28

    # a served run: recorded, and the file moved aside, said in the line
    monkeypatch.setenv(SERVED_CONFIG_ENV, str(path.resolve()))
    monkeypatch.setenv(PROTECTED_ENV, "")
    with pytest.raises(DataError) as e:
        sft_stage("prepare", config_path=str(path.resolve()))
    moved = drops / "rejected" / "day2.jsonl.rejected"
    assert str(e.value).endswith(f"; moved {bad} to {moved}, later runs go on without it"), str(e.value)
    assert not bad.exists() and moved.is_file()
    runs = gate_runs(tmp_path)
    assert len(runs) == 2 and runs[0].data.tags["sftflow.gate_moved_to"] == str(moved)

    # the next run goes on with day 1's file
    (result,) = sft_stage("prepare", config_path=str(path.resolve()))
    from flows.servers.prefect_server import _drain_prefect_clients
    _drain_prefect_clients()  # this process's flow logs, sent while the session's server is up
    refs = [s["ref"] for s in read_manifest(Path(result["path"]))["sources"]]
    assert str(drops / "day1.jsonl") in refs and not any("day2" in r for r in refs), refs
