"""Chat template + assistant-only loss mask, for any template.

Most real chat templates have no `{% generation %}` markers, so the mask can't come from
transformers' `return_assistant_tokens_mask`. Instead we render the conversation once,
and for every assistant turn i we render two prefixes:

    before_i = template(messages[:i], add_generation_prompt=True)   # ends where the reply starts
    after_i  = template(messages[:i+1])                             # ends after the reply's turn

The reply's character span is [len(before_i), len(after_i)) with trailing whitespace
trimmed: the reply text plus the end-of-turn marker the template emits (`<|im_end|>`,
`<|eot_id|>`, `</s>`, ...), but not the newline that separates turns. Characters map to
tokens through the fast tokenizer's offsets.

Boundary rule: a token is trainable iff its first character lies inside a reply span. A BPE
token that starts in the prompt and reaches into the reply stays a prompt token, because
at inference the prompt is tokenized on its own and that token is never generated.
"""

from __future__ import annotations

from dataclasses import dataclass

from .readers import RowError


@dataclass
class Tokenized:
    input_ids: list[int]
    loss_mask: list[int]

    @property
    def trainable(self) -> int:
        return sum(self.loss_mask)


def render(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as e:  # jinja's raise_exception, missing template, ...
        raise RowError("template_error", str(e).splitlines()[0] if str(e) else type(e).__name__) from None


def assistant_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    text = render(tokenizer, messages)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = render(tokenizer, messages[:i], add_generation_prompt=True) if i else ""
        after = render(tokenizer, messages[: i + 1])
        if not (text.startswith(before) and text.startswith(after) and len(after) > len(before)):
            raise RowError("template_not_prefix_stable", f"assistant turn {i} renders differently inside the full conversation")
        end = len(after.rstrip())
        spans.append((len(before), max(end, len(before))))
    return text, spans


def tokenize_conversation(tokenizer, messages: list[dict], max_length: int) -> Tokenized:
    text, spans = assistant_spans(tokenizer, messages)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    mask = [0] * len(ids)
    s = 0
    for t, (start, _end) in enumerate(offsets):
        while s < len(spans) and start >= spans[s][1]:
            s += 1
        if s < len(spans) and spans[s][0] <= start < spans[s][1]:
            mask[t] = 1
    if len(ids) > max_length:
        raise RowError("too_long", f"{len(ids)} tokens > data.max_length={max_length}")
    if not any(mask):
        raise RowError("no_trainable_tokens")
    return Tokenized(ids, mask)


def prompt_and_reference(messages: list[dict]) -> tuple[list[dict], str]:
    """Eval split: the turns before the final assistant reply, and that reply."""
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return messages[:last], messages[last]["content"]
