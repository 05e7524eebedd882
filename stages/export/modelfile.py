"""The Ollama `Modelfile` written beside the GGUF file: `ollama create NAME -f Modelfile`.

Its TEMPLATE is the chat template translated to Ollama's Go template, for ChatML templates
(`<|im_start|>role\\n...<|im_end|>\\n`, the builtin tiny-chat, SmolLM2, Qwen2); whether a template is
ChatML is decided by rendering it (transformers' own `apply_chat_template`), not by reading it. A default
system prompt the template adds when a conversation has none (SmolLM2's) becomes SYSTEM: Ollama puts it
first when a request brings no system message, as the template does. When the export knows the prepare
folder the model was trained on, the system prompt most training rows began with (`trained_system`)
becomes SYSTEM instead: a model fine-tuned with a system prompt answers as trained only with it.

The parameters are the ones sftflow's evaluation generates with (stages/inference/generation.py): greedy
(`temperature 0`), no repetition penalty (Ollama's default is 1.1), stopping at every token it stops
at (stages/core/chat/chat_tokens.py), and `num_predict` = eval.max_new_tokens when the export is given it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

OLLAMA_CHATML = ('{{- range .Messages }}<|im_start|>{{ .Role }}\n'
                 '{{ .Content }}<|im_end|>\n'
                 '{{ end }}<|im_start|>assistant\n')


@dataclass(frozen=True)
class ChatML:
    default_system: str | None


def chatml(messages: list[dict], generation_prompt: bool = True) -> str:
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if generation_prompt else "")


_PROBES = [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
     {"role": "assistant", "content": "Hello!\nHow can I help?"}, {"role": "user", "content": "Say 12 + 30."}],
    [{"role": "user", "content": "One message"}, {"role": "assistant", "content": "One reply"},
     {"role": "user", "content": "Two"}],
]


def chatml_form(tok, template: str, portable: str) -> ChatML | None:
    """ChatML (with the template's default system prompt, if any) when `template` renders every probe
    as ChatML does; None otherwise. Also checks that `portable` (the GGUF's copy) renders the same text."""
    def render(tmpl: str, msgs: list[dict], gen: bool = True) -> str:
        return tok.apply_chat_template(msgs, chat_template=tmpl, tokenize=False, add_generation_prompt=gen)

    try:
        renders = [(m, g, render(template, m, g)) for m in (*_PROBES, _PROBES[1][:1]) for g in (True, False)]
    except Exception:  # noqa: BLE001 - a template may refuse a role or a shape: then it is not ChatML
        return None
    for msgs, gen, text in renders:
        if render(portable, msgs, gen) != text:
            raise AssertionError("the GGUF's chat template renders differently from the folder's")  # a bug here
    default = None
    for msgs, gen, text in renders:
        if msgs[0]["role"] == "system":
            if text != chatml(msgs, gen):
                return None
            continue
        m = re.fullmatch(r"<\|im_start\|>system\n(.*?)<\|im_end\|>\n" + re.escape(chatml(msgs, gen)), text, re.S)
        found = "" if text == chatml(msgs, gen) else m[1] if m else None
        if found is None or default not in (None, found):
            return None
        default = found
    return ChatML(default or None)


_SYSTEM = re.compile(r"<\|im_start\|>system\n(.*?)<\|im_end\|>", re.S)


def trained_system(tok, prepare_dir, rows: int = 2000) -> tuple[str | None, int, int]:
    """(the system prompt most of the training rows began with, how many did, how many were read) from the
    train split of the prepare folder the model was trained on: each row's untrained prefix (up to its
    first trained token), decoded with the model's own tokenizer and read as ChatML. The train split keeps
    no messages, only tokens, and these are what the model saw; a template's default system prompt shows
    as one too. (None, k, n) when fewer than half of the first `rows` rows began with one and the same."""
    from collections import Counter
    from pathlib import Path

    import pyarrow as pa
    seen: Counter = Counter()
    n = 0
    for shard in sorted((Path(prepare_dir) / "train").glob("shard-*.arrow")):
        table = pa.ipc.open_file(pa.memory_map(str(shard), "r")).read_all().select(["input_ids", "loss_mask"])
        for ids, mask in zip(table.column("input_ids").to_pylist(), table.column("loss_mask").to_pylist()):
            prefix = ids[:mask.index(1)] if 1 in mask else ids
            m = _SYSTEM.match(tok.decode(prefix, skip_special_tokens=False, clean_up_tokenization_spaces=False))
            seen[m[1] if m else None] += 1
            n += 1
            if n >= rows:
                break
        if n >= rows:
            break
    top, k = seen.most_common(1)[0] if seen else (None, 0)
    return (top, k, n) if top and 2 * k > n else (None, k if top else 0, n)


def _quoted(value: str) -> str:
    return json.dumps(value, ensure_ascii=False)


def modelfile_text(gguf_name: str, form: ChatML | None, stops: list[str], context_length: int,
                   max_new_tokens: int | None) -> str:
    lines = ["# Ollama: ollama create NAME -f Modelfile   (written by sftflow: python -m stages.export)",
             "# Greedy, as sftflow's evaluation generates (stages/inference/generation.py).",
             f"FROM ./{gguf_name}"]
    if form is not None:
        lines.append(f'TEMPLATE """{OLLAMA_CHATML}"""')
        if form.default_system is not None:
            if '"""' in form.default_system:
                lines.append("# SYSTEM left out: the template's default system prompt contains \"\"\"")
            else:
                lines.append(f'SYSTEM """{form.default_system}"""')
    else:
        lines.append("# no TEMPLATE: the chat template is not ChatML; Ollama reads tokenizer.chat_template "
                     "from the GGUF file")
    lines += [f"PARAMETER stop {_quoted(s)}" for s in stops]
    lines += ["PARAMETER temperature 0", "PARAMETER repeat_penalty 1", f"PARAMETER num_ctx {min(context_length, 4096)}"]
    if max_new_tokens is not None:
        lines.append(f"PARAMETER num_predict {max_new_tokens}")
    return "\n".join(lines) + "\n"
