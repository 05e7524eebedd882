import json
from pathlib import Path

import pytest

from conftest import sftflow, tiny_config_dict, write_config
from stages.core.config import ConfigError, apply_overrides, config_from_dict, flatten, hashed, load_config


def test_valid_config_and_dotted_overrides(tiny_config):
    cfg = load_config(tiny_config, ["actor.optim.lr=2e-4", "runner.max_steps=9", "eval.max_new_tokens=3"])
    assert cfg.actor.optim.lr == pytest.approx(2e-4)
    assert cfg.runner.max_steps == 9 and cfg.eval.max_new_tokens == 3
    assert cfg.actor.world_size == 1


def test_default_config_loads_and_covers_the_sections_users_know():
    cfg = load_config("configs/default.yaml")
    keys = flatten(cfg.model_dump())
    for key in ["runner.max_epochs", "runner.max_steps", "runner.val_check_interval", "runner.save_interval",
                "runner.seed", "runner.resume", "actor.nproc_per_node", "actor.nnodes", "actor.micro_batch_size",
                "actor.global_batch_size", "actor.precision", "actor.model.model_type", "actor.model.model_path",
                "actor.model.trust_remote_code", "actor.optim.lr", "actor.optim.weight_decay", "actor.optim.warmup",
                "actor.optim.scheduler", "actor.optim.clip_grad", "data.train_data_paths", "data.val_data_paths",
                "data.format", "data.max_length", "eval.max_new_tokens", "eval.batch_size", "registry.tracking_uri",
                "registry.model_name", "registry.promote"]:
        assert key in keys, key
    assert cfg.actor.nproc_per_node == 2 and cfg.actor.model.model_path.startswith("builtin:")


@pytest.mark.parametrize("override, expected", [
    ("actor.optim.lrr=1", "unknown key 'actor.optim.lrr'"),
    ("actor.micro_batch_size=four", "actor.micro_batch_size"),
    ("actor.global_batch_size=22", "try actor.global_batch_size=20"),
    ("data.train_data_paths=[/nonexistent/train.jsonl]", "'/nonexistent/train.jsonl' does not exist"),
    ("registry.promote=sometimes", "registry.promote"),
    ("actor.kl_to_base=0.5", "actor.kl_to_base needs LoRA"),
])
def test_bad_config_is_one_line_naming_the_key(tmp_path, override, expected):
    path = write_config(tmp_path, tiny_config_dict(tmp_path))
    with pytest.raises(ConfigError) as e:
        load_config(path, [override])
    assert expected in str(e.value)
    assert "\n" not in str(e.value)


def test_unknown_key_lists_known_keys(tmp_path):
    raw = tiny_config_dict(tmp_path)
    raw["runner"]["max_step"] = 3
    with pytest.raises(ConfigError, match="unknown key 'runner.max_step'.*max_steps"):
        config_from_dict(raw)


def test_override_syntax_errors():
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        apply_overrides({}, ["actor.optim.lr"])
    with pytest.raises(ConfigError, match="is a value, not a section"):
        apply_overrides({"actor": {"nnodes": 1}}, ["actor.nnodes.x=1"])


def test_cli_reports_config_errors_with_exit_code_2(tmp_path):
    path = write_config(tmp_path, tiny_config_dict(tmp_path))
    for args in (["run", "-c", str(path), "actor.global_batch_size=22"],
                 ["show", "-c", str(path), "actor.bogus=1"],
                 ["stage", "train", "-c", str(path), "data.max_length=abc"]):
        proc = sftflow(*args, cwd=tmp_path, timeout=120)
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error:"), proc.stderr
        assert "Traceback" not in proc.stderr + proc.stdout
        # nothing ran: no stage folder, no torchrun
        assert not (tmp_path / "artifacts" / "train").exists()


def test_a_folder_as_the_config_is_named_a_folder(tmp_path):
    with pytest.raises(ConfigError, match=rf"config '{tmp_path}' is a folder, not a config file"):
        load_config(tmp_path)
    with pytest.raises(ConfigError, match="config file '.*missing.yaml' not found"):
        load_config(tmp_path / "missing.yaml")
    proc = sftflow("run", "-c", str(tmp_path), cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (f"error: config '{tmp_path}' is a folder, not a config file "
                                   "(e.g. configs/default.yaml)")
    assert not (tmp_path / "artifacts").exists()


def test_stage_without_upstream_names_the_command_to_run(tmp_path):
    path = write_config(tmp_path, tiny_config_dict(tmp_path))
    proc = sftflow("stage", "evaluate", "-c", str(path), cwd=tmp_path, timeout=120)
    assert proc.returncode == 2
    assert "sftflow stage train" in proc.stderr or "sftflow run" in proc.stderr


def test_every_config_key_is_documented(tmp_path):
    doc = (Path(__file__).resolve().parents[1] / "docs" / "config.md").read_text()
    keys = flatten(config_from_dict(tiny_config_dict(tmp_path)).model_dump())
    missing = [k for k in keys if f"`{k}`" not in doc]
    assert not missing, f"undocumented config keys: {missing}"


def test_example_configs_validate():
    for path in sorted((Path(__file__).resolve().parents[1] / "configs").rglob("*.yaml")):
        load_config(path)


# --------------------------------------------------------------------------- actor.nproc_per_node: auto


@pytest.fixture
def gpus(tmp_path, monkeypatch):
    """A fake nvidia-smi listing n GPUs (0: none on PATH at all); the lookup's cache is cleared."""
    from stages.core.machine import topology

    def install(n: int) -> None:
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir(exist_ok=True)
        smi = bin_dir / "nvidia-smi"
        if n:
            smi.write_text("#!/bin/sh\n" + "".join(f"echo '{i}, NVIDIA H200, 143771, 9.0'\n" for i in range(n)))
            smi.chmod(0o755)
        elif smi.exists():
            smi.unlink()
        monkeypatch.setenv("PATH", str(bin_dir) if not n else f"{bin_dir}:/usr/bin:/bin")
        topology._smi_gpus.cache_clear()

    monkeypatch.setattr(topology, "torch_build", lambda: "cuda")  # as on a GPU machine (this one's torch is CPU)
    monkeypatch.setattr(topology, "_torch_gpus", lambda visible: ())  # no nvidia-smi: torch sees none either
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    yield install
    topology._smi_gpus.cache_clear()


def test_nproc_auto_is_one_process_on_cpu_one_per_gpu_and_an_explicit_count_is_obeyed(tmp_path, gpus, monkeypatch):
    def actor(**kw):
        return config_from_dict(tiny_config_dict(tmp_path, actor={"nproc_per_node": "auto", "global_batch_size": 16,
                                                                   "micro_batch_size": 2, **kw})).actor

    gpus(0)
    a = actor()
    assert (a.nproc_per_node, a.world_size) == (1, 1)
    assert a.topology.startswith("1 process: auto: one process on CPU")
    gpus(4)
    a = actor()
    assert (a.nproc_per_node, a.world_size) == (4, 4) and a.topology == (
        "4 processes: auto: one process per visible GPU (4), FSDP2 over them")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,3")
    assert actor().nproc_per_node == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    assert actor().nproc_per_node == 1
    # the user's number wins, on CPU as on GPUs; assigning one later does not keep auto's reason
    for n in (0, 4):
        gpus(n)
        a = actor(nproc_per_node=2)
        assert a.nproc_per_node == 2 and a.topology == "2 processes: actor.nproc_per_node=2 (set in the config)"
    a = actor()
    a.nproc_per_node = 2
    assert a.topology == "2 processes: actor.nproc_per_node=2 (set in the config)"
    # a dump (the plan a Prefect task gets, a worker's spec) keeps `auto`: whoever loads it resolves it again,
    # with its reason, where it runs; a number stays that number
    for value in ("auto", 1, 2):
        dumped = actor(nproc_per_node=value).model_dump(mode="json")["nproc_per_node"]
        assert dumped == value
    assert type(a).model_validate(actor().model_dump(mode="json")).topology == actor().topology


def test_nproc_auto_uses_the_gpus_the_batch_splits_over_and_bad_counts_are_one_line(tmp_path, gpus):
    gpus(4)
    a = config_from_dict(tiny_config_dict(tmp_path, actor={"nproc_per_node": "auto", "micro_batch_size": 4,
                                                           "global_batch_size": 8})).actor
    assert a.nproc_per_node == 2 and a.topology == (
        "2 processes: auto: 2 of 4 visible GPUs, one process each: actor.global_batch_size=8 in micro-batches of 4 "
        "splits evenly over at most 2 processes (a smaller actor.micro_batch_size uses more GPUs)")
    gpus(8)
    for micro, n in ((4, 6), (2, 8), (16, 3)):  # 48 = 4 x 6 x 2 micro-batches; 2 x 8 x 3; 16 x 3 x 1
        assert config_from_dict(tiny_config_dict(tmp_path, actor={"nproc_per_node": "auto", "micro_batch_size": micro,
                                                                  "global_batch_size": 48})).actor.nproc_per_node == n
    with pytest.raises(ConfigError, match=r"actor.global_batch_size=8 must be divisible by micro_batch_size x "
                                          r"world size = 4 x 4 = 16"):
        config_from_dict(tiny_config_dict(tmp_path, actor={"nproc_per_node": 4, "micro_batch_size": 4,
                                                           "global_batch_size": 8}))
    for bad in (0, -1, "two", 1.5, True):
        with pytest.raises(ConfigError) as e:
            config_from_dict(tiny_config_dict(tmp_path, actor={"nproc_per_node": bad}))
        assert str(e.value) == ("<config>: actor.nproc_per_node: must be a number of processes >= 1 or auto "
                                f"(got {bad!r})")


def test_show_says_how_many_processes_train_and_why(tmp_path):
    path = write_config(tmp_path, tiny_config_dict(tmp_path, actor={"nproc_per_node": "auto", "global_batch_size": 16}))
    out = sftflow("show", "-c", str(path), "--json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    shown, cfg = json.loads(out.stdout), load_config(path)
    assert shown["config"]["actor"]["nproc_per_node"] == "auto"  # as written; what it resolved to, and why:
    assert shown["topology"] == cfg.actor.topology and "auto: one process" in cfg.actor.topology


def test_a_config_error_names_where_its_value_came_from(tmp_path):
    """The file for a value written there, the command-line override for one given on the command
    line; a section's own check is not prefixed twice; a missing data file names the config too."""
    cfg = write_config(tmp_path, tiny_config_dict(tmp_path))

    def error(*overrides: str, path=cfg) -> str:
        with pytest.raises(ConfigError) as e:
            load_config(path, list(overrides))
        return str(e.value)
    assert error("actor.foo=1").startswith("command-line override 'actor.foo=1': unknown key 'actor.foo'; ")
    batch = error("actor.global_batch_size=6", "actor.micro_batch_size=4", "actor.nproc_per_node=1")
    assert batch == ("command-line override 'actor.global_batch_size=6': actor.global_batch_size=6 must be divisible "
                     "by micro_batch_size x world size = 4 x 1 = 4; try actor.global_batch_size=4")
    assert error("actor.optim.lr=-1") == ("command-line override 'actor.optim.lr=-1': actor.optim.lr: Input should be "
                                          "greater than 0 (got -1)")
    missing = error(f"data.train_data_paths=[{tmp_path / 'nope.jsonl'}]")
    assert missing.startswith(f"command-line override 'data.train_data_paths=[{tmp_path / 'nope.jsonl'}]': "
                              f"data.train_data_paths: '{tmp_path / 'nope.jsonl'}' does not exist")
    # the same mistakes written in the file name the file; an unrelated override is not blamed
    raw = tiny_config_dict(tmp_path)
    raw["actor"]["foo"] = 1
    assert error("actor.optim.lr=1e-3", path=write_config(tmp_path, raw, "typo.yaml")).startswith(
        f"{tmp_path / 'typo.yaml'}: unknown key 'actor.foo'")
    raw = tiny_config_dict(tmp_path)
    raw["data"]["train_data_paths"] = [str(tmp_path / "gone.jsonl")]
    assert error(path=write_config(tmp_path, raw, "gone.yaml")).startswith(
        f"{tmp_path / 'gone.yaml'}: data.train_data_paths: '{tmp_path / 'gone.jsonl'}' does not exist")


def test_a_rehearsal_kl_weight_is_validated_as_actor_kl_to_base(tmp_path):
    """`pin_rehearsal` makes data.rehearsal.kl_to_base the weight that trains (actor.kl_to_base) through the
    schema's checks: without LoRA it is refused with one line naming the key, and the config is left as it was;
    with LoRA it is set and checked like a value from the file."""
    plain = config_from_dict(tiny_config_dict(tmp_path, data={"rehearsal": {"kl_to_base": 0.5}}))
    with pytest.raises(ConfigError) as e:
        plain.pin_rehearsal([], plain.inputs()["train"])
    assert "data.rehearsal.kl_to_base" in str(e.value) and "needs LoRA" in str(e.value)
    assert "\n" not in str(e.value)
    assert plain.actor.kl_to_base == 0.0
    lora = config_from_dict(tiny_config_dict(tmp_path, data={"rehearsal": {"kl_to_base": 0.5}},
                                             actor={"lora": {"r": 4}}))
    lora.pin_rehearsal([], lora.inputs()["train"])
    assert lora.actor.kl_to_base == 0.5 and lora.actor.lora.r == 4
    assert hashed(lora.actor)["kl_to_base"] == 0.5  # what train's fingerprint reads (`actor`)
    assert lora.actor.world_size == 1 and lora.actor.topology == plain.actor.topology
