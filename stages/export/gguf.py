"""A Hugging Face chat model folder -> one GGUF file, laid out as llama.cpp's own converter lays it out.

The reference is ggml-org/llama.cpp's convert_hf_to_gguf.py (`ModelBase.prepare_tensors`,
`TextModel.set_gguf_parameters`, `TextModel.get_vocab_base` / `_set_vocab_gpt2`, `LlamaModel`,
`Qwen2Model`) with gguf-py's constants and tensor_mapping (the installed `gguf` package):

  * keys: `general.architecture` (`llama` | `qwen2`), `general.type`, `general.name`,
    `general.size_label`, `general.file_type`, `general.quantization_version`; `<arch>.block_count`,
    `context_length`, `embedding_length`, `feed_forward_length`, `attention.head_count`,
    `attention.head_count_kv`, `rope.freq_base`, `attention.layer_norm_rms_epsilon`
    (`attention.key_length` / `value_length` when config.json has `head_dim`); Llama also
    `vocab_size` and `rope.dimension_count`, as `LlamaModel.set_gguf_parameters` adds them.
  * tensors: gguf-py's names (`token_embd`, `blk.N.attn_q`, ..., `output_norm`, `output`); Llama's
    q_proj / k_proj rows permuted as `LlamaModel.permute` does (llama.cpp's rope is the interleaved
    kind; Qwen2's is not permuted); `lm_head` left out when the embeddings are tied (llama.cpp then
    uses `token_embd`).
  * types: 1-D tensors and norms F32; the rest F32 / F16 / BF16 / Q8_0 by `--type` (Q8_0 falls back
    to F16 for a row that is not a multiple of 32, as llama.cpp does); source BF16 goes through F32.
  * tokenizer: `tokenizer.ggml.model` = gpt2 (byte-level BPE), `tokenizer.ggml.pre` from the
    tokenizer.json's pre-tokenizer (`pre_tokenizer_type`), tokens and types as `get_vocab_base` makes
    them (`[PADn]` up to the config's vocab_size), merges and special ids from `gguf.SpecialVocab`,
    `add_bos_token` / `add_eos_token` as the Hugging Face tokenizer behaves, `eot_token_id` = the
    template's end-of-turn marker, and `tokenizer.chat_template`.

llama.cpp picks `tokenizer.ggml.pre` by hashing the tokenizer's output on a test string against the
models it knows; a fine-tuned model's own tokenizer (the builtin one: trained on the run's data) has
no known hash, so the type is chosen from what the hash stands for: how the tokenizer.json splits
text before BPE. Each accepted form is the one whose llama.cpp regexes (src/llama-vocab.cpp) split
text the same way; any other form is refused, naming it.

The one change to what the folder holds: transformers' `{% generation %}` / `{% endgeneration %}`
template tags (they mark assistant tokens for training masks and render nothing) become
`{% if true %}` / `{% endif %}`, which render the same text everywhere: jinja hosts without the
transformers extension (llama-cpp-python before its fix, other servers) refuse the template otherwise.

Everything that can be refused is refused before anything is written; the file and the Modelfile are
written to temporary names in the output folder and renamed into place at the end.
"""

from __future__ import annotations

import json
import os
import re
import struct
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np

from stages.core.cache.bases import is_adapter
from stages.core.errors import ConfigError
from stages.core.chat.chat_tokens import END_OF_TURN, stop_token_ids
from stages.core.chat.model_card import CARD
from stages.core.machine.process_env import apply_process_policy

Q = gguf.GGMLQuantizationType
# --type -> (general.file_type, the type of every 2-D weight); as convert_hf_to_gguf.py --outtype
TYPES = {
    "f32": (gguf.LlamaFileType.ALL_F32, Q.F32),
    "f16": (gguf.LlamaFileType.MOSTLY_F16, Q.F16),
    "bf16": (gguf.LlamaFileType.MOSTLY_BF16, Q.BF16),
    "q8_0": (gguf.LlamaFileType.MOSTLY_Q8_0, Q.Q8_0),
}
# the Hugging Face class -> llama.cpp's architecture (convert_hf_to_gguf.py: LlamaModel, Qwen2Model)
FAMILIES = {"LlamaForCausalLM": gguf.MODEL_ARCH.LLAMA, "Qwen2ForCausalLM": gguf.MODEL_ARCH.QWEN2}
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

# The pre-tokenizer regexes of tokenizer.json files, as the model repos write them (also quoted in
# llama-vocab.cpp's "original regex from tokenizer.json" comments).
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# llama.cpp's BPE merges: these pre types set `ignore_merges` (llama-vocab.cpp); the others don't
_IGNORE_MERGES = {"llama-bpe"}

_SAFETENSORS_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64}


class ExportError(ConfigError):
    """The folder can't be exported as asked (an unsupported family, type or tokenizer): one line
    naming what and why; nothing is written (exit code 2)."""


@dataclass
class Exported:
    gguf: Path
    modelfile: Path
    architecture: str
    type: str
    pre_tokenizer: str
    tensors: int
    parameters: int
    default_system: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def paths(self) -> list[Path]:
        return [self.gguf, self.modelfile]


# --------------------------------------------------------------------------- the folder and its family

def _trained_on(src: Path) -> str | None:
    """The prepare folder a train stage folder's manifest says it trained on; None for other folders."""
    try:
        return json.loads((src / "manifest.json").read_text()).get("prepare_dir") if (
            (src / "model").is_dir() or is_adapter(src / "adapter")) else None
    except (OSError, ValueError):
        return None


def model_dir(src: Path | str) -> Path:
    """The Hugging Face folder `src` names: a train stage folder (its model/), a model/ folder, any HF folder."""
    path = Path(src).expanduser()
    if (path / "model" / "config.json").is_file():
        return path / "model"
    if (path / "config.json").is_file():
        return path
    if not path.exists():
        raise ExportError(f"{src}: no such folder")
    raise ExportError(f"{src}: neither a Hugging Face model folder (no config.json) nor a train stage folder "
                      "(no model/config.json)")


def check_type(type_: str) -> str:
    t = type_.lower()
    if t not in TYPES:
        raise ExportError(f"--type {type_}: unknown GGUF type; one of {', '.join(TYPES)}")
    return t


def read_config(folder: Path) -> dict:
    try:
        return json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ExportError(f"{folder / 'config.json'}: not readable as JSON ({e})") from None


def family(cfg: dict, folder: Path) -> str:
    """The config's Hugging Face class, if this exporter writes it; a refusal naming it otherwise."""
    archs = cfg.get("architectures") or []
    name = archs[0] if archs else _MODEL_TYPES.get(cfg.get("model_type", ""), cfg.get("model_type") or "?")
    if name not in FAMILIES:
        raise ExportError(f"{folder}: the model is a {name} (model_type {cfg.get('model_type')!r}); GGUF export "
                          f"writes {' and '.join(FAMILIES)} only")
    return name


def _rope(cfg: dict) -> tuple[float, str | None]:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type"))
    theta = params.get("rope_theta", cfg.get("rope_theta"))
    return float(theta if theta is not None else 10000.0), kind


def check_config(cfg: dict, name: str, folder: Path) -> None:
    """What llama.cpp's architecture would compute differently from the Hugging Face model: refused."""
    def refuse(why: str) -> None:
        raise ExportError(f"{folder}: {name} with {why}: not exported (llama.cpp's "
                          f"{gguf.MODEL_ARCH_NAMES[FAMILIES[name]]} would compute a different model)")

    if cfg.get("quantization_config"):
        refuse(f"quantization_config ({cfg['quantization_config'].get('quant_method', '?')}); export the "
               "unquantized model")
    if cfg.get("hidden_act", "silu") != "silu":
        refuse(f"hidden_act {cfg.get('hidden_act')!r}")
    _, kind = _rope(cfg)
    if kind not in (None, "default"):
        refuse(f"rope scaling {kind!r}")
    if name == "LlamaForCausalLM" and (cfg.get("attention_bias") or cfg.get("mlp_bias")):
        refuse("attention_bias / mlp_bias")
    if name == "Qwen2ForCausalLM" and cfg.get("use_sliding_window"):
        refuse("use_sliding_window (llama.cpp's qwen2 attends to the whole context)")
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "rms_norm_eps",
                "max_position_embeddings", "vocab_size"):
        if cfg.get(key) is None:
            raise ExportError(f"{folder / 'config.json'}: no {key}")


# --------------------------------------------------------------------------- weights

def safetensors(folder: Path):
    """(name, array) for every tensor of the folder's safetensors file(s), read with numpy (no torch):
    F32 / F16 as stored, BF16 widened to F32 exactly, F64 narrowed to F32."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise ExportError(f"{folder}: no model.safetensors (a pytorch_model.bin folder: save it with "
                          "save_pretrained(safe_serialization=True) first)")
    for fname in files:
        path = folder / fname
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        data = np.memmap(path, dtype=np.uint8, mode="r")
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if info["dtype"] not in _SAFETENSORS_DTYPES:
                raise ExportError(f"{path}: tensor {name} is {info['dtype']}; GGUF export reads F32, F16, BF16, F64")
            start, end = info["data_offsets"]
            raw = data[8 + n + start:8 + n + end].view(_SAFETENSORS_DTYPES[info["dtype"]]).reshape(info["shape"])
            if info["dtype"] == "BF16":
                raw = (raw.astype(np.uint32) << 16).view(np.float32)
            elif info["dtype"] == "F64":
                raw = raw.astype(np.float32)
            yield name, raw


def permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute`: each head's rows from Hugging Face's rotate-half order to the
    interleaved pairs llama.cpp's rope works on."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def tensor_type(gguf_name: str, data: np.ndarray, want: Q) -> Q:
    """As `ModelBase.prepare_tensors`: 1-D tensors, norms and non-`.weight` tensors stay F32."""
    if data.ndim <= 1 or gguf_name.endswith("_norm.weight") or not gguf_name.endswith(".weight"):
        return Q.F32
    return want


def add_tensors(w: gguf.GGUFWriter, folder: Path, cfg: dict, name: str, want: Q) -> tuple[int, int, list[str]]:
    """Every weight, renamed, permuted (Llama) and converted; (tensors, parameters, notes)."""
    arch = FAMILIES[name]
    n_head = cfg["num_attention_heads"]
    n_kv = cfg.get("num_key_value_heads") or n_head
    tied = bool(cfg.get("tie_word_embeddings", False))
    names = gguf.get_tensor_name_map(arch, cfg["num_hidden_layers"])
    count = params = 0
    notes: list[str] = []
    seen = set()
    for hf_name, data in safetensors(folder):
        seen.add(hf_name)
        if hf_name.endswith((".attention.masked_bias", ".attention.bias", ".rotary_emb.inv_freq")):
            continue
        if hf_name == "lm_head.weight" and tied:
            notes.append("lm_head.weight left out: the embeddings are tied (llama.cpp reuses token_embd)")
            continue
        new_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if new_name is None:
            hint = " (a LoRA adapter that is not merged?)" if "lora" in hf_name.lower() else ""
            raise ExportError(f"{folder}: tensor {hf_name} has no GGUF name for {gguf.MODEL_ARCH_NAMES[arch]}{hint}")
        if data.dtype not in (np.float16, np.float32):
            data = data.astype(np.float32)
        if arch == gguf.MODEL_ARCH.LLAMA:
            if hf_name.endswith(("q_proj.weight", "q_proj.bias")):
                data = permute(data, n_head, n_head)
            elif hf_name.endswith(("k_proj.weight", "k_proj.bias")):
                data = permute(data, n_head, n_kv)
        qtype = tensor_type(new_name, data, want)
        try:
            out = gguf.quants.quantize(data, qtype)
        except gguf.QuantError:
            notes.append(f"{new_name}: rows of {data.shape[-1]} don't divide into {qtype.name} blocks; written F16")
            qtype = Q.F16
            out = gguf.quants.quantize(data, qtype)
        w.add_tensor(new_name, np.ascontiguousarray(out), raw_dtype=qtype)
        count += 1
        params += int(np.prod(data.shape))
    if not tied and "lm_head.weight" not in seen:
        raise ExportError(f"{folder}: config.json says the embeddings are not tied, but there is no lm_head.weight")
    return count, params, notes


# --------------------------------------------------------------------------- tokenizer

def _summary(pre: dict | None) -> str:
    if not pre:
        return "none"
    if pre.get("type") == "Sequence":
        return "Sequence[" + ", ".join(_summary(p) for p in pre.get("pretokenizers", [])) + "]"
    keys = {k: v for k, v in pre.items() if k != "type" and k not in ("trim_offsets",)}
    if isinstance(keys.get("pattern"), dict):
        keys["pattern"] = next(iter(keys["pattern"].values()))
    return f"{pre.get('type')}({', '.join(f'{k}={v!r}' for k, v in keys.items())})"


def _byte_level(p: dict, regex: bool) -> bool:
    return p.get("type") == "ByteLevel" and bool(p.get("use_regex", True)) is regex and not p.get("add_prefix_space")


def _split(p: dict, pattern: str) -> bool:
    return (p.get("type") == "Split" and (p.get("pattern") or {}).get("Regex") == pattern
            and str(p.get("behavior", "")).lower() == "isolated" and not p.get("invert"))


def pre_tokenizer_type(tok_json: dict, where: Path) -> str:
    """llama.cpp's `tokenizer.ggml.pre` for a byte-level BPE tokenizer.json: the type whose regexes
    (llama-vocab.cpp, `llm_tokenizer_bpe`) split text exactly as its pre-tokenizer does.

      ByteLevel(use_regex)                                 -> gpt-2   GPT-2's regex (the builtin tiny-chat)
      Sequence[Digits(individual), ByteLevel(use_regex)]   -> smollm  \\p{N}, then GPT-2's regex (SmolLM/SmolLM2)
      Sequence[Split(Qwen2's regex), ByteLevel(no regex)]  -> qwen2   (Qwen1.5/2/2.5)
      Sequence[Split(Llama 3's regex), ByteLevel(no regex)] -> llama-bpe (Llama 3)
    """
    model = tok_json.get("model") or {}
    if model.get("type") != "BPE":
        raise ExportError(f"{where}: a {model.get('type')} tokenizer; GGUF export writes byte-level BPE tokenizers "
                          "(tokenizer.ggml.model gpt2) only")
    if model.get("byte_fallback") or model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        raise ExportError(f"{where}: a BPE tokenizer with byte_fallback / subword affixes (sentencepiece-style); "
                          "GGUF export writes byte-level BPE tokenizers only")
    norm = tok_json.get("normalizer")
    pre = tok_json.get("pre_tokenizer") or {}
    seq = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    found = None
    if len(seq) == 1 and _byte_level(seq[0], regex=True):
        found = "gpt-2"
    elif (len(seq) == 2 and seq[0].get("type") == "Digits" and seq[0].get("individual_digits")
          and _byte_level(seq[1], regex=True)):
        found = "smollm"
    elif len(seq) == 2 and _split(seq[0], QWEN2_SPLIT) and _byte_level(seq[1], regex=False):
        found = "qwen2"
    elif len(seq) == 2 and _split(seq[0], LLAMA3_SPLIT) and _byte_level(seq[1], regex=False):
        found = "llama-bpe"
    if found is None:
        raise ExportError(f"{where}: the tokenizer's pre-tokenizer {_summary(pre)} splits text like none of "
                          "llama.cpp's pre-tokenizer types this export knows (gpt-2, smollm, qwen2, llama-bpe): "
                          "llama.cpp would tokenize differently than the model was trained")
    # Qwen2's own tokenizer.json has NFC; llama.cpp's converter writes those models as qwen2 all the same
    if norm and not (found == "qwen2" and norm.get("type") == "NFC"):
        raise ExportError(f"{where}: the tokenizer has a normalizer ({norm.get('type')}), which llama.cpp's "
                          f"{found} pre-tokenizer does not apply")
    if bool(model.get("ignore_merges")) != (found in _IGNORE_MERGES):
        raise ExportError(f"{where}: the tokenizer's ignore_merges={bool(model.get('ignore_merges'))} differs from "
                          f"llama.cpp's {found} pre-tokenizer")
    return found


def _looks_special(token: str) -> bool:
    """convert_hf_to_gguf.py's `does_token_look_special`."""
    return (token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
            or (token.startswith("<|") and token.endswith("|>"))
            or (token.startswith("<\uff5c") and token.endswith("\uff5c>"))
            or (token.startswith("<unused") and token.endswith(">")))


def vocab(tok, vocab_size: int, where: Path) -> tuple[list[str], list[int]]:
    """Tokens and token types as `TextModel.get_vocab_base` makes them."""
    ids = tok.get_vocab()
    if max(ids.values()) >= vocab_size:
        raise ExportError(f"{where}: the tokenizer has token ids up to {max(ids.values())}, beyond the model's "
                          f"vocab_size {vocab_size}")
    reverse = {i: t for t, i in ids.items()}
    added = tok.get_added_vocab()
    decoder = tok.added_tokens_decoder
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        token = reverse[i]
        if token in added:
            if not decoder[i].normalized:  # llama.cpp takes control and user tokens as pre-normalized
                token = tok.decode(tok.encode(token, add_special_tokens=False))
            if decoder[i].special or _looks_special(token):
                types.append(gguf.TokenType.CONTROL)
            else:
                token = token.replace("\u2581", " ")
                types.append(gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
        tokens.append(token)
    return tokens, types


_GEN_OPEN = re.compile(r"\{%(-?)\s*generation\s*(-?)%\}")
_GEN_CLOSE = re.compile(r"\{%(-?)\s*endgeneration\s*(-?)%\}")


def portable_template(template: str) -> str:
    """The template with transformers' `{% generation %}` tags as `{% if true %}` blocks: the same text."""
    return _GEN_CLOSE.sub(r"{%\1 endif \2%}", _GEN_OPEN.sub(r"{%\1 if true \2%}", template))


def saved_template(folder: Path) -> str | list[dict] | None:
    """The chat template transformers saves beside tokenizer_config.json (`chat_template.jinja`, plus
    `additional_chat_templates/*.jinja`; `chat_template.json` before), read as gguf-py's `SpecialVocab`
    reads it since gguf 0.18 (older ones read tokenizer_config.json's `chat_template` only)."""
    jinja, as_json = folder / "chat_template.jinja", folder / "chat_template.json"
    if jinja.is_file():
        default = jinja.read_text(encoding="utf-8")
        more = sorted((folder / "additional_chat_templates").glob("*.jinja"))
        return [{"name": "default", "template": default}] + [
            {"name": p.stem, "template": p.read_text(encoding="utf-8")} for p in more] if more else default
    if as_json.is_file():
        return json.loads(as_json.read_text(encoding="utf-8")).get("chat_template")
    return None


def adds_specials(tok) -> tuple[bool, bool]:
    """(add_bos, add_eos): what the Hugging Face tokenizer does to text it encodes with special tokens."""
    bare = tok.encode("Hello world", add_special_tokens=False)
    full = tok.encode("Hello world", add_special_tokens=True)
    bos = tok.bos_token_id is not None and len(full) > len(bare) and full[0] == tok.bos_token_id
    eos = tok.eos_token_id is not None and len(full) > len(bare) and full[-1] == tok.eos_token_id
    return bos, eos


def stop_tokens(tok, folder: Path) -> list[str]:
    """The tokens sftflow's generation stops at (core/chat/chat_tokens.py), the folder's generation config
    read from its file: the export loads no model."""
    gen_file = folder / "generation_config.json"
    eos = json.loads(gen_file.read_text()).get("eos_token_id") if gen_file.is_file() else None
    return [tok.convert_ids_to_tokens(i) for i in stop_token_ids(tok, eos)]


# --------------------------------------------------------------------------- the export

def _safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.") or "model"


def default_name(folder: Path) -> str:
    """The folder's name; for a train stage's model/ (or a train stage folder), the stage folder's."""
    return _safe_name(folder.parent.name if folder.name in ("model", "adapter") else folder.name)


def _temp(out: Path, final: Path) -> Path:
    """A new empty file beside `final`, with the mode an ordinary new file gets (mkstemp's is 0600)."""
    fd, name = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".partial", dir=out)
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(name, 0o666 & ~umask)
    return Path(name)


def export_gguf(src: Path | str, out: Path | str, type_: str = "f16", name: str | None = None,
                max_new_tokens: int | None = None, say=lambda line: None,
                prepare_dir: Path | str | None = None, roots=()) -> Exported:
    """Writes `<out>/<name>-<TYPE>.gguf` and `<out>/Modelfile` for the model `src` names; returns them.
    `prepare_dir`: the prepare folder the model was trained on (a train stage folder's manifest names its
    own), whose rows' system prompt the Modelfile's SYSTEM offers (modelfile.trained_system). A LoRA folder
    (adapter + base.json) is merged first (inference/weights.py; `roots`: artifacts folders whose bases/
    may hold its base, else the MLflow store)."""
    from stages.export.modelfile import ChatML, chatml_form, modelfile_text, trained_system

    type_ = check_type(type_)
    if max_new_tokens is not None and max_new_tokens < 1:
        raise ExportError(f"--max-new-tokens {max_new_tokens}: must be at least 1")
    path = Path(src).expanduser()
    adapter = path / "adapter" if is_adapter(path / "adapter") else path if is_adapter(path) else None
    if adapter is not None:  # a LoRA folder: its base with the adapter merged, then converted as any model
        from stages.inference.weights import save_merged  # torch and peft, for a LoRA folder only
        here = (adapter.parents[2],) if adapter.parent.parent.name == "train" else ()  # train/<fp>/adapter
        with tempfile.TemporaryDirectory() as tmp:
            say(f"merging the LoRA adapter {adapter} into its base")
            try:
                save_merged(adapter, Path(tmp) / "model", roots=(*roots, *here))
            except (ValueError, RuntimeError) as e:  # base.json unreadable, its base nowhere
                raise ExportError(f"{src}: {e}") from None
            return export_gguf(Path(tmp) / "model", out, type_, name or default_name(adapter), max_new_tokens, say,
                               prepare_dir or _trained_on(path))
    folder = model_dir(src)
    cfg = read_config(folder)
    hf_class = family(cfg, folder)
    check_config(cfg, hf_class, folder)
    tok_file = folder / "tokenizer.json"
    if not tok_file.is_file():
        raise ExportError(f"{folder}: no tokenizer.json; GGUF export writes byte-level BPE tokenizers from their "
                          "tokenizer.json")
    tok_json = json.loads(tok_file.read_text())
    pre = pre_tokenizer_type(tok_json, tok_file)
    name = _safe_name(name) if name else default_name(folder)
    file_type, want = TYPES[type_]
    arch = FAMILIES[hf_class]
    arch_name = gguf.MODEL_ARCH_NAMES[arch]

    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(folder))
    special = gguf.SpecialVocab(folder, load_merges=True)
    if special.chat_template is None:
        special.chat_template = saved_template(folder)
    template = special.chat_template
    if isinstance(template, list):  # named templates: the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
    form = None
    if template:
        portable = portable_template(template)
        form = chatml_form(tok, template, portable)
        special.chat_template = portable
    system_note = None
    prepare_dir = prepare_dir or _trained_on(Path(src).expanduser())
    if form is not None and prepare_dir is not None:
        if (Path(prepare_dir) / "train").is_dir():
            system, k, n = trained_system(tok, prepare_dir)
            if system is not None:
                form = ChatML(system)
                system_note = f"SYSTEM: the system prompt {k} of {n} training rows began with ({prepare_dir})"
            elif k:  # rows with system prompts, but no one prompt most of them began with
                system_note = f"no SYSTEM: the most common system prompt began only {k} of {n} training rows"
        else:
            system_note = f"no SYSTEM from the training rows: their prepare folder {prepare_dir} is gone"
    bos, eos = adds_specials(tok)
    special.add_special_token["bos"] = bos
    special.add_special_token["eos"] = eos
    eot = next((tok.convert_tokens_to_ids(t) for t in END_OF_TURN
                if template and t in template and t in tok.get_vocab()), None)
    if eot is not None and "eot" not in special.special_token_ids:
        special.special_token_ids["eot"] = eot
    tokens, types = vocab(tok, cfg["vocab_size"], tok_file)

    w = gguf.GGUFWriter(None, arch_name, use_temp_file=True)
    try:
        say(f"reading {folder} ({hf_class}) into {arch_name} {type_.upper()}")
        n_tensors, n_params, notes = add_tensors(w, folder, cfg, hf_class, want)
        w.add_type(gguf.GGUFType.MODEL)
        w.add_name(name)
        w.add_size_label(gguf.size_label(n_params, 0, 0, 0))
        w.add_block_count(cfg["num_hidden_layers"])
        w.add_context_length(cfg["max_position_embeddings"])
        w.add_embedding_length(cfg["hidden_size"])
        w.add_feed_forward_length(cfg["intermediate_size"])
        w.add_head_count(cfg["num_attention_heads"])
        w.add_head_count_kv(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
        w.add_rope_freq_base(_rope(cfg)[0])
        w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
        if cfg.get("head_dim") is not None:
            w.add_key_length(cfg["head_dim"])
            w.add_value_length(cfg["head_dim"])
        w.add_file_type(file_type)
        if arch == gguf.MODEL_ARCH.LLAMA:
            w.add_vocab_size(cfg["vocab_size"])
            w.add_rope_dimension_count(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types(types)
        if arch == gguf.MODEL_ARCH.LLAMA:
            tc_file = folder / "tokenizer_config.json"
            tc = json.loads(tc_file.read_text()) if tc_file.is_file() else {}
            if tc.get("add_prefix_space") is not None:
                w.add_add_space_prefix(tc["add_prefix_space"])
        special.add_to_gguf(w, quiet=True)

        out = Path(out).expanduser()
        gguf_path = out / f"{name}-{type_.upper()}.gguf"
        modelfile_path = out / "Modelfile"
        text = modelfile_text(gguf_path.name, form, stop_tokens(tok, folder), cfg["max_position_embeddings"],
                              max_new_tokens)
        out.mkdir(parents=True, exist_ok=True)
        temps: list[Path] = []
        try:
            temps.append(_temp(out, gguf_path))
            w.write_header_to_file(path=temps[0])
            w.write_kv_data_to_file()
            w.write_tensors_to_file()
            w.close()
            temps.append(_temp(out, modelfile_path))
            temps[1].write_text(text)
            os.replace(temps[0], gguf_path)
            os.replace(temps[1], modelfile_path)
            card = folder / CARD  # the model card register or train wrote, with what this folder now holds
            if card.is_file():
                temps.append(_temp(out, out / CARD))
                temps[2].write_text(card.read_text(encoding="utf-8").rstrip() + "\n\n## Files\n\n"
                                    f"- `{gguf_path.name}`: GGUF ({type_.upper()}) for llama.cpp and Ollama\n"
                                    f"- `Modelfile`: `ollama create NAME -f Modelfile`\n", encoding="utf-8")
                os.replace(temps[2], out / CARD)
        finally:
            for t in temps:
                t.unlink(missing_ok=True)
    finally:
        w.close()
        if w.temp_file is not None:  # the tensors' spool, when writing never began
            w.temp_file.close()
    if form is None:
        notes.append("the chat template is not ChatML: the Modelfile has no TEMPLATE (Ollama reads "
                     "tokenizer.chat_template from the file)")
    elif system_note:
        notes.append(system_note)
    return Exported(gguf_path, modelfile_path, arch_name, type_, pre, n_tensors, n_params,
                    form.default_system if form else None, notes)


def main(argv: list[str] | None = None) -> int:
    import argparse

    apply_process_policy(os.environ)  # `python -m stages.export`: transformers loads only below
    ap = argparse.ArgumentParser(prog="python -m stages.export",
                                 description="A Hugging Face chat model folder -> GGUF (llama.cpp, Ollama) + Modelfile")
    ap.add_argument("src", help="a train stage folder, its model/ folder, or any Hugging Face model folder")
    ap.add_argument("--out", required=True, help="the folder to write <name>-<TYPE>.gguf and Modelfile into")
    ap.add_argument("--type", default="f16", help=f"one of {', '.join(TYPES)} (default f16)")
    ap.add_argument("--name", default=None, help="the model's name (general.name and the file name)")
    ap.add_argument("--max-new-tokens", type=int, default=None,
                    help="write PARAMETER num_predict N (sftflow's eval.max_new_tokens, to reply as evaluation did)")
    args = ap.parse_args(argv)
    try:
        done = export_gguf(args.src, args.out, args.type, args.name, args.max_new_tokens,
                           say=lambda line: print(line, file=sys.stderr, flush=True))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    for note in done.notes:
        print(f"note: {note}", file=sys.stderr)
    for path in done.paths:
        print(path)
    return 0
