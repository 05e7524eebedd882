"""Assistant-only masks, checked against independent references: transformers' own
`return_assistant_tokens_mask` (builtin template has {% generation %} markers) and decoding."""

import json

import pytest

from conftest import REALDATA, tiny_config_dict, write_config
from stages.config import load_config
from stages.models import resolve_model
from stages.prepare.masking import prompt_and_reference, tokenize_conversation
from stages.prepare.readers import RowError, to_messages

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
    return AutoTokenizer.from_pretrained(resolve_model(cfg))


def trainable_runs(tok, t) -> list[str]:
    runs, cur = [], []
    for tid, m in zip(t.input_ids, t.loss_mask):
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
    ours = tokenize_conversation(tokenizer, messages, max_length=512)
    ref = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert ours.input_ids == list(ref["input_ids"])
    assert ours.loss_mask == list(ref["assistant_masks"])


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_every_assistant_turn_and_its_end_of_turn_token_is_trained(tokenizer, messages):
    t = tokenize_conversation(tokenizer, messages, max_length=512)
    replies = [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]
    assert trainable_runs(tokenizer, t) == replies


def test_rows_without_trainable_tokens_or_too_long_are_rejected(tokenizer):
    with pytest.raises(RowError) as e:
        tokenize_conversation(tokenizer, CONVERSATIONS[1], max_length=10)
    assert e.value.reason == "too_long"
    with pytest.raises(RowError) as e:
        to_messages({"messages": [{"role": "user", "content": "hi"}]})
    assert e.value.reason == "no_assistant_turn"


@pytest.mark.parametrize("row, expected", [
    ({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
     [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]),
    ({"prompt": "hi", "completion": "hello"},
     [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]),
    ({"instruction": "Add", "input": "1 2", "output": "3"},
     [{"role": "user", "content": "Add\n\n1 2"}, {"role": "assistant", "content": "3"}]),
])
def test_formats_become_canonical_messages(row, expected):
    assert to_messages(row) == expected


def test_eval_prompt_is_everything_before_the_last_reply():
    prompt, ref = prompt_and_reference(CONVERSATIONS[1])
    assert ref == CONVERSATIONS[1][-1]["content"]
    assert prompt == CONVERSATIONS[1][:-1]


@pytest.mark.skipif(not (REALDATA / "chat_templates" / "chatml.jinja").is_file(), reason="../shared/realdata absent")
def test_real_chatml_template_without_generation_markers(tokenizer):
    """The real ChatML template has no {% generation %} markers; the mask must not need them."""
    tok = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    # The file is indented for reading; joined back into one line it is the template vendors ship.
    text = (REALDATA / "chat_templates" / "chatml.jinja").read_text()
    tok.chat_template = "".join(line.strip() for line in text.splitlines())
    for messages in CONVERSATIONS:
        t = tokenize_conversation(tok, messages, max_length=512)
        assert trainable_runs(tok, t) == [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]


@pytest.mark.skipif(not (REALDATA / "sharegpt_identity.json").is_file(), reason="../shared/realdata absent")
def test_real_sharegpt_rows_all_trainable(tokenizer):
    rows = json.loads((REALDATA / "sharegpt_identity.json").read_text())[:50]
    for row in rows:
        messages = to_messages(row, "sharegpt")
        t = tokenize_conversation(tokenizer, messages, max_length=4096)
        runs = trainable_runs(tokenizer, t)
        assert runs == [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]
