"""Assistant-only masks, checked against independent references: transformers' own
`return_assistant_tokens_mask` (builtin template has {% generation %} markers) and decoding."""

import json

import pytest

from conftest import MULTI_TURN, REAL_TEMPLATES, REALDATA, base_model, family_tokenizer, tiny_config_dict, write_config
from stages.core.config import load_config
from stages.chatdata.readers import prompt_and_reference
from stages.prepare.masking import tokenize_conversation
from stages.chatdata.readers import RowError, to_messages

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
    ({"prompt": "Give JSON", "completion": '{"name": "x"}'},  # text that looks like JSON stays text
     [{"role": "user", "content": "Give JSON"}, {"role": "assistant", "content": '{"name": "x"}'}]),
    ({"prompt": "List", "completion": "[1, 2, 3]"},
     [{"role": "user", "content": "List"}, {"role": "assistant", "content": "[1, 2, 3]"}]),
])
def test_formats_become_canonical_messages(row, expected):
    assert to_messages(row) == expected


def test_eval_prompt_is_everything_before_the_last_reply():
    prompt, ref = prompt_and_reference(CONVERSATIONS[1])
    assert ref == CONVERSATIONS[1][-1]["content"]
    assert prompt == CONVERSATIONS[1][:-1]


def assert_replies_then_marker(runs: list[str], messages: list[dict], marker: str):
    replies = [m["content"].strip() for m in messages if m["role"] == "assistant"]
    assert len(runs) == len(replies), runs
    for run, reply in zip(runs, replies):
        run = run.strip()
        assert run.startswith(reply) and run[len(reply):].strip() == marker, (run, reply)


@pytest.mark.skipif(not (REALDATA / "chat_templates").is_dir(), reason="../shared/realdata absent")
@pytest.mark.parametrize("name", sorted(REAL_TEMPLATES))
@pytest.mark.parametrize("messages", MULTI_TURN, ids=["multi-turn", "system"])
def test_real_templates_train_exactly_each_reply_and_its_end_of_turn(tokenizer, name, messages):
    """Real vendor templates without {% generation %} markers: decoding the trainable tokens gives
    each assistant reply followed by the template's end-of-turn marker, in order, and nothing else."""
    tok = family_tokenizer(tokenizer, name)
    t = tokenize_conversation(tok, messages, max_length=4096)
    assert t.input_ids == tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    assert_replies_then_marker(trainable_runs(tok, t), messages, REAL_TEMPLATES[name][1])
    last = tokenize_conversation(tok, messages, max_length=4096, loss_on="last_assistant")
    assert_replies_then_marker(trainable_runs(tok, last), [messages[-1]], REAL_TEMPLATES[name][1])


def test_loss_on_all_and_truncation(tokenizer):
    messages = CONVERSATIONS[1]
    full = tokenize_conversation(tokenizer, messages, max_length=512)
    everything = tokenize_conversation(tokenizer, messages, max_length=512, loss_on="all")
    assert everything.input_ids == full.input_ids and all(everything.loss_mask)
    n = len(full.input_ids)
    cut = tokenize_conversation(tokenizer, messages, max_length=n - 3, truncation="keep_start")
    assert cut.input_ids == full.input_ids[: n - 3] and cut.loss_mask == full.loss_mask[: n - 3]
    first_trainable = full.loss_mask.index(1)
    with pytest.raises(RowError) as e:  # cut before the first reply: nothing left to learn
        tokenize_conversation(tokenizer, messages, max_length=first_trainable, truncation="keep_start")
    assert e.value.reason == "no_trainable_tokens"


@pytest.mark.skipif(not (REALDATA / "sharegpt_identity.json").is_file(), reason="../shared/realdata absent")
def test_real_sharegpt_rows_all_trainable(tokenizer):
    rows = json.loads((REALDATA / "sharegpt_identity.json").read_text())[:50]
    for row in rows:
        messages = to_messages(row, "sharegpt")
        t = tokenize_conversation(tokenizer, messages, max_length=4096)
        runs = trainable_runs(tokenizer, t)
        assert runs == [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]


# --------------------------------------------------------------------------- property-based

from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

PIECES = ["<|im_start|>", "<|im_end|>", "assistant\n", "[INST]", "</s>", "{{ x }}", "{% if %}", "\n", "\n\n", " ", "  ",
          "\t", "你好", "é", "🙂", "\u200b", "ASSISTANT:", "#### 42"]
content = st.lists(st.one_of(st.sampled_from(PIECES), st.text(st.characters(blacklist_categories=("Cs",)), max_size=8)),
                   min_size=1, max_size=6).map("".join)
reply = content.filter(lambda s: s.strip() != "")


@st.composite
def conversations(draw):
    turns = draw(st.integers(1, 3))
    msgs = [{"role": "system", "content": draw(content)}] if draw(st.booleans()) else []
    for _ in range(turns):
        msgs += [{"role": "user", "content": draw(content)}, {"role": "assistant", "content": draw(reply)}]
    return msgs


def runs_of(mask: list[int]) -> list[list[int]]:
    out, cur = [], []
    for i, m in enumerate(mask + [0]):
        if m:
            cur.append(i)
        elif cur:
            out.append(cur)
            cur = []
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=conversations())
def test_property_mask_matches_transformers_up_to_straddling_tokens(tokenizer, messages):
    """Against transformers' {% generation %} mask: we train a subset of its tokens, and the only
    tokens it trains that we don't are a run's first token that begins inside the header (the
    boundary rule). Where no token straddles, a run decodes to exactly reply + <|im_end|>."""
    ours = tokenize_conversation(tokenizer, messages, max_length=100_000)
    ref = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert ours.input_ids == list(ref["input_ids"])
    ref_mask = list(ref["assistant_masks"])
    assert all(r >= o for o, r in zip(ours.loss_mask, ref_mask))
    replies = [m["content"] for m in messages if m["role"] == "assistant"]
    ref_runs = runs_of(ref_mask)
    assert len(ref_runs) == len(replies)
    for run, text in zip(ref_runs, replies):
        missing = [i for i in run if not ours.loss_mask[i]]
        if missing:
            assert missing == [run[0]] and tokenizer.decode([ours.input_ids[run[0]]]).startswith("\n")
        else:
            assert tokenizer.decode([ours.input_ids[i] for i in run]) == text + "<|im_end|>"


@pytest.mark.skipif(not (REALDATA / "chat_templates").is_dir(), reason="../shared/realdata absent")
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=conversations(), name=st.sampled_from(["llama-3-instruct", "gemma-it", "vicuna"]))
def test_property_real_templates_never_train_prompt_text(tokenizer, messages, name):
    """Whatever the contents, a trainable run on an indented real template ends with the end-of-turn
    marker and every trained character comes from the reply, the marker, or whitespace."""
    tok = family_tokenizer(tokenizer, name)
    t = tokenize_conversation(tok, messages, max_length=100_000)
    marker = REAL_TEMPLATES[name][1]
    replies = [m["content"].strip() for m in messages if m["role"] == "assistant"]
    runs = trainable_runs(tok, t)
    assert len(runs) == len(replies)
    for run, text in zip(runs, replies):
        body = run.strip()
        assert body.endswith(marker)
        body = body[: -len(marker)].rstrip()
        assert text.endswith(body) or body.replace("\ufffd", "") in text, (run, text)


@pytest.mark.skipif(not (REALDATA / "chat_templates").is_dir(), reason="../shared/realdata absent")
def test_tool_calls_and_tool_results_with_the_real_qwen_template(tokenizer):
    """An OpenAI-style tool call (content null) is trained as the template renders it; the tool's
    result is prompt."""
    tok = family_tokenizer(tokenizer, "qwen2.5-instruct")
    messages = to_messages({"messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": '{"temp": 21}', "name": "get_weather"},
        {"role": "assistant", "content": "It is 21 degrees."}]})
    t = tokenize_conversation(tok, messages, max_length=4096)
    assert trainable_runs(tok, t) == [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
        "It is 21 degrees.<|im_end|>"]


@pytest.mark.skipif(not (REALDATA / "chat_templates").is_dir(), reason="../shared/realdata absent")
@pytest.mark.parametrize("name", ["qwen2.5-instruct"])  # the others insist on user first
def test_a_conversation_that_opens_with_the_assistant_trains_only_replies(tokenizer, name):
    """The first reply has no prompt before it: the template's preamble (a default system prompt,
    BOS) must stay untrained."""
    tok = family_tokenizer(tokenizer, name)
    messages = [{"role": "assistant", "content": "Hi, how can I help?"}, {"role": "user", "content": "Who are you?"},
                {"role": "assistant", "content": "I am TinyChat."}]
    t = tokenize_conversation(tok, messages, max_length=4096)
    assert_replies_then_marker(trainable_runs(tok, t), messages, REAL_TEMPLATES[name][1])
    assert "You are Qwen" not in "".join(trainable_runs(tok, t))


def test_a_conversation_that_opens_with_the_assistant_on_the_builtin_template(tokenizer):
    messages = [{"role": "assistant", "content": "Hi!"}, {"role": "user", "content": "Who are you?"},
                {"role": "assistant", "content": "I am TinyChat."}]
    t = tokenize_conversation(tokenizer, messages, max_length=512)
    assert trainable_runs(tokenizer, t) == ["Hi!<|im_end|>", "I am TinyChat.<|im_end|>"]
    ref = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert t.loss_mask == list(ref["assistant_masks"])
