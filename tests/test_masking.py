"""Assistant-only masks, checked against independent references: transformers' own
`return_assistant_tokens_mask` (builtin template has {% generation %} markers), and decoding
the trained tokens, compared *exactly* with each reply and the end-of-turn text the template's
source puts after it (conftest.expected_run). Each row goes through prepare's own row path
(`prepared`: rows.ordered_results, as the stage runs it), record to ids and mask."""

import json

import pytest

from conftest import (MULTI_TURN, REAL_TEMPLATES, REALDATA, base_model, expected_run, family_tokenizer,
                      tiny_config_dict, write_config)
from stages.core.config import load_config
from stages.chatdata.readers import RowError, prompt_and_reference, to_conversations
from stages.prepare.rows import Item, Options, ordered_results
from stages.prepare.shapes import MARKS

CONVERSATIONS = [
    [{"role": "user", "content": "Who are you?"}, {"role": "assistant", "content": "I am TinyChat."}],
    [{"role": "system", "content": "You are TinyChat."},
     {"role": "user", "content": "Reverse the words: apple river"}, {"role": "assistant", "content": "river apple"},
     {"role": "user", "content": "你是谁？"}, {"role": "assistant", "content": "我是 TinyChat。"},
     {"role": "user", "content": "And again?"}, {"role": "assistant", "content": "Again: <|im_start|> is just text"}],
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer
    tmp = tmp_path_factory.mktemp("tok")
    cfg = load_config(write_config(tmp, tiny_config_dict(tmp)))
    return AutoTokenizer.from_pretrained(base_model(cfg))


def prepared(tok, messages: list[dict], max_length: int = 100_000, loss_on: str = "assistant",
             truncation: str = "drop") -> Item:
    """One `messages` record through prepare's row path, one process: its Item, with `ids` and
    `mask`, or the `reason` it is quarantined for."""
    opts = Options(columns={}, loss_on=loss_on, truncation=truncation, max_length=max_length, val_fraction=0.0)
    ((item,),) = ordered_results([[("train", "messages", "rows.jsonl", 1, {"messages": messages})]], opts, 1, tok)
    return item


def kept(item: Item) -> Item:
    assert item.reason is None, f"quarantined: {item.reason}: {item.detail}"
    return item


def trainable_runs(tok, t: Item) -> list[str]:
    runs, cur = [], []
    for tid, m in zip(kept(t).ids.tolist(), t.mask.tolist()):
        if m:
            cur.append(tid)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    if cur:
        runs.append(tok.decode(cur))
    return runs


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_mask_equals_transformers_generation_mask(tokenizer, messages):
    ours = kept(prepared(tokenizer, messages, max_length=512))
    ref = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert ours.ids.tolist() == list(ref["input_ids"])
    assert ours.mask.tolist() == list(ref["assistant_masks"])


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_every_assistant_turn_and_its_end_of_turn_token_is_trained(tokenizer, messages):
    t = prepared(tokenizer, messages, max_length=512)
    replies = [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]
    assert trainable_runs(tokenizer, t) == replies


def test_rows_without_trainable_tokens_or_too_long_are_rejected(tokenizer):
    too_long = prepared(tokenizer, CONVERSATIONS[1], max_length=10)
    assert too_long.reason == "too_long" and too_long.ids is None and too_long.mask is None
    no_reply = prepared(tokenizer, [{"role": "user", "content": "hi"}])
    assert no_reply.reason == "no_assistant_turn" and no_reply.ids is None


@pytest.mark.parametrize("row, expected", [
    ({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
     [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]),
    ({"prompt": "hi", "completion": "hello"},
     [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]),
    ({"instruction": "Add", "input": "1 2", "output": "3"},
     [{"role": "user", "content": "Add\n\n1 2"}, {"role": "assistant", "content": "3"}]),
    ({"prompt": "Give JSON", "completion": '{"name": "x"}'},  # text that looks like JSON stays text
     [{"role": "user", "content": "Give JSON"}, {"role": "assistant", "content": '{"name": "x"}'}]),
    ({"prompt": "List", "completion": "[1, 2, 3]"},
     [{"role": "user", "content": "List"}, {"role": "assistant", "content": "[1, 2, 3]"}]),
])
def test_formats_become_canonical_messages(row, expected):
    assert to_conversations(row) == [expected]


def test_eval_prompt_is_everything_before_the_last_reply():
    prompt, ref = prompt_and_reference(CONVERSATIONS[1])
    assert ref == CONVERSATIONS[1][-1]["content"]
    assert prompt == CONVERSATIONS[1][:-1]


def expected_runs(name: str, messages: list[dict], tok=None) -> list[str]:
    """Each reply's expected run, as the tokenizer can spell it (its normalizer, e.g. NFC, applied)."""
    runs = [expected_run(name, m["content"]) for m in messages if m["role"] == "assistant"]
    norm = tok.backend_tokenizer.normalizer if tok is not None else None
    return [norm.normalize_str(r) for r in runs] if norm is not None else runs


@pytest.mark.parametrize("name", sorted(REAL_TEMPLATES))
@pytest.mark.parametrize("messages", MULTI_TURN, ids=["multi-turn", "system"])
def test_real_templates_train_exactly_each_reply_and_its_end_of_turn(tokenizer, name, messages):
    """Real vendor templates without {% generation %} markers, used as their files are written
    (indented): the trained tokens decode to each reply and the end-of-turn text, exactly."""
    tok = family_tokenizer(tokenizer, name)
    t = prepared(tok, messages, max_length=4096)
    assert trainable_runs(tok, t) == expected_runs(name, messages)
    assert t.ids.tolist() == tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    last = prepared(tok, messages, max_length=4096, loss_on="last_assistant")
    assert trainable_runs(tok, last) == expected_runs(name, [messages[-1]])


def test_loss_on_all_and_truncation(tokenizer):
    messages = CONVERSATIONS[1]
    full = kept(prepared(tokenizer, messages, max_length=512))
    everything = kept(prepared(tokenizer, messages, max_length=512, loss_on="all"))
    assert everything.ids.tolist() == full.ids.tolist() and everything.mask.all()
    n = len(full.ids)
    cut = kept(prepared(tokenizer, messages, max_length=n - 3, truncation="keep_start"))
    assert cut.truncated and not full.truncated
    assert cut.ids.tolist() == full.ids.tolist()[: n - 3] and cut.mask.tolist() == full.mask.tolist()[: n - 3]
    first_trainable = full.mask.tolist().index(1)
    # cut before the first reply: nothing left to learn
    cut = prepared(tokenizer, messages, max_length=first_trainable, truncation="keep_start")
    assert cut.reason == "no_trainable_tokens"


@pytest.mark.skipif(not (REALDATA / "sharegpt_identity.json").is_file(), reason="../shared/realdata absent")
@pytest.mark.parametrize("name", ["builtin", *sorted(REAL_TEMPLATES)])
def test_every_real_sharegpt_row_trains_exactly_its_replies_on_every_template(tokenizer, name):
    """All 500 real conversations (1,000 replies), on every real template: kept, and exact."""
    tok = tokenizer if name == "builtin" else family_tokenizer(tokenizer, name)
    for row in json.loads((REALDATA / "sharegpt_identity.json").read_text()):
        (messages,) = to_conversations(row, "sharegpt")
        t = prepared(tok, messages)
        assert trainable_runs(tok, t) == expected_runs(name, messages, tok)
        last = prepared(tok, messages, loss_on="last_assistant")
        assert trainable_runs(tok, last) == expected_runs(name, messages[-1:], tok)


# --------------------------------------------------------------------------- property-based

from hypothesis import HealthCheck, example, given, settings, strategies as st  # noqa: E402

from strategies import content, conversations, real_conversations, reply  # noqa: E402


def runs_of(mask: list[int]) -> list[list[int]]:
    out, cur = [], []
    for i, m in enumerate(mask + [0]):
        if m:
            cur.append(i)
        elif cur:
            out.append(cur)
            cur = []
    return out


QUARANTINE = {"reply_boundary", "reply_not_in_template", "template_error"}


def tokenize_or_reason(tok, messages, loss_on="assistant"):
    item = prepared(tok, messages, loss_on=loss_on)
    if item.reason is None:
        return item
    assert item.reason in QUARANTINE, (item.reason, item.detail)
    return item.reason


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=conversations())
# was quarantined
@example(messages=[{"role": "user", "content": "assistant\n"}, {"role": "assistant", "content": "\ue000"}])
def test_property_mask_equals_transformers_or_the_row_is_quarantined(tokenizer, messages):
    """Against transformers' {% generation %} mask: a kept row's mask is exactly it; a row is only
    quarantined when a token of transformers' mask also holds header text (it straddles the reply's
    start), which no mask can train exactly."""
    ref = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ours = tokenize_or_reason(tokenizer, messages)
    if isinstance(ours, str) and ours == "reply_not_in_template":
        # text that spells a control token (`<|im_start|>`) is tokenized as that token: the reply's
        # place can't be found in the rendering, and the row is quarantined rather than guessed at
        specials = [t for t in tokenizer.all_special_tokens + list(tokenizer.get_added_vocab()) if t]
        assert any(t in m["content"] for m in messages for t in specials), messages
        return
    if isinstance(ours, str):
        assert ours == "reply_boundary"
        starts = [run[0] for run in runs_of(list(ref["assistant_masks"]))]
        assert any(tokenizer.decode([ref["input_ids"][i]]).startswith("\n") for i in starts)
        return
    assert ours.ids.tolist() == list(ref["input_ids"])
    assert ours.mask.tolist() == list(ref["assistant_masks"])
    assert trainable_runs(tokenizer, ours) == expected_runs("builtin", messages, tokenizer)


ALL_MARKS = "".join(MARKS)
PRIVATE_USE = [  # the span finder marks placeholders with private-use characters; rows hold them too
    [{"role": "user", "content": "assistant\n"}, {"role": "assistant", "content": "\ue000"}],
    [{"role": "system", "content": "scraped \ue000 text"}, {"role": "user", "content": "\ue000\ue001?"},
     {"role": "assistant", "content": "\ue000sftflow-reply-2\ue000 and \ue0000\ue001 are just text"}],
    # every candidate mark, in every message, and runs of U+E000: the fallback mark is a longer run
    [{"role": "system", "content": ALL_MARKS}, {"role": "user", "content": "\ue000\ue000 " + ALL_MARKS},
     {"role": "assistant", "content": ALL_MARKS + " first"}, {"role": "user", "content": ALL_MARKS[::-1]},
     {"role": "assistant", "content": "\ue000\ue000\ue000sftflow-reply-4\ue000\ue000\ue000" + ALL_MARKS}],
]


@pytest.mark.parametrize("messages", PRIVATE_USE, ids=["flaky-example", "placeholder-lookalikes", "every-mark"])
def test_rows_holding_the_placeholder_marks_are_masked_like_any_other(tokenizer, messages):
    """Regression: a row holding U+E000 was quarantined (`reply_not_in_template`). Now its mask is
    transformers' own, on the render-once path and the per-row path alike."""
    from stages.prepare.masking import Renderer, assistant_spans, exact_spans, placeholder
    ours = kept(prepared(tokenizer, messages, max_length=512))
    ref = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert ours.ids.tolist() == list(ref["input_ids"])
    assert ours.mask.tolist() == list(ref["assistant_masks"])
    assert trainable_runs(tokenizer, ours) == [m["content"] + "<|im_end|>" for m in messages
                                               if m["role"] == "assistant"]
    r = Renderer.of(tokenizer)
    for loss_on in ("assistant", "last_assistant", "all"):
        fast = r.shaped(messages, loss_on)
        assert fast is not None  # the per-shape plan holds no mark: these rows need no detour
        text, spans = exact_spans(r, messages, loss_on)
        assert fast == (text, [tuple(s) for s in spans]) == assistant_spans(r, messages, loss_on)
    mark = placeholder(messages).split("sftflow")[0]
    assert not any(mark in m["content"] for m in messages)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=real_conversations(), name=st.sampled_from(sorted(REAL_TEMPLATES)),
       loss_on=st.sampled_from(["assistant", "last_assistant"]))
def test_property_real_templates_train_exactly_the_replies(tokenizer, messages, name, loss_on):
    """Replies without surrounding whitespace are never quarantined (unless the template itself
    refuses the conversation) and always train exactly reply + end-of-turn text."""
    tok = family_tokenizer(tokenizer, name)
    t = tokenize_or_reason(tok, messages, loss_on)
    if isinstance(t, str):
        assert t == "template_error", t
        return
    replies = [m for m in messages if m["role"] == "assistant"]
    want = expected_runs(name, replies if loss_on == "assistant" else replies[-1:], tok)
    assert trainable_runs(tok, t) == want


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=real_conversations(reply=reply), name=st.sampled_from(sorted(REAL_TEMPLATES)))
def test_property_any_reply_is_trained_exactly_or_quarantined(tokenizer, messages, name):
    """Replies with leading/trailing whitespace too: a kept row is exact, never approximately right."""
    tok = family_tokenizer(tokenizer, name)
    t = tokenize_or_reason(tok, messages)
    if isinstance(t, str):
        return
    assert trainable_runs(tok, t) == expected_runs(name, messages, tok)


@pytest.mark.parametrize("first", ["d", "end", ">", " I am here to help.", "<|im_end|>"])
def test_qwen_assistant_first_reply_is_trained_whole(tokenizer, first):
    """Regression: a first reply that is a piece of <|im_end|> was not trained at all, and one with a
    leading space lost its first word."""
    tok = family_tokenizer(tokenizer, "qwen2.5-instruct")
    messages = [{"role": "assistant", "content": first}, {"role": "user", "content": "Who are you?"},
                {"role": "assistant", "content": "I am TinyChat."}]
    t = prepared(tok, messages, max_length=4096)
    assert trainable_runs(tok, t) == [first + "<|im_end|>", "I am TinyChat.<|im_end|>"]


@pytest.mark.parametrize("name", ["gemma-it", "alpaca", "mistral-instruct", "llama-2-chat"])
def test_no_header_newline_or_template_indentation_is_trained(tokenizer, name):
    """Regression: Gemma/Alpaca trained the header's newline, Mistral/Llama-2 their indentation."""
    tok = family_tokenizer(tokenizer, name)
    t = prepared(tok, [{"role": "user", "content": "Who are you?"}, {"role": "assistant", "content": "I am X."}],
                 max_length=4096)
    assert trainable_runs(tok, t) == [expected_run(name, "I am X.")]
    assert "\n" not in trainable_runs(tok, t)[0]


def test_a_token_holding_header_and_reply_text_quarantines_the_row():
    """A tokenizer with a "\\n " token splits "A:\\n hi" as "A:", "\\n ", "hi": when the reply is " hi", its
    first token also holds the header's newline, and no mask can train exactly the reply."""
    import numpy as np
    from stages.prepare.masking import mask_from_offsets
    text = "A:\n hi<e>"
    offsets = np.array([[0, 2], [2, 4], [4, 6], [6, 9]])
    with pytest.raises(RowError) as e:
        mask_from_offsets(offsets, [(3, 9)], text)
    assert e.value.reason == "reply_boundary"
    assert mask_from_offsets(offsets, [(4, 9)], text).tolist() == [0, 0, 1, 1]
    with pytest.raises(RowError):  # and at the end: a token reaching past the end-of-turn text
        mask_from_offsets(offsets, [(4, 8)], text)


def _byte_fallback_tokenizer():
    """A SentencePiece-style BPE (Metaspace, byte fallback): characters outside its vocabulary
    become several byte tokens with the same offsets, the case `mask_from_encoding` widens over."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {f"<0x{i:02X}>": i for i in range(256)}
    for w in ["▁", "a", "b", "h", "i", "e", "\n", "▁h", "▁hi", "<", ">"]:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.BPE(vocab, [("▁", "h"), ("▁h", "i")], byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    return tok


@st.composite
def text_and_spans(draw):
    text = draw(content.filter(len))
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), min_size=2, max_size=6, unique=True)))
    return text, [(a, b) for a, b in zip(cuts[::2], cuts[1::2])]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=text_and_spans())
def test_mask_from_the_encoding_equals_the_per_token_definition(tokenizer, case):
    """The fast mask (by character, at the spans' ends) against `mask_from_offsets` over every
    token's offsets: the same mask, or the same reason to quarantine, for byte-level BPE (the
    builtin tokenizer) and SentencePiece-style byte fallback alike."""
    import numpy as np
    from stages.prepare.masking import mask_from_encoding, mask_from_offsets
    text, spans = case
    for backend in (tokenizer.backend_tokenizer, _byte_fallback_tokenizer()):
        enc = backend.encode(text, add_special_tokens=False)

        def outcome(fn):
            try:
                return fn().tolist()
            except RowError as e:
                return e.reason
        ref = outcome(lambda enc=enc: mask_from_offsets(np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2),
                                                        spans, text))
        assert outcome(lambda enc=enc: mask_from_encoding(enc, spans, text)) == ref, (text, spans, enc.tokens,
                                                                                       enc.offsets)


class _Encoding:
    """Offsets behind the `tokenizers.Encoding` methods `mask_from_encoding` calls, for token
    layouts no bundled tokenizer produces."""

    def __init__(self, offsets):
        self.offsets, self.ids = offsets, list(range(len(offsets)))

    def char_to_token(self, pos):
        return next((k for k, (s, e) in enumerate(self.offsets) if s <= pos < e), None)

    def token_to_chars(self, k):
        return self.offsets[k]


@pytest.mark.parametrize("offsets, spans, mask", [
    ([(0, 2), (3, 3), (3, 5)], [(2, 5)], [0, 1, 1]),   # a zero-width token before the first one that covers the reply
    ([(0, 2), (2, 4), (4, 4)], [(1, 5)], "reply_boundary"),
    ([(0, 1), (2, 2), (3, 4)], [(1, 3)], [0, 1, 0]),   # no character of the reply covered: the per-token road
])
def test_mask_from_the_encoding_on_zero_width_tokens(offsets, spans, mask):
    import numpy as np
    from stages.prepare.masking import mask_from_encoding, mask_from_offsets
    text = "ab cd"
    for fn, arg in ((mask_from_encoding, _Encoding(offsets)), (mask_from_offsets, np.array(offsets).reshape(-1, 2))):
        if isinstance(mask, str):
            with pytest.raises(RowError) as e:
                fn(arg, spans, text)
            assert e.value.reason == mask
        else:
            assert fn(arg, spans, text).tolist() == mask
