"""Chat template + assistant-only loss mask, for any template.

Most real chat templates have no `{% generation %}` markers, so the mask can't come from
transformers' `return_assistant_tokens_mask`. Instead we render the conversation once, and
for every assistant turn i two prefixes of it:

    before_i = template(messages[:i], add_generation_prompt=True)   # ends where the reply starts
    after_i  = template(messages[:i+1])                             # ends after the reply's turn

The reply's character span starts at the end of `before_i` and ends where `after_i` stops
agreeing with the full text (longest common prefix), minus trailing whitespace: the reply plus
the end-of-turn marker the template emits (`<|im_end|>`, `<|eot_id|>`, `</s>`,
`<end_of_turn>`, ...), but not the newline that separates turns. Text the template emits
before the reply (Llama-2's leading space) is trained: at inference the model generates it.

Some templates render the generation prompt differently from the same header inside a
conversation (indented templates add whitespace; Vicuna's `ASSISTANT:` vs `ASSISTANT: `).
Then `before_i` is not a prefix of the text, and the span starts after both the part that
agrees and the last occurrence of the generation prompt's last line (`ASSISTANT:`) before the
reply, so header text is never trained and the space before the reply still is. A reply that is not
inside its span (a template that drops or rewrites earlier replies) is a bad row
(`reply_not_in_template`), never a wrong mask.

That is the per-row path (`exact_spans`), and the definition of the spans. Rows of a template
proven to treat content as opaque text skip it: `shapes.py` runs the same algorithm once per
conversation shape on placeholders and builds each row's text and spans by concatenation, with
no template render per row (`tests/test_shapes.py` holds the two paths equal).

Characters map to tokens through the fast tokenizer's offsets. Boundary rule: a token is
trainable iff its first character lies inside a reply span. A BPE token that starts in the
prompt and reaches into the reply stays a prompt token, because at inference the prompt is
tokenized on its own and that token is never generated.

`data.loss_on`: `assistant` (every reply), `last_assistant` (only the final reply), `all`
(every token). `data.truncation`: `drop` rows over `data.max_length`, or `keep_start` (cut
at max_length); a row left without trainable tokens is dropped either way.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from stages.chatdata.readers import RowError

from .shapes import build, common_prefix_len, free_mark, opaque_reason, plan_for, shape_key

MAX_SHAPES = 10_000  # distinct conversation shapes planned per process; rarer ones take the per-row path


class Renderer:
    """A chat template, rendered exactly as `apply_chat_template(tokenize=False)` renders it.

    The per-row path renders a conversation 2x per assistant turn, so it calls transformers'
    compiled template directly, skipping the per-call conversion of inputs to plain data (ours
    are plain JSON already); `shaped` answers from a per-shape plan instead when it can. Tests
    compare the result with `apply_chat_template` on every template. Built
    from the template text and special tokens alone, so tokenizing workers never import the
    heavy tokenizer classes (or torch)."""

    def __init__(self, template: str, special_tokens: dict, tokenizer=None):
        self.template, self.kwargs, self.tokenizer = template, dict(special_tokens), tokenizer
        try:
            from transformers.utils.chat_template_utils import _compile_jinja_template
            self._compiled = _compile_jinja_template(template)
        except Exception:  # another transformers layout: take the public, slower road
            if tokenizer is None:
                raise
            self._compiled = None
        self.opaque_reason = (opaque_reason(self._compiled.environment, template) if self._compiled is not None
                              else "rendered through apply_chat_template")
        self._plans: dict = {}

    @classmethod
    def of(cls, tokenizer) -> "Renderer":
        return cls(tokenizer.chat_template, tokenizer.special_tokens_map, tokenizer)

    def __getstate__(self) -> dict:  # picklable for worker processes: the compiled template is rebuilt
        return {"template": self.template, "kwargs": self.kwargs}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["template"], state["kwargs"])

    def shaped(self, messages: list[dict], loss_on: str) -> tuple[str, list[tuple[int, int]]] | None:
        """Text and spans from the cached plan of this row's shape (see shapes.py); None when the
        row takes the per-row path."""
        if self.opaque_reason is not None:
            return None
        key = shape_key(messages)
        if key is None:
            return None
        key = (key, loss_on)
        if key not in self._plans:
            if len(self._plans) >= MAX_SHAPES:
                return None
            try:
                self._plans[key] = plan_for(self, messages, loss_on)
            except RowError:  # the per-row path raises it with the row's own text
                self._plans[key] = None
        plan = self._plans[key]
        return None if plan is None else build([m["content"] for m in messages], plan)

    def __call__(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        try:
            if self._compiled is None:
                return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                          add_generation_prompt=add_generation_prompt)
            return self._compiled.render(messages=messages, tools=None, documents=None,
                                         add_generation_prompt=add_generation_prompt, **self.kwargs)
        except Exception as e:  # noqa: BLE001 - jinja's raise_exception, an undefined variable, ...
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise RowError("template_error", msg) from None


def placeholder(messages: list[dict]) -> str:
    """`<mark>sftflow-reply-{}<mark>`, its mark a private-use character no field of any message holds
    (shapes.free_mark): the row's own text can't spell a placeholder, whatever characters it has."""
    mark = free_mark(v for m in messages for v in m.values())
    return mark + "sftflow-reply-{}" + mark


def _reply_positions(renderer: Renderer, messages: list[dict], text: str,
                     turns: list[int]) -> dict[int, tuple[int, int]]:
    """turn index -> (start, end) of that reply's text in `text`, for the turns with text."""
    with_text = [i for i in turns if messages[i]["content"]]
    if not with_text:
        return {}
    form = placeholder(messages)
    marked = [dict(m, content=form.format(i)) if i in with_text else m for i, m in enumerate(messages)]
    skeleton = renderer(marked)
    pieces, at = [], 0  # the skeleton cut at the placeholders: text, turn, text, turn, ..., text
    for i in with_text:
        ph = form.format(i)
        k = skeleton.find(ph, at)
        if k < 0 or skeleton.find(ph, k + len(ph)) >= 0:
            raise RowError("reply_not_in_template",
                           f"assistant turn {i} is rendered {'not at all' if k < 0 else 'twice'}")
        pieces += [skeleton[at:k], i]
        at = k + len(ph)
    pieces.append(skeleton[at:])
    for form in (lambda c: c, str.strip):  # as written, or trimmed (`content | trim`)
        out, pos, rebuilt = {}, 0, []
        for piece in pieces:
            if isinstance(piece, int):
                reply = form(messages[piece]["content"])
                out[piece] = (pos, pos + len(reply))
                piece = reply
            rebuilt.append(piece)
            pos += len(piece)
        if "".join(rebuilt) == text:
            return out
    raise RowError("reply_not_in_template", "the template changes the reply text")


def _turn_end(renderer: Renderer, messages: list[dict], i: int, text: str) -> int:
    """Where assistant turn i ends in `text`: after its end-of-turn text, before the whitespace between turns."""
    end = len(text) if i == len(messages) - 1 else common_prefix_len(renderer(messages[: i + 1]), text)
    while end > 0 and text[end - 1].isspace():
        end -= 1
    return end


def assistant_spans(renderer: Renderer, messages: list[dict],
                    loss_on: str = "assistant") -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans to train on, in order."""
    shaped = renderer.shaped(messages, loss_on)
    if shaped is not None:
        return shaped
    return exact_spans(renderer, messages, loss_on)


def exact_spans(renderer: Renderer, messages: list[dict],
                loss_on: str = "assistant") -> tuple[str, list[tuple[int, int]]]:
    """`assistant_spans` the per-row way: renders this row (twice, plus once per earlier reply)."""
    text = renderer(messages)
    if loss_on == "all":
        return text, [(0, len(text))]
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if loss_on == "last_assistant":
        turns = turns[-1:]
    replies = _reply_positions(renderer, messages, text, turns)
    spans = []
    for i in turns:
        end = _turn_end(renderer, messages, i, text)
        if i in replies:
            start, reply_end = replies[i]
            if start > 0 and text[start - 1] == " ":  # the separator the model generates after the header
                start -= 1
        else:  # no text (a tool call): the turn starts where the generation prompt ends
            before = renderer(messages[:i], add_generation_prompt=True) if i else None
            if before is None or not text.startswith(before):
                raise RowError("reply_not_in_template", f"assistant turn {i} does not follow its generation prompt")
            start = reply_end = len(before)
        if end < reply_end or end <= start:
            raise RowError("reply_not_in_template", f"assistant turn {i} is not where the template renders it")
        spans.append((start, end))
    return text, spans


def mask_from_offsets(offsets: np.ndarray, spans: list[tuple[int, int]], text: str | None = None) -> np.ndarray:
    """1 on every token that overlaps a span. With `text`, a token that also covers characters
    outside its span is a RowError (`reply_boundary`)."""
    if not len(offsets):
        return np.zeros(0, dtype=np.int8)
    starts, ends = offsets[:, 0], offsets[:, 1]
    mask = np.zeros(len(starts), dtype=np.int8)
    for a, b in spans:
        hit = (starts < b) & (ends > a)
        mask[hit] = 1
        if text is None or not hit.any():
            continue
        idx = np.flatnonzero(hit)
        first, last = idx[0], idx[-1]
        if starts[first] < a:
            raise RowError("reply_boundary",
                           f"token {text[starts[first]:ends[first]]!r} straddles the start of a reply")
        if ends[last] > b:
            raise RowError("reply_boundary", f"token {text[starts[last]:ends[last]]!r} straddles the end of a reply")
    return mask


def mask_from_encoding(enc, spans: list[tuple[int, int]], text: str) -> np.ndarray:
    """`mask_from_offsets(enc.offsets, spans, text)`, computed from the `tokenizers.Encoding` at the
    spans' ends only: converting every token's offsets to Python is ~15% of preparing a row. A
    span's tokens are one contiguous run (offsets grow along the text): the first and the last
    token that overlap it are found by character, then widened over neighbours that also overlap
    (several byte-fallback tokens share one character). A span no token covers a character of
    takes the per-token road."""
    mask = np.zeros(len(enc.ids), dtype=np.int8)

    def overlaps(k: int, a: int, b: int) -> bool:
        s, e = enc.token_to_chars(k)
        return s < b and e > a
    for a, b in spans:
        first = next((k for k in map(enc.char_to_token, range(a, b)) if k is not None), None)
        if first is None:
            return mask_from_offsets(np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2), spans, text)
        last = next(k for k in map(enc.char_to_token, range(b - 1, a - 1, -1)) if k is not None)
        while first > 0 and overlaps(first - 1, a, b):
            first -= 1
        while last + 1 < len(mask) and overlaps(last + 1, a, b):
            last += 1
        (s, e), (s2, e2) = enc.token_to_chars(first), enc.token_to_chars(last)
        if s < a:
            raise RowError("reply_boundary", f"token {text[s:e]!r} straddles the start of a reply")
        if e2 > b:
            raise RowError("reply_boundary", f"token {text[s2:e2]!r} straddles the end of a reply")
        mask[first:last + 1] = 1
    return mask


def encode_texts(backend, texts: list[str]) -> list[tuple[np.ndarray, Any]]:
    """(input_ids int32, the `tokenizers.Encoding`) per text, from the fast tokenizer's Rust backend
    (`tokenizer.backend_tokenizer`): the same ids as `tokenizer(text, add_special_tokens=False)`."""
    return [(np.asarray(enc.ids, dtype=np.int32), enc) for enc in backend.encode_batch(texts, add_special_tokens=False)]


def finish(ids: np.ndarray, mask: np.ndarray, max_length: int, truncation: str) -> tuple[np.ndarray, np.ndarray]:
    """Applies max_length and the no-trainable-tokens rule to one encoded row."""
    if len(ids) > max_length:
        if truncation == "drop":
            raise RowError("too_long", f"{len(ids)} tokens > data.max_length={max_length}")
        ids, mask = ids[:max_length], mask[:max_length]
        if not mask.any():
            raise RowError("no_trainable_tokens", f"none left after truncation to data.max_length={max_length}")
    if not mask.any():
        raise RowError("no_trainable_tokens")
    return ids, mask

