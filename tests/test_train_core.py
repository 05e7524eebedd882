"""Training core: packing, sampling and data position, checkpoints and resume, world-size
changes, multi-node rendezvous, export, and the worker extension API. Each check compares
against an independent reference (an unpacked forward, an uninterrupted run, one agent)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, base_model, live_processes_mentioning, tiny_config_dict, write_config
from stages.core.config import ConfigError, load_config
from stages.pipeline import plan, run_stage
from stages.runtime.batches import DataPosition, GlobalBatchSampler, collate_packed, collate_padded, split_micro_batches
from stages.launch.launcher import torchrun_command, worker_env
from stages.train import TrainingFailed


def subdir(tmp: Path, name: str) -> Path:
    (tmp / name).mkdir()
    return tmp / name


def make_cfg(tmp: Path, name: str = "config.yaml", **sections):
    raw = tiny_config_dict(tmp, **sections)
    return load_config(write_config(tmp, raw, name))


# --------------------------------------------------------------------------- data (fast)


def test_packed_logits_equal_unpacked_logits(tmp_path):
    from transformers import AutoModelForCausalLM
    cfg = make_cfg(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(base_model(cfg), dtype=torch.float32).eval()
    rng = np.random.default_rng(0)
    samples = [{"input_ids": rng.integers(5, 500, n), "loss_mask": np.ones(n, dtype=np.int8)} for n in (7, 31, 2, 18)]
    packed = collate_packed(samples)
    with torch.no_grad():
        logits = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"], use_cache=False).logits[0]
        start = 0
        for s in samples:
            alone = model(input_ids=torch.as_tensor(s["input_ids"])[None]).logits[0]
            torch.testing.assert_close(logits[start:start + len(s["input_ids"])], alone, atol=1e-5, rtol=1e-4)
            start += len(s["input_ids"])
    # labels: nothing is predicted across a boundary
    assert packed["labels"][0, [0, 7, 38, 40]].tolist() == [-100] * 4


def test_padded_collate_masks_padding():
    b = collate_padded([{"input_ids": np.array([1, 2, 3]), "loss_mask": np.array([0, 1, 1])},
                        {"input_ids": np.array([4]), "loss_mask": np.array([1])}], pad_id=0)
    assert b["labels"].tolist() == [[-100, 2, 3], [4, -100, -100]]
    assert b["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]


def test_epochs_cover_every_sample_once_and_never_reuse_a_batch():
    lengths = np.arange(1, 51)
    s = GlobalBatchSampler(lengths, global_batch_size=16, micro_batch_size=4, world_size=2, seed=3)
    pos, seen = DataPosition(), {0: [], 1: []}
    while pos.epoch < 2:
        batch = s.global_batch(pos)
        seen[pos.epoch].extend(batch.tolist())
        pos = s.advance(pos, len(batch))
    assert sorted(seen[0]) == sorted(seen[1]) == list(range(50))
    assert seen[0] != seen[1]  # reshuffled per epoch
    assert s.steps_per_epoch == 4  # 16+16+16+2: the short last batch is the epoch's own remainder


def test_data_position_is_world_size_independent_and_ranks_are_balanced():
    lengths = np.random.default_rng(0).integers(5, 400, 200)
    s2 = GlobalBatchSampler(lengths, 32, 4, 2, seed=1)
    s4 = GlobalBatchSampler(lengths, 32, 2, 4, seed=1)
    pos = DataPosition(1, 64)
    batch = s2.global_batch(pos)
    assert np.array_equal(batch, s4.global_batch(pos))
    for s in (s2, s4):
        shares = [s.rank_share(batch, r) for r in range(s.world)]
        assert sorted(np.concatenate(shares).tolist()) == sorted(batch.tolist())
        assert len({len(x) for x in shares}) == 1
        tokens = [int(lengths[x].sum()) for x in shares]
        assert max(tokens) - min(tokens) <= lengths[batch].max()


def test_token_budget_micro_batches():
    lengths = np.array([10, 30, 25, 5, 40, 50])
    mbs = split_micro_batches(np.arange(6), lengths, micro_batch_size=2, max_tokens=60)
    assert [x.tolist() for x in mbs] == [[0, 1], [2, 3], [4], [5]]
    assert all(lengths[x].sum() <= 60 for x in mbs)


def test_unknown_model_type_lists_registered_ones(tmp_path):
    cfg = make_cfg(tmp_path, actor={"model": {"model_type": "nope"}})
    from stages.runtime.worker import check_worker_config
    with pytest.raises(ConfigError, match="unknown 'nope'; registered: causal_lm"):
        check_worker_config(cfg)


# --------------------------------------------------------------------------- torchrun (slow)


def train(cfg, env: dict | None = None, p=None):
    """The train stage of `cfg` (of plan `p`: one plan keeps a killed run's folder however the tree
    changes between its starts), `env` set around it."""
    p = p or plan(cfg)
    run_stage(p, "prepare")
    old = dict(os.environ)
    os.environ.update(env or {})
    try:
        return run_stage(p, "train", on_line=lambda line: None)
    finally:
        os.environ.clear()
        os.environ.update(old)


def weights(folder) -> dict:
    return load_file(str(Path(folder) / "model" / "model.safetensors"))


def assert_same_weights(a: dict, b: dict, atol: float):
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst <= atol, worst


# 96 samples / 16 per step = 6 steps per epoch; 2 epochs = 12 steps; step 6 ends epoch 0
RESUME = dict(runner={"max_epochs": 2, "max_steps": -1, "save_interval": 2, "val_check_interval": 4,
                      "keep_checkpoints": 5})


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The RESUME run trained without interruption: what every interrupted run must end as."""
    return train(make_cfg(tmp_path_factory.mktemp("ref"), **RESUME))


def killed(cfg, *faults: str) -> Path:
    """Runs the train stage once per fault (each SIGKILLs the tree); the partial folder left behind."""
    for fault in faults:
        with pytest.raises(TrainingFailed, match="killed by SIGKILL|training failed"):
            train(cfg, {"SFTFLOW_FAULT": fault})
    partial = next(cfg.artifacts_path.joinpath("train").glob(".*.partial"))
    assert not live_processes_mentioning(str(partial)), "a killed run left workers behind"
    return partial


def assert_same_run(done, ref) -> None:
    """Final weights within 1e-6 and every step logged once, with the uninterrupted losses."""
    assert_same_weights(weights(done.path), weights(ref.path), atol=1e-6)
    got = [json.loads(line) for line in (Path(done.path) / "metrics.jsonl").read_text().splitlines()]
    want = [json.loads(line) for line in (Path(ref.path) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in got] == list(range(1, 13))
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], abs=1e-6)


@pytest.mark.slow
def test_resume_after_sigkill_equals_no_interruption(tmp_path, uninterrupted):
    cfg = make_cfg(tmp_path, **RESUME)
    # killed right after the checkpoint at step 6 (exactly the end of epoch 0), then in the middle of saving step 10
    partial = killed(cfg, "after_save:6", "save:10")
    assert (partial / "checkpoints" / "step_00000010.tmp").is_dir()
    assert not (partial / "checkpoints" / "step_00000010.tmp" / "COMPLETE").exists()
    done = train(cfg)
    log = (Path(done.path) / "train.log").read_text()
    assert "resumed from" in log and "at step 6 (epoch 1, 0 samples into it)" in log  # the epoch boundary
    assert "ignoring incomplete checkpoint" in log and "at step 8 (epoch 1, 32 samples into it)" in log
    assert_same_run(done, uninterrupted)


@pytest.mark.slow
def test_a_corrupt_newest_checkpoint_is_skipped_and_training_resumes_from_the_one_before(tmp_path, uninterrupted):
    cfg = make_cfg(tmp_path, **RESUME)
    partial = killed(cfg, "after_save:6")
    newest = partial / "checkpoints" / "step_00000006"
    for data in newest.glob("*.distcp"):  # the disk lost the end of the newest checkpoint's data
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    with open(partial / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "lo')  # and a line torn by the kill
    done = train(cfg)
    log = (Path(done.path) / "train.log").read_text()
    assert f"skipping checkpoint {newest}" in log and "is truncated" in log
    assert "resumed from" in log and "at step 4 " in log
    assert_same_run(done, uninterrupted)


ONE_PROC = {"nproc_per_node": 1, "micro_batch_size": 4, "global_batch_size": 16, "optim": {"lr": 1e-3, "warmup": 1}}
TWO_PROCS = ONE_PROC | {"nproc_per_node": 2}  # the tests of the distributed maths ask for two ranks


# 1 -> 2: test_mixture's resume of a mixture (one run each way; they would check the same twice)
@pytest.mark.parametrize("first, then", [(2, 1)])
@pytest.mark.slow
def test_resume_on_another_world_size(tmp_path, first, then):
    """Checkpointed on `first` processes (sharded, or a plain model for one fp32 process),
    resumed on `then`: DCP reshards, training continues from the same global sample."""
    steps = dict(runner={"max_epochs": 2, "max_steps": 6, "save_interval": 3, "keep_checkpoints": 5})
    ref = train(make_cfg(subdir(tmp_path, "ref"), **steps, actor=TWO_PROCS))

    def cfg_for(nproc: int, name: str):
        # activation checkpointing is execution-only: same fingerprint, same math
        return make_cfg(tmp_path, name, **steps, actor=ONE_PROC | {"activation_checkpointing": True}) if nproc == 1 \
            else make_cfg(tmp_path, name, **steps, actor=TWO_PROCS)
    before, after = cfg_for(first, "before.yaml"), cfg_for(then, "after.yaml")
    assert plan(before).fingerprints["train"] == plan(after).fingerprints["train"]
    with pytest.raises(TrainingFailed):
        train(before, {"SFTFLOW_FAULT": "after_save:3"})
    done = train(after)
    log = (Path(done.path) / "train.log").read_text()
    assert f"at step 3 (epoch 0, 48 samples into it); world size {first} -> {then}" in log
    rows = [json.loads(line) for line in (Path(done.path) / "metrics.jsonl").read_text().splitlines()]
    ref_rows = [json.loads(line) for line in (Path(ref.path) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 7))
    # same samples, same weights, only the reduction order differs
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in ref_rows], abs=1e-5)
    assert_same_weights(weights(done.path), weights(ref.path), atol=1e-4)


@pytest.mark.slow
def test_weights_kept_gathered_between_forward_and_backward_train_like_one_process(tmp_path):
    """FSDP2 over 2 processes, with each block's weights kept gathered through a step (CPU's
    default) and freed after each forward, and no-grad validation forwards between the steps,
    trains like one plain process (no FSDP) on the same samples: losses, val losses, weights."""
    every_step = dict(runner={"max_steps": 4, "val_check_interval": 1, "save_interval": 4})
    two = train(make_cfg(subdir(tmp_path, "two"), **every_step))
    one = train(make_cfg(subdir(tmp_path, "one"), **every_step, actor=ONE_PROC))
    freed = train(make_cfg(subdir(tmp_path, "freed"), **every_step, actor={"reshard_after_forward": True}))

    def logged(run) -> list[dict]:
        return [json.loads(line) for line in (Path(run.path) / "metrics.jsonl").read_text().splitlines()]
    for run in (two, freed):
        rows, ref = logged(run), logged(one)
        assert [r["step"] for r in rows] == [1, 2, 3, 4] and all("val_loss" in r for r in rows)
        for key in ("loss", "val_loss"):
            assert [r[key] for r in rows] == pytest.approx([r[key] for r in ref], abs=1e-5), key
        assert_same_weights(weights(run.path), weights(one.path), atol=1e-4)


@pytest.mark.slow
def test_ranks_start_as_fresh_interpreters_as_on_gpus(tmp_path):
    """local_torchrun starts every rank as torchrun does on GPUs: a fresh interpreter, a child of the
    agent, running the entry as __main__ with its arguments, with torchrun's one thread per rank of two."""
    env = {k: v for k, v in worker_env(2).items() if k != "OMP_NUM_THREADS"}  # torchrun sets it per rank
    env.update(CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-m", "stages.launch.local_torchrun", "--nproc_per_node=2",
           str(ROOT / "tests" / "dist" / "rank_check.py"), str(tmp_path), "extra"]
    agent = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = agent.communicate(timeout=300)[0]
    assert agent.returncode == 0, out[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(r["ppid"] == agent.pid and r["pid"] != agent.pid for r in ranks)
    assert not any(r["forked"] for r in ranks)
    # a fresh interpreter has no torch elastic signal handler of the agent's: SIGTERM is the default
    assert all(r["sigterm"] == "default" for r in ranks)
    assert all(r["threads"] == 1 and r["argv"] == [str(tmp_path), "extra"] and r["main"] == "__main__"
               for r in ranks)


@pytest.mark.slow
def test_sigterm_ends_a_rank_blocked_in_a_collective_at_once_and_reads_as_a_cancel(tmp_path):
    """A stop request (the CLI's SIGTERM or Ctrl-C) while rank 0 waits in a gloo all_reduce: torchrun's
    agent passes SIGTERM on, which ends both ranks (the default handler; a rank forked from the agent
    used to inherit torch elastic's and wait for the SIGKILL 10 s later), and the launcher reports a
    cancel (KeyboardInterrupt), not a rank's failure."""
    import threading

    import psutil

    from stages.core.errors import StageError
    from stages.launch import launcher
    cmd = [sys.executable, "-m", "stages.launch.local_torchrun", "--nproc_per_node=2",
           f"--log-dir={tmp_path / 'elastic'}", str(ROOT / "tests" / "dist" / "blocked_rank.py"), str(tmp_path)]
    ready = [tmp_path / f"rank{r}.ready" for r in (0, 1)]

    def stop_once_blocked():
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not all(f.exists() for f in ready):
            time.sleep(0.1)
        time.sleep(1.0)  # rank 0 is inside the all_reduce by now
        launcher.request_stop()
    threading.Thread(target=stop_once_blocked, daemon=True).start()
    lines: list[str] = []
    try:
        with pytest.raises(KeyboardInterrupt):
            launcher.run_torchrun(cmd, tmp_path / "run.log", StageError, "blocked", on_line=lines.append,
                                  nproc_per_node=2)
    finally:
        launcher._stop_requested.clear()
    pids = [int(f.read_text()) for f in ready]
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    log = "\n".join(lines)
    assert "forcefully exiting via SIGKILL" not in log and "Unable to shutdown" not in log, log[-3000:]


@pytest.mark.slow
def test_two_agents_rendezvous_like_one_agent_with_two_processes(tmp_path):
    one = train(make_cfg(subdir(tmp_path, "one"), actor=TWO_PROCS))  # one agent, two processes
    # The rendezvous store is hosted here, bound to a port the kernel picks (0) and held until both
    # agents are done: each agent finds the endpoint taken and joins it as a client (torch's c10d
    # rendezvous backend falls back so), so no port is picked, released, and raced for meanwhile.
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port = store.port
    cfgs = [make_cfg(tmp_path, f"node{r}.yaml", actor={"nproc_per_node": 1, "nnodes": 2, "node_rank": r,
                                                        "rdzv_endpoint": f"127.0.0.1:{port}", "micro_batch_size": 4,
                                                        "global_batch_size": 16, "optim": {"lr": 1e-3, "warmup": 1}})
            for r in (0, 1)]
    p = plan(cfgs[0])
    assert p.fingerprints["train"] == plan(cfgs[1]).fingerprints["train"]
    run_stage(p, "prepare")
    from stages.core.cache.artifacts import StageBuild
    build = StageBuild(cfgs[0].artifacts_path, "train", p.fingerprints["train"], keep_partial=True)
    procs = []
    for cfg in cfgs:
        spec = {"config": cfg.model_dump(mode="json"), "model_path": base_model(cfg), "out_dir": str(build.partial),
                "train_dir": str(p.folder("prepare") / "train"), "val_dir": str(p.folder("prepare") / "val")}
        spec_path = build.partial / f"spec{cfg.actor.node_rank}.json"
        spec_path.write_text(json.dumps(spec))
        cmd = torchrun_command(cfg, spec_path, "stages.train")
        assert f"--node_rank={cfg.actor.node_rank}" in cmd and "--nnodes=2" in cmd
        cmd[-1] = str(spec_path)
        procs.append(subprocess.Popen(cmd, env=worker_env(2), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    outs = [proc.communicate(timeout=300)[0] for proc in procs]
    assert all(proc.returncode == 0 for proc in procs), outs[0][-3000:] + outs[1][-3000:]
    assert_same_weights(weights(build.partial), weights(one.path), atol=0.0)


@pytest.mark.slow
def test_exported_model_logits_equal_the_trained_model(tmp_path):
    cfg = make_cfg(tmp_path)
    p = plan(cfg)
    run_stage(p, "prepare")
    spec = {"config": cfg.model_dump(mode="json"), "model_path": base_model(cfg), "out_dir": str(tmp_path / "out"),
            "train_dir": str(p.folder("prepare") / "train"), "val_dir": None}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "stages.launch.local_torchrun", "--nproc_per_node=2",
           str(ROOT / "tests" / "dist" / "export_check.py"), str(tmp_path / "spec.json"), str(tmp_path / "logits.pt")]
    proc = subprocess.run(cmd, env=worker_env(2), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    from transformers import AutoModelForCausalLM
    got = torch.load(tmp_path / "logits.pt")
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "model", dtype=torch.float32).eval()
    with torch.no_grad():
        logits = exported(input_ids=got["input_ids"]).logits
    torch.testing.assert_close(logits, got["logits"], atol=1e-5, rtol=1e-5)
    assert (tmp_path / "out" / "model" / "generation_config.json").is_file()
    assert (tmp_path / "out" / "model" / "tokenizer_config.json").is_file()


@pytest.mark.slow
def test_custom_non_hf_model_trains_through_the_same_torchrun_path(tmp_path):
    env = {"PYTHONPATH": str(ROOT / "tests") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cfg = make_cfg(tmp_path, runner={"max_epochs": 3, "max_steps": -1, "val_check_interval": 8, "save_interval": 0},
                   actor={"worker": "custom_model:MLPWorker", "model": {"model_type": "tiny_mlp"},
                          "micro_batch_size": 8, "global_batch_size": 32, "optim": {"lr": 1e-2, "warmup": 1}})
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        result = train(cfg, env)
    finally:
        sys.path.remove(str(ROOT / "tests"))
    rows = [json.loads(line) for line in (Path(result.path) / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 * 16  # 512 samples / 32 per step, 3 epochs
    assert rows[-1]["val_accuracy"] > 0.9 and rows[-1]["loss"] < rows[0]["loss"]
    assert "padded micro-batches" in (Path(result.path) / "train.log").read_text()
    assert set(load_file(str(Path(result.path) / "model" / "model.safetensors"))) == {"0.weight", "0.bias",
                                                                                      "2.weight", "2.bias"}


@pytest.mark.slow
def test_a_worker_crash_is_reported_as_its_root_cause(tmp_path):
    env = {"PYTHONPATH": str(ROOT / "tests") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cfg = make_cfg(tmp_path, actor={"worker": "custom_model:BrokenWorker", "model": {"model_type": "tiny_mlp"},
                                    "micro_batch_size": 8, "global_batch_size": 32})
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        with pytest.raises(TrainingFailed, match=r"training failed \(torchrun exit 1\): rank \d: KeyError: 'y'"):
            train(cfg, env)
        # the cause came from torch elastic's error file (one per failed rank), not from the log's text
        errors = list((cfg.artifacts_path / "train").glob(".*.partial/elastic/*/attempt_0/*/error.json"))
        assert errors and all("KeyError: 'y'" in e.read_text() for e in errors)
        # a project error on one rank is its own line (no rank, no type), as the user reads it in-process
        (tmp_path / "refuse").mkdir()
        cfg = make_cfg(tmp_path / "refuse", actor={"worker": "custom_model:RefusingRankOne", "nproc_per_node": 2,
                                                   "model": {"model_type": "tiny_mlp"}, "micro_batch_size": 8,
                                                   "global_batch_size": 32})
        with pytest.raises(TrainingFailed) as failed:
            train(cfg, env)
        assert str(failed.value).startswith("training failed (torchrun exit 1): custom.key: rank one refuses; "
                                            "full log: ")
        log = next((cfg.artifacts_path / "train").glob(".*.partial/train.log")).read_text()
        assert "custom.key: rank one refuses\n" in log and "Traceback" not in log.split("custom.key")[0][-200:]
    finally:
        sys.path.remove(str(ROOT / "tests"))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_packing_probe_passes_rounding_and_catches_a_leak(tmp_path, precision):
    """`packs_exactly` in each training precision: the builtin model packs (bf16's rounding of a packed
    layout is not a leak), and the same model made to ignore the packed boundaries (position_ids dropped,
    so the second sequence attends to the first) does not."""
    from transformers import AutoModelForCausalLM

    from stages.core.config import config_from_dict
    from stages.runtime.packing import packs_exactly
    cfg = config_from_dict(tiny_config_dict(tmp_path))
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(base_model(cfg), dtype=dtype).eval()
    ids = np.random.RandomState(0).randint(3, model.config.vocab_size, 40)
    data = [{"input_ids": ids}]
    assert packs_exactly(model, data, torch.device("cpu"), precision)
    forward = model.forward
    model.forward = lambda **kw: forward(**{k: v for k, v in kw.items() if k != "position_ids"})
    assert not packs_exactly(model, data, torch.device("cpu"), precision)
