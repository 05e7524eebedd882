"""GGUF export (stages/export, issue 49): a Hugging Face chat model folder -> a GGUF file for llama.cpp
and Ollama, and a Modelfile beside it.

The export is read back by a reader that shares no code with it: transformers' GGUF loader, which
builds the model from the file's keys and tensors (de-permuting Llama's q/k rows itself) and the
tokenizer from its vocabulary, merges and special ids. Two tiny models, seeded, with weights, norms
and biases drawn at random so that a misplaced or mis-permuted tensor shows in the logits:
  * Qwen2: the builtin `tiny-chat` (stages/models/builtin.py: tied embeddings, GPT-2-style byte-level
    BPE trained on the demo data, the ChatML template with `{% generation %}` tags);
  * Llama: SmolLM2's layout (tied embeddings, rope_theta 100000, digits split before byte-level BPE,
    SmolLM2's template with its default system prompt).
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from conftest import DEMO, ROOT
from stages.export import ExportError, export_gguf
from stages.export import gguf as exporter
from stages.export.modelfile import OLLAMA_CHATML

SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

PROMPTS = [
    [{"role": "user", "content": "Repeat after me: light happy seven"}],
    [{"role": "system", "content": "You are TinyChat."}, {"role": "user", "content": "Repeat after me: a b"},
     {"role": "assistant", "content": "You said: a b"}, {"role": "user", "content": "again, 12 times"}],
    [{"role": "user", "content": "Who are you? 你是谁？ Ça va?  3.14 -- I'll see  you\n\tthere."}],
]

# The logits of the reloaded model against the original's: max |difference| over every position of
# PROMPTS, as a fraction of the prompt's largest |logit|. Measured (docs/export.md), qwen2 / llama:
# f32 0 / 0 (bit-exact), f16 1.1e-3 / 1.2e-3, bf16 1.1e-2 / 1.0e-2, q8_0 2.7e-2 / 3.5e-2; the bounds
# are about 3x that. Each weight's own rounding is checked exactly in test_each_weight_rounds_...
# (a tiny random network amplifies it; the measure depends on the model, the bound on the type).
TOLERANCE = {"f32": 1e-6, "f16": 5e-3, "bf16": 5e-2, "q8_0": 1e-1}

# The regexes llama.cpp splits text with before BPE, per pre-tokenizer type: src/llama-vocab.cpp,
# `llm_tokenizer_bpe::llm_tokenizer_bpe` (the "adapted" forms it runs), transcribed for this test
# independently of the exporter's own table (which reads tokenizer.json forms).
LLAMA_CPP_REGEXES = {
    "gpt-2": [r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"],
    "smollm": [r"\p{N}", r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"],
    "qwen2": [r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "llama-bpe": [r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
}
# convert_hf_to_gguf.py's `get_vocab_base_pre` test string: what llama.cpp hashes to tell pre-tokenizers apart
CHKTXT = ("\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) "
          "✅ 🦙🦙 "
          "3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ "
          "------======= нещо на Български ''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, "
          "'RE you sure? 'M not sure I'll make it, 'D you like some tea? We'Ve a'lL")


# --------------------------------------------------------------------------- the two tiny models

def _noisy(model, seed: int) -> None:
    """Weights that make every tensor count: matrices ~N(0, 1/fan_in) (a gain of about 1 per layer, as
    in a trained model), norms around 1 and biases around 0 but neither equal to it."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.2 * noise if "norm" in name else 0.1 * noise if p.dim() == 1 else noise / p.shape[-1] ** 0.5)


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory) -> Path:
    """The builtin tiny-chat folder as the models stage builds it, with noisy weights."""
    from transformers import AutoModelForCausalLM

    from stages.models.builtin import BUILTINS, build_tiny_chat
    out = tmp_path_factory.mktemp("qwen2") / "tiny-chat"
    build_tiny_chat(out, [DEMO / "train.jsonl"], **BUILTINS["tiny-chat"])
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    _noisy(model, 1)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    """A SmolLM2-shaped Llama: digits split before byte-level BPE, SmolLM2's specials and template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    out = tmp_path_factory.mktemp("llama") / "tiny-llama"
    texts = [m["content"] for line in (DEMO / "train.jsonl").read_text().splitlines()
             for m in json.loads(line)["messages"]]
    texts += [m["content"] for p in PROMPTS for m in p] + [CHKTXT, SMOLLM2_SYSTEM]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts * 3, trainers.BpeTrainer(
        vocab_size=700, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                     pad_token="<|im_end|>", unk_token="<|endoftext|>", model_max_length=1024)
    hf_tok.chat_template = SMOLLM2_TEMPLATE
    hf_tok.save_pretrained(out)
    config = LlamaConfig(vocab_size=len(hf_tok), hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         rms_norm_eps=1e-5, rope_theta=100000.0,  # v5 reads it into rope_parameters
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    _noisy(model, 2)
    model.generation_config = GenerationConfig(eos_token_id=2, pad_token_id=2, do_sample=False)
    model.save_pretrained(out)
    return out


@pytest.fixture
def folders(qwen2_dir, llama_dir) -> dict:
    return {"qwen2": qwen2_dir, "llama": llama_dir}


def _reload(done):
    """The exported model, as transformers' GGUF loader builds it, and its tokenizer as sftflow reads a GGUF's
    (transformers' with the eos token the file names: 4.x's reader takes another)."""
    from transformers import AutoModelForCausalLM

    from stages.models.from_gguf import gguf_tokenizer
    folder, name = str(done.gguf.parent), done.gguf.name
    return (AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval(),
            gguf_tokenizer(done.gguf))


def _original(folder: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    return (AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval(),
            AutoTokenizer.from_pretrained(folder))


def _gguf_fields(path: Path) -> dict:
    reader = gguf.GGUFReader(str(path))
    return {k: _contents(f) for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def _contents(field):
    """`ReaderField.contents()` (gguf >= 0.16); read from the field's parts as it does where the reader lacks it."""
    if hasattr(field, "contents"):
        return field.contents()
    text = lambda part: part.tobytes().decode("utf-8")  # noqa: E731
    if field.types[0] == gguf.GGUFValueType.ARRAY:
        if field.types[-1] == gguf.GGUFValueType.STRING:
            return [text(field.parts[i]) for i in field.data]
        return [v for i in field.data for v in field.parts[i].tolist()]
    return text(field.parts[-1]) if field.types[0] == gguf.GGUFValueType.STRING else field.parts[-1].tolist()[0]


def _logit_error(model_a, model_b, tok, prompts) -> float:
    """max |logit difference| over every position of every prompt, relative to the largest |logit|."""
    worst = 0.0
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([tok.apply_chat_template(p, tokenize=True, add_generation_prompt=True,
                                                        return_dict=True)["input_ids"]])
            a, b = model_a(input_ids=ids).logits, model_b(input_ids=ids).logits
            worst = max(worst, ((a - b).abs().max() / a.abs().max()).item())
    return worst


# --------------------------------------------------------------------------- the model survives

@pytest.mark.parametrize("type_", ["f32", "f16", "bf16", "q8_0"])
@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_the_export_reloads_with_the_same_logits(folders, family, type_, tmp_path):
    done = export_gguf(folders[family], tmp_path, type_, name=f"tiny-{family}")
    assert done.gguf == tmp_path / f"tiny-{family}-{type_.upper()}.gguf" and done.modelfile == tmp_path / "Modelfile"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([done.gguf.name, "Modelfile"])  # no leftovers
    fields = _gguf_fields(done.gguf)
    assert fields["general.architecture"] == family and fields["general.file_type"] == exporter.TYPES[type_][0]
    want, tok = _original(folders[family])
    got, _ = _reload(done)
    error = _logit_error(want, got, tok, PROMPTS)
    print(f"{family} {type_}: max relative logit error {error:.2e}")
    assert error <= TOLERANCE[type_], f"{family} {type_}: {error:.2e} > {TOLERANCE[type_]:.0e}"


# |stored - original| per element: round to nearest F16 (11 significant bits) / BF16 (8 bits); Q8_0
# blocks of 32 along a row, d = max|x| / 127 stored as F16, so at most max|row| * (1/254 + 1/2048)
ROUNDING = {"f32": lambda w: torch.zeros_like(w), "f16": lambda w: w.abs() * 2 ** -11 + 2 ** -24,
            "bf16": lambda w: w.abs() * 2 ** -8 + 2 ** -126,
            "q8_0": lambda w: w.abs().amax(-1, keepdim=True) * (1 / 254 + 1 / 2048) + 2 ** -24}


@pytest.mark.parametrize("type_", ["f32", "f16", "bf16", "q8_0"])
@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_each_weight_rounds_as_its_type_does_and_nothing_else(folders, family, type_, tmp_path):
    """Every weight of the reloaded model (Llama's q/k de-permuted by transformers) is the original one
    rounded to the type: 1-D tensors (norms, biases) exactly, as llama.cpp keeps them F32."""
    want, _ = _original(folders[family])
    got, _ = _reload(export_gguf(folders[family], tmp_path, type_))
    have = got.state_dict()
    for name, w in want.state_dict().items():
        bound = ROUNDING[type_](w) if w.dim() == 2 else torch.zeros_like(w)
        assert (have[name] - w).abs().le(bound).all(), f"{name}: {(have[name] - w).abs().max():.2e}"


def test_f32_is_exact_and_types_are_laid_out_as_llama_cpp_does(folders, tmp_path):
    """F32: the very numbers. Q8_0: every matrix quantized, token_embd included; norms stay F32."""
    reader = gguf.GGUFReader(str(export_gguf(folders["llama"], tmp_path / "q", "q8_0").gguf))
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types["token_embd.weight"] == gguf.GGMLQuantizationType.Q8_0
    assert types["blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.Q8_0
    assert types["blk.0.attn_norm.weight"] == types["output_norm.weight"] == gguf.GGMLQuantizationType.F32
    assert "output.weight" not in types  # tied: llama.cpp uses token_embd
    assert len(types) == 2 + 2 * 9  # embeddings, final norm; per block 7 matrices, 2 norms
    bf16 = export_gguf(folders["qwen2"], tmp_path / "b", "bf16").gguf
    qwen = {t.name: t.tensor_type for t in gguf.GGUFReader(str(bf16)).tensors}
    assert qwen["blk.0.attn_q.bias"] == gguf.GGMLQuantizationType.F32  # biases: F32, as llama.cpp writes them
    assert qwen["blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.BF16

    want, _ = _original(folders["qwen2"])
    got, _ = _reload(export_gguf(folders["qwen2"], tmp_path / "f", "f32"))
    for (name, a), (_, b) in zip(sorted(want.state_dict().items()), sorted(got.state_dict().items())):
        assert torch.equal(a, b), name


def test_a_bf16_sharded_folder_is_read_exactly(folders, tmp_path):
    """SmolLM2 ships BF16 weights, bigger models ship shards: BF16 is widened without rounding, so a
    BF16 export holds the very numbers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    src = tmp_path / "bf16"
    model = AutoModelForCausalLM.from_pretrained(folders["llama"], dtype=torch.bfloat16)
    model.save_pretrained(src, max_shard_size="100KB")
    AutoTokenizer.from_pretrained(folders["llama"]).save_pretrained(src)
    assert (src / "model.safetensors.index.json").is_file()
    got, _ = _reload(export_gguf(src, tmp_path / "out", "bf16"))
    have = got.state_dict()
    for name, w in model.state_dict().items():
        assert torch.equal(have[name], w.float()), name


def test_the_permutation_is_what_the_check_sees(folders, tmp_path, monkeypatch):
    """Negative control: without llama.cpp's q/k row permutation, the reloaded Llama (which transformers
    de-permutes) computes something else; the permutation alone makes it exact."""
    want, tok = _original(folders["llama"])
    monkeypatch.setattr(exporter, "permute", lambda w, n_head, n_head_kv: w)
    got, _ = _reload(export_gguf(folders["llama"], tmp_path, "f32"))
    assert _logit_error(want, got, tok, PROMPTS) > 1e-2


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_greedy_replies_are_the_same(folders, family, tmp_path):
    """sftflow's own generation (greedy, its stop tokens) replies the same from the reloaded f16 model
    (the tokenizer is the original's: test_the_tokenizer_... checks the reloaded one)."""
    from stages.inference.generation import generate
    model, tok = _original(folders[family])
    want = generate(model, tok, PROMPTS, max_new_tokens=12, batch_size=4)
    got = generate(_reload(export_gguf(folders[family], tmp_path, "f16"))[0], tok, PROMPTS, max_new_tokens=12,
                   batch_size=4)
    assert [r["text"] for r in got] == [r["text"] for r in want]


# --------------------------------------------------------------------------- the tokenizer survives

@pytest.mark.parametrize("family,pre", [("qwen2", "gpt-2"), ("llama", "smollm")])
def test_the_tokenizer_template_and_special_ids_survive(folders, family, pre, tmp_path):
    done = export_gguf(folders[family], tmp_path, "f16")
    fields = _gguf_fields(done.gguf)
    _, want = _original(folders[family])
    _, got = _reload(done)
    assert fields["tokenizer.ggml.model"] == "gpt2" and fields["tokenizer.ggml.pre"] == pre == done.pre_tokenizer
    im_end = want.convert_tokens_to_ids("<|im_end|>")
    assert fields["tokenizer.ggml.eos_token_id"] == fields["tokenizer.ggml.eot_token_id"] == im_end
    assert fields["tokenizer.ggml.add_bos_token"] is False and fields["tokenizer.ggml.add_eos_token"] is False
    assert len(fields["tokenizer.ggml.tokens"]) == len(want) and got.eos_token == want.eos_token == "<|im_end|>"
    assert fields["tokenizer.chat_template"] == exporter.portable_template(want.chat_template)
    assert ("{% generation %}" in want.chat_template) == (family == "qwen2")
    assert got.get_vocab() == want.get_vocab()
    assert json.loads(got.backend_tokenizer.to_str())["model"]["merges"] == \
        json.loads(want.backend_tokenizer.to_str())["model"]["merges"]
    if pre == "smollm":
        # transformers' GGUF reader has no splitter for smollm (it falls back to GPT-2's regex, which keeps
        # "  3" together); llama.cpp splits digits first: give the reader llama.cpp's regexes for the type
        from tokenizers import Regex, pre_tokenizers
        got.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in LLAMA_CPP_REGEXES[pre]]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    for p in PROMPTS + [[{"role": "user", "content": CHKTXT}]]:
        text = want.apply_chat_template(p, tokenize=False, add_generation_prompt=True)
        assert got.apply_chat_template(p, tokenize=False, add_generation_prompt=True) == text
        for specials in (False, True):  # sftflow encodes rendered chats without adding specials
            assert (got(text, add_special_tokens=specials)["input_ids"]
                    == want(text, add_special_tokens=specials)["input_ids"])


def _variant(folder: Path, tmp: Path, pre_tokenizer: dict, **model) -> Path:
    """A copy of `folder` whose tokenizer.json has another pre-tokenizer (and BPE settings)."""
    out = tmp / "variant"
    shutil.copytree(folder, out)
    tj = json.loads((out / "tokenizer.json").read_text())
    tj["pre_tokenizer"] = pre_tokenizer
    tj["model"].update(model)
    (out / "tokenizer.json").write_text(json.dumps(tj))
    return out


def _split_then_bytes(pattern: str) -> dict:
    return {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}


@pytest.mark.parametrize("case", ["gpt-2", "smollm", "qwen2", "llama-bpe"])
def test_llama_cpp_splits_text_as_the_tokenizer_does(folders, case, tmp_path):
    """The pre type written makes llama.cpp split text before BPE as the model's tokenizer does: the
    tokenizer with its pre-tokenizer replaced by llama.cpp's regexes for that type encodes llama.cpp's
    own test string (and the prompts) to the same ids."""
    from tokenizers import Regex, Tokenizer, pre_tokenizers
    folder = {"gpt-2": folders["qwen2"], "smollm": folders["llama"]}.get(case)
    if case == "qwen2":
        folder = _variant(folders["qwen2"], tmp_path, _split_then_bytes(exporter.QWEN2_SPLIT))
    elif case == "llama-bpe":
        folder = _variant(folders["qwen2"], tmp_path, _split_then_bytes(exporter.LLAMA3_SPLIT), ignore_merges=True)
    tj = json.loads((folder / "tokenizer.json").read_text())
    assert exporter.pre_tokenizer_type(tj, folder) == case
    hf = Tokenizer.from_file(str(folder / "tokenizer.json"))
    llama_cpp = Tokenizer.from_file(str(folder / "tokenizer.json"))
    llama_cpp.normalizer = None
    llama_cpp.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in LLAMA_CPP_REGEXES[case]]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    for text in [CHKTXT, *(m["content"] for p in PROMPTS for m in p)]:
        assert llama_cpp.encode(text).ids == hf.encode(text).ids, text


@pytest.mark.parametrize("pre_tokenizer,why", [
    ({"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always", "split": False}, "Metaspace"),
    ({"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}, "add_prefix_space=True"),
    (_split_then_bytes(r"\p{L}+|\s+"), "Split"),
])
def test_a_tokenizer_llama_cpp_would_split_otherwise_is_refused(folders, pre_tokenizer, why, tmp_path):
    folder = _variant(folders["qwen2"], tmp_path, pre_tokenizer)
    with pytest.raises(ExportError, match=f"pre-tokenizer .*{why}.*none of llama.cpp's") as e:
        export_gguf(folder, tmp_path / "out", "f16")
    assert "\n" not in str(e.value) and not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- the Modelfile

def _go_template(template: str, messages: list[dict]) -> str:
    """Ollama's Go template for the subset the Modelfile uses: `{{- ... -}}` trimming, `range .Messages`,
    `.Role`, `.Content`, `end`."""
    import re
    parts = re.split(r"\{\{(-?)\s*(.*?)\s*(-?)\}\}", template)
    texts, actions = parts[0::4], list(zip(parts[1::4], parts[2::4], parts[3::4]))
    for i, (left, _, right) in enumerate(actions):
        if left:
            texts[i] = texts[i].rstrip()
        if right:
            texts[i + 1] = texts[i + 1].lstrip()
    out, i, loop_start, items, k = [], 0, None, [], 0
    scope: dict = {}
    while True:
        out.append(texts[i])
        if i == len(actions):
            return "".join(out)
        action = actions[i][1]
        if action == "range .Messages":
            loop_start, items, k = i, messages, 0
            if not items:
                raise AssertionError("empty range")
            scope = items[0]
        elif action == "end":
            k += 1
            if k < len(items):
                scope, i = items[k], loop_start
        else:
            out.append(scope[{".Role": "role", ".Content": "content"}[action]])
        i += 1


def _modelfile(path: Path) -> dict:
    import re
    text = path.read_text()
    found = {"FROM": re.search(r"^FROM (.+)$", text, re.M)[1],
             "TEMPLATE": (re.search(r'^TEMPLATE """(.*?)"""$', text, re.M | re.S) or [None, None])[1],
             "SYSTEM": (re.search(r'^SYSTEM """(.*?)"""$', text, re.M | re.S) or [None, None])[1],
             "PARAMETER": re.findall(r"^PARAMETER (\w+) (.+)$", text, re.M)}
    return found


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_the_modelfile_renders_chats_as_the_chat_template_does(folders, family, tmp_path):
    done = export_gguf(folders[family], tmp_path, "q8_0", name="tiny", max_new_tokens=64)
    mf = _modelfile(done.modelfile)
    assert mf["FROM"] == "./tiny-Q8_0.gguf" and mf["TEMPLATE"] == OLLAMA_CHATML
    assert mf["SYSTEM"] == done.default_system == (SMOLLM2_SYSTEM if family == "llama" else None)
    params = mf["PARAMETER"]
    assert ("temperature", "0") in params and ("repeat_penalty", "1") in params and ("num_predict", "64") in params
    stops = sorted(json.loads(v) for k, v in params if k == "stop")
    from stages.inference.generation import stop_ids
    model, tok = _original(folders[family])
    assert stops == sorted(tok.convert_ids_to_tokens(stop_ids(model, tok)))  # where sftflow's generation stops
    for p in PROMPTS:
        # Ollama puts the Modelfile's SYSTEM first when the request brings no system message
        msgs = p if p[0]["role"] == "system" or mf["SYSTEM"] is None else [
            {"role": "system", "content": mf["SYSTEM"]}, *p]
        want = tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True)
        assert _go_template(mf["TEMPLATE"], msgs) == want


def test_a_template_that_is_not_chatml_gets_no_ollama_template(folders, tmp_path):
    folder = tmp_path / "zephyr"
    shutil.copytree(folders["qwen2"], folder)
    zephyr = ROOT / "tests" / "fixtures" / "chat_templates" / "zephyr.jinja"
    (folder / "chat_template.jinja").write_text(zephyr.read_text())
    done = export_gguf(folder, tmp_path / "out", "f16")
    assert _modelfile(done.modelfile)["TEMPLATE"] is None and "no TEMPLATE" in done.modelfile.read_text()
    assert any("not ChatML" in n for n in done.notes)


def test_generation_and_the_export_stop_by_one_rule():
    """Where a reply ends lives in stages/core/chat/chat_tokens.py alone: generation and the Modelfile's stops
    (and the GGUF's eot token) use it, neither keeps a copy."""
    import ast

    from stages.core.chat import chat_tokens
    from stages.inference import generation
    assert exporter.END_OF_TURN is chat_tokens.END_OF_TURN
    assert exporter.stop_token_ids is generation.stop_token_ids is chat_tokens.stop_token_ids
    for module in (generation, exporter):
        tree = ast.parse(Path(module.__file__).read_text())
        assigned = {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) for t in n.targets
                    if isinstance(t, ast.Name)}
        assert "END_OF_TURN" not in assigned, module.__name__


# --------------------------------------------------------------------------- the command, refusals, atomicity

def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stages.export", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def test_the_command_takes_a_train_stage_folder_and_prints_what_it_wrote(folders, tmp_path):
    stage = tmp_path / "train" / "3f2a9c"
    shutil.copytree(folders["qwen2"], stage / "model")
    (stage / "manifest.json").write_text("{}")
    proc = _cli(str(stage), "--out", str(tmp_path / "out"), "--type", "f16")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [str(tmp_path / "out" / "3f2a9c-F16.gguf"), str(tmp_path / "out" / "Modelfile")]


def _config_only(tmp: Path, config: dict) -> Path:
    folder = tmp / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("config,args,says", [
    ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, [], "GPT2LMHeadModel"),
    ({"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 4096}, [],
     "MistralForCausalLM"),
    ({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "use_sliding_window": True}, [],
     "use_sliding_window"),
    ({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "rope_scaling": {"rope_type": "llama3"}}, [],
     "rope scaling 'llama3'"),
    ({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}, ["--type", "q4_k"], "--type q4_k"),
])
def test_a_refusal_is_one_line_exit_2_and_nothing_written(config, args, says, tmp_path):
    proc = _cli(str(_config_only(tmp_path, config)), "--out", str(tmp_path / "out"), *args)
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1 and says in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()


def test_a_write_that_fails_leaves_nothing_and_keeps_the_previous_file(folders, tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "m-F16.gguf").write_text("the previous export")

    def broken(self, *a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", broken)
    with pytest.raises(OSError, match="disk full"):
        export_gguf(folders["qwen2"], out, "f16", name="m")
    assert [p.name for p in out.iterdir()] == ["m-F16.gguf"]
    assert (out / "m-F16.gguf").read_text() == "the previous export"


def test_an_unmerged_adapter_or_a_missing_folder_is_refused(folders, tmp_path):
    with pytest.raises(ExportError, match="no such folder"):
        export_gguf(tmp_path / "nowhere", tmp_path / "out", "f16")
    folder = tmp_path / "lora"
    shutil.copytree(folders["llama"], folder)
    from safetensors.numpy import load_file, save_file
    weights = load_file(str(folder / "model.safetensors"))
    weights["model.layers.0.self_attn.q_proj.lora_A.weight"] = np.zeros((8, 64), np.float32)
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(ExportError, match="lora_A.*not merged"):
        export_gguf(folder, tmp_path / "out", "f16")
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- llama.cpp itself, when installed

@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_llama_cpp_replies_as_sftflow_does(folders, family, tmp_path):
    """llama-cpp-python (llama.cpp) on the f32 export: the prompt tokenizes to the same ids, and the
    greedy reply is the same tokens as transformers' greedy generation on the folder's model (token ids:
    a random model's replies are byte fragments that two decoders render differently)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    done = export_gguf(folders[family], tmp_path, "f32")
    model, tok = _original(folders[family])
    llm = llama_cpp.Llama(model_path=str(done.gguf), n_ctx=512, verbose=False, seed=0)
    for p in PROMPTS:
        ids = tok.apply_chat_template(p, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]
        assert llm.tokenize(tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True).encode(),
                            add_bos=False, special=True) == ids
        with torch.no_grad():
            want = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                                  pad_token_id=tok.pad_token_id)[0, len(ids):].tolist()
        got = []
        for t in llm.generate(ids, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
            got.append(t)
            if len(got) == len(want) or t == tok.eos_token_id:
                break
        assert got == want[:len(got)] and len(got) == len(want), (got, want)


def test_sftflow_export_takes_a_folder_and_refuses_in_one_line(folders, tmp_path):
    """`sftflow export` (the CLI's wiring of the same exporter): a train stage folder in, a GGUF and a
    Modelfile out; a refused type is one line, exit 2, nothing written."""
    from conftest import sftflow
    train = tmp_path / "train-folder"
    shutil.copytree(folders["qwen2"], train / "model")
    out = tmp_path / "exports"
    proc = sftflow("export", "-m", str(train), "--out", str(out), "--type", "q8_0", "--name", "tiny", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["Modelfile", "tiny-Q8_0.gguf"]
    assert _gguf_fields((out / "tiny-Q8_0.gguf"))["general.architecture"] == "qwen2"
    bad = sftflow("export", "-m", str(train), "--out", str(tmp_path / "nothing"), "--type", "q4_k", cwd=tmp_path)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "q4_k" in bad.stderr.lower(), bad.stderr
    assert not (tmp_path / "nothing").exists()
