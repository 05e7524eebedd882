"""A month of retraining, simulated: a new data file each day for 30 days, each day planned and run
stage by stage as the flow runs them (`stages.pipeline.run_stage`), then the retention policy applied
by the function the flow calls after every run (flows/sft.py `_apply_retention`, `retention.auto`).
The demo's builtin model, two steps a day: what is measured is the disk, the registry and the lineage,
not what the model learns.

Training runs in this process (`in_process_torchrun`), as docs/architecture.md's one-process road
runs it (`RANK=0 ... python -m stages.train spec.json`): the same spec and worker, without a torchrun
and a fresh interpreter per day (8 s a day on 2 cores; 30 of them would not fit the suite). Simulated
days don't age folders, so `retention.keep_days` is 0: what no kept version needs goes at once.

Asserted: the disk after day 30 is at most twice day 1's; the champion loads and chats; every kept
version's lineage resolves (its folders exist and are sound); day 1 run again after `sftflow gc`
reuses what was kept and recomputes what was dropped, byte-identical to day 1; a `sftflow gc --yes`
racing a running flow (its stage locks held, as `run_stage` holds them) deletes nothing it uses.
(`sftflow gc`'s dry run and messages: tests/test_gc.py.)"""

import hashlib
import json
import os
from pathlib import Path

import pytest
from filelock import FileLock

import stages.train
from conftest import sftflow, write_config
from flows.sft import _apply_retention
from stages.core.cache.artifacts import damage, is_complete
from stages.core.config import load_config
from stages.pipeline import plan, run_stage
from stages.retention import _client, disk_usage, lineage, registered

pytestmark = pytest.mark.slow

DAYS = 30
NOUNS = [f"thing{i}" for i in range(DAYS * 2)]
COLOR = "What color is the {}?"


def rows(nouns, answer="blue"):
    return [json.dumps({"messages": [{"role": "user", "content": COLOR.format(n)},
                                     {"role": "assistant", "content": answer}]}) for n in nouns]


def write(path: Path, lines) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def month_config(tmp: Path, train_paths: list[str]) -> dict:
    return {
        "artifacts_dir": str(tmp / "artifacts"),
        "runner": {"max_steps": 2, "val_check_interval": 0, "save_interval": 0, "log_interval": 1, "seed": 7},
        # the tokenizer's corpus pinned: new data keeps the base model (and so every fingerprint above it)
        "actor": {"nproc_per_node": 1, "micro_batch_size": 8, "global_batch_size": 8, "init_from": "champion",
                  "model": {"corpus_paths": [str(tmp / "corpus.jsonl")]}, "optim": {"lr": 6e-3, "warmup": 0},
                  "precision": "fp32"},  # as tests/conftest.py's tiny config: the same arithmetic on every CI CPU
        "data": {"train_data_paths": train_paths, "format": "messages", "max_length": 32},
        "eval": {"max_new_tokens": 2, "batch_size": 8, "precision": "fp32",
                 "sets": {"colors": {"data_paths": [str(tmp / "eval.jsonl")]}}},
        # every day's version is champion (tolerance 1): the newest two are the kept ones
        "registry": {"model_name": "monthly", "promote": "if_better", "tolerance": 1.0},
        # two versions: 5 copies of the weights a month against day 1's 3, at any model size (the default 3
        # keeps 7: docs/operations.md); drop_checkpoints and auto: the defaults
        "retention": {"keep_versions": 2, "keep_days": 0},
    }


def in_process_torchrun(cmd, log_path, error, what, on_line=print, nproc_per_node=1, env=None):
    """`run_torchrun` for one rank in this process: the spec torchrun would be given, `fit` as the rank runs it;
    like it, the seconds it queued for the machine's cores (none: nothing else claims them here)."""
    from stages.runtime.worker import load_worker
    saved = dict(os.environ)
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(20000 + os.getpid() % 20000), **(env or {})})
    try:
        load_worker(cmd[-1]).fit()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return 0.0


def run_day(cfg_path: Path, stages_to_run=None) -> tuple:
    cfg = load_config(cfg_path)
    p = plan(cfg)
    results = {s: run_stage(p, s, on_line=lambda line: None) for s in p.stages
               if stages_to_run is None or s in stages_to_run}
    return p, results


def digests(folder: Path, only: tuple[str, ...] = ()) -> dict[str, str]:
    """sha256 of each file a stage made (the manifest, with its timestamps, and the run's own timings aside)."""
    skip = {"manifest.json", "train.log", "metrics.jsonl", "runtime.json", "spec.json"}  # spec: the config as given
    return {str(f.relative_to(folder)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(folder.rglob("*")) if f.is_file() and f.name not in skip
            and (not only or str(f.relative_to(folder)).startswith(only))}


def test_a_month_of_daily_retraining(tmp_path, monkeypatch):
    monkeypatch.setattr(stages.train, "run_torchrun", in_process_torchrun)
    write(tmp_path / "corpus.jsonl", rows(NOUNS) + rows(NOUNS, "red"))
    write(tmp_path / "eval.jsonl", rows(["lamp", "door", "cup", "moon"]))
    art = tmp_path / "artifacts"
    cfg_path = write_config(tmp_path, month_config(tmp_path, [str(tmp_path / "drops" / "*.jsonl")]))
    sizes, day1 = [], {}
    for day in range(1, DAYS + 1):
        write(tmp_path / "drops" / f"day-{day:02d}.jsonl", rows(NOUNS[2 * (day - 1):2 * day] * 4))
        p, _ = run_day(cfg_path)
        _apply_retention(p)
        if day == 1:
            assert not (p.folder("train") / "checkpoints").exists()  # finished and exported: dropped
            assert damage(p.folder("train")) is None  # ... and the folder is still a sound cache hit
            day1 = {s: (p.fingerprints[s], digests(p.folder(s), ("model/",) if s == "train" else ()))
                    for s in ("prepare", "prepare_eval", "baseline", "train", "evaluate")}
        sizes.append(disk_usage(art))
    print("disk per day (MB):", [round(s / 1e6, 2) for s in sizes])
    assert sizes[-1] <= 2 * sizes[0], [round(s / 1e6, 1) for s in sizes]

    # the registry: the champion and the newest two; every kept version's lineage on disk, sound
    cfg = load_config(cfg_path)
    client = _client(cfg)
    kept = registered(cfg)
    assert [str(v.version) for v in kept] == ["30", "29"]
    assert client.get_registered_model("monthly").aliases == {"champion": 30}
    for v in kept:
        folders = lineage(client, v)
        assert {"prepare", "prepare_eval", "baseline", "champion", "train", "evaluate", "register"} <= set(folders)
        for stage, fp in folders.items():
            assert is_complete(art / stage / fp) and damage(art / stage / fp) is None, (v.version, stage)
    assert not list((art / "models" / "start").glob("*"))  # downloaded copies of versions: MLflow holds them

    # the champion loads and chats
    from stages.models.refs import resolve_model_ref
    from stages.inference.generation import generate, load
    model, tok = load(resolve_model_ref("models:/monthly@champion", cfg.resolved_tracking_uri, str(tmp_path / "dl")))
    reply = generate(model, tok, [[{"role": "user", "content": COLOR.format("lamp")}]], max_new_tokens=4,
                     batch_size=1)
    assert reply[0]["new_tokens"] > 0 or reply[0]["stopped"]

    # day 1 again (its one file, from the base model) after the month's gc: what v30's lineage keeps is
    # reused, what went is recomputed, byte-identical to day 1
    day1_path = write_config(tmp_path, month_config(tmp_path, [str(tmp_path / "drops" / "day-01.jsonl")]) |
                             {"actor": {**month_config(tmp_path, [])["actor"], "init_from": "base"}}, "day1.yaml")
    again = plan(load_config(day1_path))
    assert {s: again.fingerprints[s] for s in day1} == {s: fp for s, (fp, _) in day1.items()}
    assert not again.folder("train").exists() and not again.folder("prepare").exists()  # dropped by the policy
    _, results = run_day(day1_path, ("prepare", "prepare_eval", "baseline", "train", "evaluate"))
    assert {s for s, r in results.items() if r.cached} == {"prepare_eval", "baseline"}
    for stage, (fp, want) in day1.items():
        only = ("model/",) if stage == "train" else ()
        assert digests(art / stage / fp, only) == want, stage

    # `sftflow gc --yes` racing a flow that is running day 1's training (its locks held, as run_stage
    # holds them): day 1's train and prepare folders and the pieces stay; what it isn't using goes
    locks = [FileLock(str(art / s / f".{day1[s][0]}.lock")) for s in ("train", "prepare")]
    for lock in locks:
        lock.acquire(timeout=0)
    try:
        raced = sftflow("gc", "-c", str(cfg_path), "--yes", cwd=tmp_path, timeout=300)
    finally:
        for lock in locks:
            lock.release()
    assert raced.returncode == 0, raced.stderr
    assert "a running flow holds its lock" in raced.stdout
    for stage in ("train", "prepare"):
        assert digests(art / stage / day1[stage][0], ("model/",) if stage == "train" else ()) == day1[stage][1]
    assert not (art / "evaluate" / day1["evaluate"][0]).exists()  # day 1's re-run evaluation: no lock, dropped
    _apply_retention(plan(load_config(cfg_path)))  # the next run's policy, once that flow is gone
    assert not (art / "train" / day1["train"][0]).exists()
    for v in kept:  # and the kept versions' lineage is still whole
        for stage, fp in lineage(client, v).items():
            assert is_complete(art / stage / fp), (v.version, stage)
