"""Checkpoint folders are read without running their code (stages/runtime/saving/checkpoint.py): DCP's
`.metadata` is a pickle, and `--model FOLDER` / `runner.resume=FOLDER` accept any folder. A real
checkpoint, written by the project's own save path, loads through the safe reader exactly as DCP
reads it; a planted `.metadata` that would run code is a one-line CheckpointError naming the
folder, and its code never runs (the marker file it would write stays absent)."""

from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from stages.runtime.saving import checkpoint as ckpt
from stages.runtime.saving.checkpoint import CheckpointError

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int8,
          torch.uint8, torch.bool]


class Tiny(nn.Module):
    """Parameters in four float dtypes and buffers in five more."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(3, 2).to(torch.bfloat16)
        self.c = nn.Parameter(torch.ones(5, dtype=torch.float16))
        self.d = nn.Parameter(torch.ones(2, 2, dtype=torch.float64))
        for dt in DTYPES[4:]:
            self.register_buffer(f"buf_{str(dt).split('.')[1]}", torch.zeros(3, dtype=dt))

    def forward(self, x):
        return self.b(self.a(x).to(torch.bfloat16)).float().sum() + self.c.float().sum() + self.d.float().sum()


def trained(seed: int):
    torch.manual_seed(seed)
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 4)).backward()
    opt.step()
    return model, opt


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint written by `save_checkpoint` (model + AdamW state) in a one-process gloo group."""
    tmp = tmp_path_factory.mktemp("ckpt")
    dist.init_process_group("gloo", init_method=f"file://{tmp / 'store'}", rank=0, world_size=1)
    try:
        model, opt = trained(0)
        path = ckpt.save_checkpoint(tmp / "checkpoints", 2, model, opt,
                                    {"step": 2, "data_position": {}, "scheduler": {}}, keep=2)
        yield path, model, opt
    finally:
        dist.destroy_process_group()


def globals_in(path) -> set:
    """(module, name) of every global a pickle file resolves, by unpickling it (a file we wrote)."""
    found = set()

    class Recording(pickle.Unpickler):
        def find_class(self, module, name):
            found.add((module, name))
            return super().find_class(module, name)
    Recording(io.BytesIO(path.read_bytes())).load()
    return found


def test_a_checkpoint_of_the_save_path_reads_as_dcp_reads_it(saved):
    path, _, _ = saved
    assert ckpt.checkpoint_problem(path) is None
    ours, theirs = ckpt.read_metadata(path), dcp.FileSystemReader(str(path)).read_metadata()
    assert ours.state_dict_metadata == theirs.state_dict_metadata
    assert ours.storage_data == theirs.storage_data and ours.planner_data == theirs.planner_data
    # what a real metadata file references, every dtype included: all allowed, nothing more needed
    found = globals_in(path / ".metadata")
    assert found <= ckpt.METADATA_GLOBALS, found - ckpt.METADATA_GLOBALS
    assert {("torch", str(dt).split(".")[1]) for dt in DTYPES} <= found
    assert ("torch.distributed.checkpoint.metadata", "Metadata") in found


def test_resume_and_evaluate_load_through_the_safe_reader(saved, monkeypatch):
    path, model, opt = saved
    monkeypatch.setattr(pickle, "load", lambda *a, **k: pytest.fail("DCP's own pickle.load was used"))
    fresh, fresh_opt = trained(1)
    assert not torch.equal(fresh.a.weight, model.a.weight)
    state, _ = ckpt.load_checkpoint(path, fresh, fresh_opt)
    assert state["step"] == 2
    for (k, v), w in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(v, w), k
    for k, v in opt.state_dict()["state"][0].items():
        assert torch.equal(torch.as_tensor(v), torch.as_tensor(fresh_opt.state_dict()["state"][0][k])), k
    other, _ = trained(2)  # evaluate's path: the model half, one process
    loaded = ckpt.load_model_weights(other, str(path))
    assert loaded.keys() == model.state_dict().keys()
    for k, v in model.state_dict().items():
        assert torch.equal(v, other.state_dict()[k]), k


def test_a_no_dist_checkpoint_of_other_dtypes_loads(tmp_path):
    """`dcp.save(no_dist=True)`, as tests and users write one for `--model`: float8 and complex too."""
    state = {"w": torch.arange(6.0).reshape(2, 3), "h": torch.ones(3, dtype=torch.complex64),
             "f8": torch.zeros(4, dtype=torch.float8_e4m3fn), "extra": {"note": "bytes", "n": 3}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": state}, checkpoint_id=str(tmp_path), no_dist=True)
    assert globals_in(tmp_path / ".metadata") <= ckpt.METADATA_GLOBALS
    md = ckpt.read_metadata(tmp_path)
    assert md.state_dict_metadata == dcp.FileSystemReader(str(tmp_path)).read_metadata().state_dict_metadata
    assert md.state_dict_metadata["model.f8"].properties.dtype == torch.float8_e4m3fn


# --------------------------------------------------------------------------- planted pickles


class _Call:
    """Pickles as a call of `fn(*args)`: what a crafted `.metadata` does."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def payloads(marker) -> dict:
    """Pickles that write `marker` when unpickled by pickle.load, the way DCP reads `.metadata`."""
    import builtins
    from torch.distributed.checkpoint.metadata import Metadata
    write = f"open({str(marker)!r}, 'w').write('pwned')"

    class Evil:
        def __reduce__(self):
            return os.system, (f"touch '{marker}'",)

    # a genuine Metadata object with the payload in one of its fields
    inner = Metadata(state_dict_metadata={}, planner_data=_Call(builtins.exec, write))
    return {
        "os.system": pickle.dumps(Evil()),
        "builtins.exec": pickle.dumps(_Call(builtins.exec, write)),
        "inside real Metadata": pickle.dumps(inner),
        "protocol 0": pickle.dumps(_Call(builtins.exec, write), protocol=0),
        "subprocess": pickle.dumps(_Call(subprocess.call, ["touch", str(marker)])),
        "INST opcode": f"(S'touch {marker}'\nios\nsystem\n.".encode(),
    }


@pytest.fixture
def planted(tmp_path):
    marker = tmp_path / "marker"
    found = payloads(marker)
    for blob in found.values():  # each payload does run under plain pickle: the test is not vacuous
        pickle.loads(blob)
        assert marker.exists()
        marker.unlink()
    return marker, found


def plant(folder, blob: bytes, name: str = ".metadata"):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_bytes(blob)
    (folder / "trainer_state.json").write_text(json.dumps({"step": 1, "data_position": {}, "scheduler": {}}))
    (folder / ckpt.COMPLETE).write_text("1")
    return folder


def test_a_planted_metadata_is_a_one_line_error_and_runs_nothing(tmp_path, planted):
    marker, found = planted
    for what, blob in found.items():
        folder = plant(tmp_path / what.replace(" ", "_") / "step_00000001", blob)
        with pytest.raises(CheckpointError) as e:
            ckpt.read_metadata(folder)
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith(f"checkpoint {folder}: .metadata "), (what, msg)
        assert not marker.exists(), what
        # the resume check names the problem; resume=auto skips the checkpoint with a warning
        assert ckpt.checkpoint_problem(folder) == e.value.problem
        warned = []
        assert ckpt.newest_usable(folder.parent, warned.append) is None
        assert warned == [f"skipping checkpoint {folder}: {e.value.problem}; falling back to the one before it"]
        # evaluate --model FOLDER
        with pytest.raises(CheckpointError, match="^checkpoint "):
            ckpt.load_model_weights(Tiny(), str(folder))
        assert not marker.exists(), what
    assert f"checkpoint {tmp_path / 'os.system' / 'step_00000001'}: .metadata references posix.system, " in \
        str(pytest.raises(CheckpointError, ckpt.read_metadata, tmp_path / "os.system" / "step_00000001").value)


def test_resume_from_a_planted_checkpoint_stops_before_dcp(tmp_path, planted):
    marker, found = planted
    folder = plant(tmp_path / "step_00000001", found["os.system"])
    model = Tiny()
    with pytest.raises(CheckpointError):
        ckpt.load_checkpoint(folder, model, torch.optim.AdamW(model.parameters()))
    assert not marker.exists()


def test_dcp_rank_local_fallback_is_read_safely_too(tmp_path, planted):
    """Without `.metadata`, DCP falls back to `__<rank>.metadata`: the safe reader serves both."""
    marker, found = planted
    folder = plant(tmp_path / "ranked", found["builtins.exec"], name="__0.metadata")
    with pytest.raises(dcp.api.CheckpointException, match=r"__0\.metadata references builtins\.exec"), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to load in a single process"
        dcp.load({"model": {}}, storage_reader=ckpt.SafeReader(str(folder)), no_dist=True)
    assert not marker.exists()


def test_state_can_only_be_set_on_fresh_metadata_objects(tmp_path):
    """BUILD on an allowed *class* would set attributes process-wide (PosixPath's cached string: every
    path in the process would name the attacker's file); on an enum member, change a shared constant."""
    import pathlib
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    def build(target_global: bytes, state: bytes) -> bytes:  # proto 2: GLOBAL target, state, BUILD, STOP
        return b"\x80\x02" + target_global + state + b"b."
    on_class = build(b"cpathlib\nPosixPath\n", b"N}X\x04\x00\x00\x00_strX\x09\x00\x00\x00/tmp/evils\x86")
    on_member = (b"\x80\x02ctorch.distributed.checkpoint.metadata\n_MEM_FORMAT_ENCODING\n"
                 b"K\x01\x85R}X\x06\x00\x00\x00_name_X\x01\x00\x00\x00xsb.")
    for blob in (on_class, on_member):
        folder = plant(tmp_path / str(len(blob)), blob)
        with pytest.raises(CheckpointError, match="sets the state of a"):
            ckpt.read_metadata(folder)
    assert str(pathlib.PosixPath("/a")) == "/a"
    assert _MEM_FORMAT_ENCODING(1).name == "TORCH_CHANNELS_LAST"


def test_a_damaged_or_foreign_metadata_is_one_line(tmp_path, saved):
    path, _, _ = saved
    cases = {"truncated": (path / ".metadata").read_bytes()[:50], "not a pickle": b"hello",
             "a dict": pickle.dumps({"state_dict_metadata": {}})}
    for what, blob in cases.items():
        folder = plant(tmp_path / what.replace(" ", "_"), blob)
        with pytest.raises(CheckpointError) as e:
            ckpt.read_metadata(folder)
        assert "\n" not in str(e.value) and str(folder) in str(e.value), what
    missing = tmp_path / "empty"
    missing.mkdir()
    assert ckpt.checkpoint_problem(plant(missing, b"", name="unused")) == ".metadata can't be read (FileNotFoundError)"


def test_evaluate_model_folder_fails_in_one_line_naming_it(tmp_path, planted):
    """`sftflow stage evaluate --model FOLDER`'s loader (a checkpoint folder, one process): the
    CheckpointError (a StageError: one line, exit code 1) passes through unwrapped, and nothing ran."""
    from conftest import base_model, tiny_config_dict, write_config
    from stages.core.config import load_config
    from stages.evaluate.runner import load_model
    marker, found = planted
    cfg = load_config(write_config(tmp_path, tiny_config_dict(tmp_path)))
    folder = plant(tmp_path / "evil", found["os.system"])
    with pytest.raises(CheckpointError) as e:
        load_model(cfg, {"kind": "checkpoint", "path": str(folder)}, base_model(cfg), torch.device("cpu"))
    assert str(e.value).startswith(f"checkpoint {folder}: .metadata references posix.system")
    assert not marker.exists()


@pytest.mark.parametrize("how", ["evaluate --model", "runner.resume"])
def test_a_planted_checkpoint_named_on_the_command_line_is_refused_before_anything_runs(tmp_path, planted, how):
    """From outside, as a user would hand over a folder: one line naming the key and the folder, exit 2,
    the payload never runs, and nothing is started or written (no Prefect home, no stage folder)."""
    from conftest import sftflow, tiny_config_dict, write_config
    marker, found = planted
    folder = plant(tmp_path / "downloaded" / "step_00000001", found["os.system"])
    cfg_path = write_config(tmp_path, tiny_config_dict(tmp_path))
    args = (["stage", "evaluate", "-c", str(cfg_path), "--model", str(folder)] if how == "evaluate --model" else
            ["run", "-c", str(cfg_path), f"runner.resume={folder}"])
    proc = sftflow(*args, cwd=tmp_path, timeout=120, env={"PREFECT_HOME": None})
    key = "eval.model" if how == "evaluate --model" else "runner.resume"
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"error: {key}: checkpoint {folder}: .metadata references posix.system, which DCP metadata never does: "
        "not loaded (unpickling it would run code; a crafted or foreign checkpoint?)"], proc.stderr
    assert not marker.exists() and not (tmp_path / "artifacts").exists()
