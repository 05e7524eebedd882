"""The render-once path (stages/prepare/shapes.py) against the per-row path it replaces: same text,
same spans, same errors, on every real template and on templates built to defeat it."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import REAL_TEMPLATES, TEMPLATES
from stages.chatdata.readers import RowError
from stages.models.builtin import CHATML_TEMPLATE
from stages.prepare.masking import Renderer, exact_spans
from stages.prepare.shapes import MARK_PAIRS, MARKS
from strategies import content, real_conversations, reply

HAVE_REAL = TEMPLATES.is_dir()


def renderer_of(name: str) -> Renderer:
    if name == "builtin":
        return Renderer(CHATML_TEMPLATE, {"eos_token": "<|im_end|>"})
    return Renderer((TEMPLATES / f"{name}.jinja").read_text(), REAL_TEMPLATES[name][0])


def both_paths(r: Renderer, messages: list[dict], loss_on: str):
    try:
        slow = exact_spans(r, messages, loss_on)
    except RowError as e:
        slow = e.reason
    fast = r.shaped(messages, loss_on)
    return fast, slow


NAMES = ["builtin"] + (sorted(REAL_TEMPLATES) if HAVE_REAL else [])


@pytest.mark.parametrize("name", NAMES)
def test_every_real_template_is_proven_opaque(name):
    """Each template the project meets in practice takes the render-once path."""
    assert renderer_of(name).opaque_reason is None


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=real_conversations(reply=reply), name=st.sampled_from(NAMES),
       loss_on=st.sampled_from(["assistant", "last_assistant", "all"]))
def test_render_once_equals_the_per_row_path(messages, name, loss_on):
    """Whitespace around contents, empty system prompts, template markers inside contents,
    assistant-first openings: where the render-once path answers, it answers exactly as the
    per-row path; where the per-row path refuses the row, the render-once path does not answer."""
    r = renderer_of(name)
    fast, slow = both_paths(r, messages, loss_on)
    if isinstance(slow, str):
        assert fast is None
    elif fast is not None:
        assert fast == (slow[0], [tuple(s) for s in slow[1]])


@pytest.mark.parametrize("name", NAMES)
def test_render_once_answers_for_ordinary_rows(name):
    r = renderer_of(name)
    msgs = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": " Who are you?\n"}, {"role": "assistant", "content": "I am X."}]
    for loss_on in ("assistant", "last_assistant", "all"):
        fast, slow = both_paths(r, msgs, loss_on)
        assert fast is not None and fast == (slow[0], [tuple(s) for s in slow[1]])
    assert len(r._plans) == 3  # one plan per shape and loss_on, reused for any contents
    other = [dict(m, content=m["content"] + " more words") for m in msgs]
    assert r.shaped(other, "assistant") == tuple(exact_spans(r, other, "assistant"))[:1] + (
        [tuple(s) for s in exact_spans(r, other, "assistant")[1]],)
    assert len(r._plans) == 3


CONTENT_AWARE = {
    "searches content": "{% for m in messages %}{% if '</think>' in m.content %}{{ m.content.split('</think>')[-1] }}"
                        "{% else %}{{ m.content }}{% endif %}{% endfor %}",
    "compares content": "{% for m in messages %}{% if m['content'] == 'x' %}X{% endif %}{{ m['content'] }}{% endfor %}",
    "content length": "{% for m in messages %}{{ m.content | length }}{{ m.content }}{% endfor %}",
    "tojson message": "{% for m in messages %}{{ m | tojson }}{% endfor %}",
    "tojson content": "{% for m in messages %}{{ m.content | tojson }}{% endfor %}",
    "content via a variable": "{% for m in messages %}{% set c = m.content %}{% if c.startswith('a') %}A{% endif %}"
                              "{{ c }}{% endfor %}",
    "content via namespace": "{% set ns = namespace(c='') %}{% for m in messages %}{% set ns.c = m.content %}"
                             "{% if ns.c == 'q' %}Q{% endif %}{{ ns.c }}{% endfor %}",
    "next message's content": "{% for m in messages %}{% if loop.nextitem and loop.nextitem.content == 'z' %}Z"
                              "{% endif %}{{ m.content }}{% endfor %}",
    "content sliced": "{% for m in messages %}{{ m.content[:5] }}{% endfor %}",
    "date in template": "{{ strftime_now('%d') }}{% for m in messages %}{{ m.content }}{% endfor %}",
    "selectattr": "{% for m in messages | selectattr('role', 'equalto', 'user') %}{{ m.content }}{% endfor %}",
    "message get compared": "{% for m in messages %}{% if m.get('content') != '' %}{{ m.content }}{% endif %}"
                            "{% endfor %}",
}


@pytest.mark.parametrize("why", sorted(CONTENT_AWARE))
def test_templates_that_read_content_keep_the_per_row_path(why):
    r = Renderer(CONTENT_AWARE[why], {})
    assert r.opaque_reason is not None
    assert r.shaped([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], "assistant") is None


def test_a_template_that_trims_only_some_contents_keeps_the_per_row_path():
    t = ("{% for m in messages %}<{{ m.role }}>{% if m.role == 'user' %}{{ m.content | trim }}{% else %}"
         "{{ m.content }}{% endif %}</s>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
    r = Renderer(t, {})
    assert r.opaque_reason is None
    msgs = [{"role": "user", "content": " hi "}, {"role": "assistant", "content": "yo"}]
    assert r.shaped(msgs, "assistant") is None
    assert exact_spans(r, msgs, "assistant")[0] == "<user>hi</s><assistant>yo</s>"


@settings(max_examples=150, deadline=None)
@given(system=content, user=content, answer=reply)
def test_the_plan_does_not_depend_on_the_first_row_of_its_shape(system, user, answer):
    """Two rows of one shape: the second row's result does not carry anything of the first's."""
    r = renderer_of("builtin")
    first = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
             {"role": "assistant", "content": "A"}]
    r.shaped(first, "assistant")
    second = [{"role": "system", "content": system}, {"role": "user", "content": user},
              {"role": "assistant", "content": answer}]
    fast, slow = both_paths(r, second, "assistant")
    if isinstance(slow, str):
        assert fast is None
    elif fast is not None:
        assert fast == (slow[0], [tuple(s) for s in slow[1]])


MARKED_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ pua }}{{ m.content }}</s>\n{% endfor %}"
                   "{% if add_generation_prompt %}<assistant>{{ pua }}{% endif %}")


@pytest.mark.parametrize("taken", range(len(MARK_PAIRS) + 1))
def test_a_template_holding_the_marks_gets_a_plan_with_the_next_pair(taken):
    """The template's own text holds the first `taken` mark pairs: the plan uses the next pair, and
    with none left the shape takes the per-row path; rows holding every mark are exact either way."""
    pua = "".join(a + b for a, b in MARK_PAIRS[:taken])
    r = Renderer(MARKED_TEMPLATE.replace("{{ pua }}", pua), {})
    assert r.opaque_reason is None
    everything = "".join(MARKS)
    for msgs in ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
                 [{"role": "system", "content": everything}, {"role": "user", "content": "hi " + everything},
                  {"role": "assistant", "content": everything + " yo"}]):
        fast, slow = both_paths(r, msgs, "assistant")
        assert [slow[0][a:b] for a, b in slow[1]] == [msgs[-1]["content"] + "</s>"]
        if taken < len(MARK_PAIRS):
            assert fast == (slow[0], [tuple(s) for s in slow[1]])
        else:
            assert fast is None
