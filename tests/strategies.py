"""Hypothesis strategies shared by tests/test_masking.py and tests/test_shapes.py: conversations
whose contents hold template markers, pieces of special tokens, whitespace, unicode, and the
private-use characters the span finder marks placeholders with (stages/prepare/shapes.MARKS)."""

from hypothesis import strategies as st

from stages.prepare.shapes import MARKS

PIECES = ["<|im_start|>", "<|im_end|>", "assistant\n", "[INST]", "</s>", "{{ x }}", "{% if %}", "\n", "\n\n", " ", "  ",
          "\t", "你好", "é", "🙂", "\u200b", "ASSISTANT:", "#### 42", *MARKS]
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


SPECIAL_BITS = ["d", "end", ">", "<|im_", "im_end|>", "<|eot_id", "</", "s>", "<end_of_turn", "[/INST]", "<|end|>"]
plain = st.lists(st.one_of(st.sampled_from(PIECES + SPECIAL_BITS), st.text(st.characters(blacklist_categories=("Cs",)),
                                                                             max_size=8)),
                 min_size=1, max_size=6).map(lambda parts: "".join(parts).strip()).filter(lambda s: s != "")


@st.composite
def real_conversations(draw, reply=plain):
    """System prompts (empty ones too), assistant-first openings, replies holding template markers,
    pieces of special tokens, whitespace and unicode."""
    msgs = [{"role": "system", "content": draw(st.sampled_from(["", "You are X."]) | content)}] \
        if draw(st.booleans()) else []
    if draw(st.booleans()):
        msgs.append({"role": "assistant", "content": draw(reply)})
    for _ in range(draw(st.integers(1, 3))):
        msgs += [{"role": "user", "content": draw(content)}, {"role": "assistant", "content": draw(reply)}]
    return msgs
