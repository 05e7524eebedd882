"""Log-likelihood multiple choice (stages/evaluate/choice.py), checked against an independent
reference: each (prompt, option) run alone, unpadded, its option log-probs summed by a Python loop
over raw logits. Batched = naive at several batch sizes; picks and accuracies under the three rules
(lm-eval's acc, acc_norm = per character, acc_bytes = per UTF-8 byte) equal the naive ones; rank
slicing gives the same result for 1, 2 and 3 processes; the rules can disagree (per character and
per byte on non-ASCII options); an option with no tokens is an error naming its row."""

import copy

import pytest
import torch

from conftest import base_model, tiny_config_dict, write_config
from stages.core.config import load_config
from stages.evaluate import choice
from stages.evaluate.choice import choice_scores, option_logprobs, pick


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


ROWS = [
    {"prompt": user("What is the capital of France?"), "choices": ["Paris", "London", "Berlin is the capital"]},
    {"prompt": [{"role": "system", "content": "You are TinyChat."}, *user("Pick a colour.")],
     "choices": ["red", "a deep shade of blue", "green", "巴黎"]},
    {"prompt": user("2 + 2 = ?"), "choices": ["4", "five", "It is four.", "22", "I do not know the answer to that"]},
    {"prompt": user("Who are you?"), "choices": ["I am TinyChat.", "A"]},
    {"prompt": user("你是谁？"), "choices": ["我是 TinyChat。", "TinyChat", "nobody at all", "?"]},
    {"prompt": user("Reverse the words: apple river"), "choices": ["river apple", "apple river", "river"]},
    {"prompt": user("Say yes."), "choices": ["yes", "no", "maybe so", "Yes.", "y"]},
]


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    """The builtin tiny-chat model with scaled random weights (so log-probs depend on the prompt)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tmp = tmp_path_factory.mktemp("choice")
    path = base_model(load_config(write_config(tmp, tiny_config_dict(tmp, n_train=48, n_val=4))))
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model, tok


def naive_logprob(model, tok, prompt: list[dict], option: str) -> tuple[float, int, int]:
    """One sequence, no padding, no batch: sum over the option's positions t of log p(id_t | ids[:t])."""
    rendered = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    ctx = tok(rendered, add_special_tokens=False).input_ids
    opt = tok(option, add_special_tokens=False).input_ids
    ids = list(ctx) + list(opt)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].double()
    total = 0.0
    for t in range(len(ctx), len(ids)):
        row = logits[t - 1]
        total += float(row[ids[t]] - torch.logsumexp(row, dim=0))
    return total, len(opt), len(option.encode("utf-8"))


@pytest.fixture(scope="module")
def naive(lm):
    model, tok = lm
    return [[naive_logprob(model, tok, r["prompt"], o) for o in r["choices"]] for r in ROWS]


def naive_pick(scores: list[float]) -> int:
    return max(range(len(scores)), key=lambda k: (scores[k], -k))  # highest, lowest index on ties


def rows_with_answers(naive) -> list[dict]:
    """Answers: the sum rule's pick on even rows, another option on odd rows (so accuracy is neither 0 nor 1)."""
    rows = []
    for i, (r, opts) in enumerate(zip(ROWS, naive)):
        p = naive_pick([lp for lp, _, _ in opts])
        answer = p if i % 2 == 0 else (p + 1) % len(opts)
        rows.append({**copy.deepcopy(r), "answer": answer, "source": f"s{i}", "reference": r["choices"][answer]})
    return rows


@pytest.mark.parametrize("batch_size", [1, 3, 7])
def test_option_logprobs_equal_the_naive_loop(lm, naive, batch_size):
    model, tok = lm
    got = option_logprobs(model, tok, [r["prompt"] for r in ROWS], [r["choices"] for r in ROWS], batch_size)
    assert [len(g) for g in got] == [len(r["choices"]) for r in ROWS]
    for g_row, n_row in zip(got, naive):
        for (g_lp, g_n, g_b), (n_lp, n_n, n_b) in zip(g_row, n_row):
            assert (g_n, g_b) == (n_n, n_b)
            assert isinstance(g_lp, float) and g_lp == pytest.approx(n_lp, abs=1e-4)
    assert len({n for row in naive for _, n, _ in row}) >= 4  # options of quite different lengths
    assert sum(len(r["choices"]) for r in ROWS) % batch_size or batch_size == 1  # a ragged last batch


def naive_scores(rule: str, row: dict, opts: list[tuple[float, int, int]]) -> list[float]:
    """lm-eval's process_results: lls (acc), lls / len(choice) (acc_norm), lls / UTF-8 bytes (acc_bytes)."""
    lengths = {"sum": [1] * len(opts), "chars": [len(c) for c in row["choices"]],
               "bytes": [len(c.encode("utf-8")) for c in row["choices"]]}[rule]
    return [lp / n for (lp, _, _), n in zip(opts, lengths)]


RULES = ["sum", "chars", "bytes"]


@pytest.mark.parametrize("normalize", RULES)
def test_picks_and_accuracy_equal_the_naive_picks(lm, naive, normalize):
    model, tok = lm
    rows = rows_with_answers(naive)
    metrics, records = choice_scores(model, tok, rows, 0, 1, batch_size=3, normalize=normalize)
    by = {rule: [naive_pick(naive_scores(rule, r, opts)) for r, opts in zip(rows, naive)] for rule in RULES}
    picks = by[normalize]
    answers = [r["answer"] for r in rows]
    assert [r["picked"] for r in records] == picks
    assert [r["prediction"] for r in records] == [r["choices"][p] for r, p in zip(rows, picks)]
    assert [r["correct"] for r in records] == [p == a for p, a in zip(picks, answers)]
    for rec, row, opts in zip(records, rows, naive):
        assert rec["logprobs"] == pytest.approx(naive_scores(normalize, row, opts), abs=1e-4)
    n = len(rows)
    acc = {rule: sum(p == a for p, a in zip(by[rule], answers)) / n for rule in RULES}
    assert 0 < acc["sum"] < 1
    assert metrics == {"accuracy": acc[normalize], "correct": sum(p == a for p, a in zip(picks, answers)), "total": n,
                       "accuracy_sum": acc["sum"], "accuracy_chars": acc["chars"], "accuracy_bytes": acc["bytes"],
                       "mode": "choice"}
    assert set(records[0]) == {"source", "prompt", "reference", "choices", "answer", "prediction", "picked",
                               "correct", "logprobs"}
    _, named = choice_scores(model, tok, rows[:2], 0, 1, batch_size=3, set_name="arc")
    assert [r["set"] for r in named] == ["arc", "arc"]


def test_world_sizes_give_the_same_result(lm, naive, monkeypatch):
    """Rank r of W run serially: pass 1 collects each rank's gathered object, pass 2 hands every rank
    all of them (as all_gather_object would); every rank of every W returns what W=1 returns."""
    model, tok = lm
    rows = rows_with_answers(naive)
    one = choice_scores(model, tok, rows, 0, 1, batch_size=2, normalize="bytes", set_name="v")
    for world in (2, 3):
        parts = []
        monkeypatch.setattr(choice, "gather", lambda obj, parts=parts: parts.append(obj) or [obj])
        for rank in range(world):
            choice_scores(model, tok, rows, rank, world, batch_size=2, normalize="bytes", set_name="v")
        assert [len(p["records"]) for p in parts] == [len(range(r * 7 // world, (r + 1) * 7 // world))
                                                      for r in range(world)]
        monkeypatch.setattr(choice, "gather", lambda obj, parts=parts: parts)
        for rank in range(world):
            metrics, records = choice_scores(model, tok, rows, rank, world, batch_size=2, normalize="bytes",
                                             set_name="v")
            assert metrics == one[0]
            strip = lambda recs: [{k: v for k, v in r.items() if k != "logprobs"} for r in recs]  # noqa: E731
            assert strip(records) == strip(one[1])
            for a, b in zip(records, one[1]):
                assert a["logprobs"] == pytest.approx(b["logprobs"], abs=1e-5)


def test_sum_and_bytes_rules_can_pick_differently(lm):
    """From the naive numbers, a short option that the sum rule prefers and a long one that the
    per-byte rule prefers; scored as one row, each rule picks its own."""
    model, tok = lm
    prompt = user("Describe the weather today.")
    pool = ["a", "?", "no", "x", "Paris", "I am TinyChat.", "The weather today is sunny and warm.",
            "It is a lovely day with a clear blue sky and a light breeze.",
            "You said: the weather today is sunny, warm and a little windy in the afternoon."]
    scored = {o: naive_logprob(model, tok, prompt, o) for o in pool}
    pair = next(((a, b) for a in pool for b in pool
                 if scored[a][0] > scored[b][0] and scored[a][0] / scored[a][2] < scored[b][0] / scored[b][2]), None)
    assert pair is not None
    short, long = pair
    rows = [{"prompt": prompt, "choices": [short, long], "answer": 1, "source": "w", "reference": long}]
    m_sum, r_sum = choice_scores(model, tok, rows, 0, 1, batch_size=2, normalize="sum")
    m_bytes, r_bytes = choice_scores(model, tok, rows, 0, 1, batch_size=2, normalize="bytes")
    assert (r_sum[0]["picked"], r_bytes[0]["picked"]) == (0, 1)
    assert (m_sum["accuracy"], m_bytes["accuracy"]) == (0.0, 1.0)
    assert m_sum["accuracy_sum"] == m_bytes["accuracy_sum"] == 0.0
    assert m_sum["accuracy_bytes"] == m_bytes["accuracy_bytes"] == 1.0


NON_ASCII = [
    {"prompt": user("What is the capital of Colombia?"), "choices": ["Bogotá", "Medellín", "Lima", "Bogota", "Cali"]},
    {"prompt": user("中国的首都是哪里？"), "choices": ["北京", "上海", "Beijing", "It is Beijing.", "东京"]},
    {"prompt": user("How do you say thank you in Japanese?"),
     "choices": ["ありがとう", "arigatou", "すみません", "thanks", "ありがとうございます"]},
]


def test_chars_and_bytes_rules_on_non_ascii_options_equal_lm_evals_rules(lm):
    """acc_norm divides by len(str), acc_bytes by UTF-8 bytes: on options beyond ASCII ("北京" is 2
    characters, 6 bytes) they rank differently. Rows: the three above plus, per prompt, a pair
    found from the naive numbers on which the two rules disagree; each rule's picks, scores and
    accuracy equal lm-eval's formulas applied to the naive log-likelihoods."""
    model, tok = lm
    assert [(len(o), len(o.encode("utf-8"))) for o in ("Bogotá", "北京", "ありがとう")] == [(6, 7), (2, 6), (5, 15)]
    rows = [copy.deepcopy(r) for r in NON_ASCII]
    pool = sorted({o for r in NON_ASCII for o in r["choices"]})
    for r in NON_ASCII:
        scored = {o: naive_logprob(model, tok, r["prompt"], o) for o in pool}
        pair = next(([a, b] for a in pool for b in pool
                     if scored[a][0] / len(a) > scored[b][0] / len(b)
                     and scored[a][0] / len(a.encode()) < scored[b][0] / len(b.encode())), None)
        if pair is not None:
            rows.append({"prompt": r["prompt"], "choices": pair})
    naive = [[naive_logprob(model, tok, r["prompt"], o) for o in r["choices"]] for r in rows]
    by = {rule: [naive_pick(naive_scores(rule, r, opts)) for r, opts in zip(rows, naive)] for rule in RULES}
    assert len(rows) > len(NON_ASCII) and any(c != b for c, b in zip(by["chars"], by["bytes"]))
    for i, r in enumerate(rows):  # the answer: the per-character pick, but on row 1 neither rule's
        answer = by["chars"][i] if i != 1 else min({0, 1, 2} - {by["chars"][i], by["bytes"][i]})
        r.update(answer=answer, source=f"n{i}", reference=r["choices"][answer])
    answers = [r["answer"] for r in rows]
    acc = {rule: sum(p == a for p, a in zip(by[rule], answers)) / len(rows) for rule in RULES}
    for rule in RULES:
        metrics, records = choice_scores(model, tok, rows, 0, 1, batch_size=4, normalize=rule)
        assert [rec["picked"] for rec in records] == by[rule], rule
        for rec, r, opts in zip(records, rows, naive):
            assert rec["logprobs"] == pytest.approx(naive_scores(rule, r, opts), abs=1e-4)
        assert {k: metrics[k] for k in ("accuracy", "accuracy_sum", "accuracy_chars", "accuracy_bytes")} == \
            {"accuracy": acc[rule], "accuracy_sum": acc["sum"], "accuracy_chars": acc["chars"],
             "accuracy_bytes": acc["bytes"]}
    assert acc["bytes"] < acc["chars"] < 1


@pytest.mark.parametrize("value, rule", [(False, "sum"), ("chars", "chars"), ("bytes", "bytes"), (True, "bytes")])
def test_length_normalized_names_the_rule(tmp_path, value, rule):
    """`length_normalized: true` keeps meaning per UTF-8 byte, as it did before `chars` existed; the
    CLI's dotted override reads the same way."""
    raw = tiny_config_dict(tmp_path, n_train=8, n_val=2)
    raw["eval"]["sets"] = {"mc": {"data_paths": [raw["data"]["val_data_paths"][0]], "mode": "choice",
                                  "length_normalized": value}}
    assert load_config(write_config(tmp_path, raw)).eval.sets["mc"].choice_rule == rule
    del raw["eval"]["sets"]["mc"]["length_normalized"]
    path = write_config(tmp_path, raw)
    assert load_config(path).eval.sets["mc"].choice_rule == "sum"
    assert (load_config(path, [f"eval.sets.mc.length_normalized={str(value).lower()}"]).eval.sets["mc"].choice_rule
            == rule)
    with pytest.raises(Exception, match="length_normalized"):
        load_config(path, ["eval.sets.mc.length_normalized=tokens"])


def test_ties_go_to_the_lowest_index():
    assert pick([-1.0, -1.0, -2.0]) == 0 and pick([-3.0, -1.0, -1.0]) == 1 and pick([-5.0]) == 0


def test_an_option_with_no_tokens_is_an_error_naming_its_row(lm):
    model, tok = lm
    with pytest.raises(ValueError, match=r"row 1: choice 2 \(''\) tokenizes to no tokens"):
        option_logprobs(model, tok, [user("a"), user("b")], [["x", "y"], ["x", "y", ""]], batch_size=4)
    rows = [{"prompt": user(str(i)), "choices": ["x", ""] if i == 4 else ["x", "y"], "answer": 0, "source": "s",
             "reference": "x"} for i in range(6)]
    with pytest.raises(ValueError, match=r"row 4: choice 1"):  # numbered in the whole set, on any rank
        choice_scores(model, tok, rows, 1, 2, batch_size=4)
    with pytest.raises(ValueError, match=r"row 0: 'answer'"):
        choice_scores(model, tok, [{**rows[0], "answer": 2}], 0, 1, batch_size=4)
    with pytest.raises(ValueError, match="normalize"):
        choice_scores(model, tok, rows[:1], 0, 1, batch_size=4, normalize="tokens")


def test_a_bf16_model_scores_in_float32(lm):
    """The bf16 model's own logits, log-softmaxed in float32: equal to the naive reference on the same bf16
    model (its logits summed in float64) up to float32 rounding (TOL). One unpadded pass per option at batch
    size 1 is the reference's own forward, so the logits are the same bits; a log-softmax in bf16 misses by
    up to 0.76 on these rows, and the fp32 model's scores differ by up to 0.39 (bf16 weights)."""
    model, tok = lm
    half = copy.deepcopy(model).to(torch.bfloat16)
    rows = ROWS[:3]
    reference = [[naive_logprob(half, tok, r["prompt"], o) for o in r["choices"]] for r in rows]
    got = option_logprobs(half, tok, [r["prompt"] for r in rows], [r["choices"] for r in rows], 1,
                          share_prompts=False)
    for g_row, n_row in zip(got, reference, strict=True):
        for (g_lp, g_n, g_b), (n_lp, n_n, n_b) in zip(g_row, n_row, strict=True):
            assert isinstance(g_lp, float) and (g_n, g_b) == (n_n, n_b)
            assert g_lp == pytest.approx(n_lp, **TOL)


# --------------------------------------------------------------------------- one prompt forward per item
# option_logprobs runs each prompt once and scores its options from the prompt's KV cache. Checked
# against the naive loop above (one unpadded forward per option, an independent reference) and
# against the one-pass-per-option path (`share_prompts=False`, the fallback). Tolerance: 1e-5
# absolute, or 2e-6 relative on these random-weight log-likelihoods of up to ~-300 (float32's
# spacing at 290 is 3e-5; the one-pass path itself moves by 2e-5 between batch sizes there).
MIXED = ROWS + NON_ASCII
TOL = {"rel": 2e-6, "abs": 1e-5}


@pytest.fixture(scope="module")
def naive_mixed(lm):
    model, tok = lm
    return [[naive_logprob(model, tok, r["prompt"], o) for o in r["choices"]] for r in MIXED]


def spy_shared(monkeypatch) -> list:
    """Results of each _logprobs_shared_prompt call (None = it declined the model)."""
    calls, real = [], choice._logprobs_shared_prompt
    monkeypatch.setattr(choice, "_logprobs_shared_prompt", lambda *a: calls.append(real(*a)) or calls[-1])
    return calls


@pytest.mark.parametrize("batch_size", [1, 2, 3, 5, 8, 64])
def test_one_prompt_forward_equals_a_forward_per_option(lm, naive_mixed, monkeypatch, batch_size):
    model, tok = lm
    prompts, options = [r["prompt"] for r in MIXED], [r["choices"] for r in MIXED]
    calls = spy_shared(monkeypatch)
    shared = option_logprobs(model, tok, prompts, options, batch_size)
    assert len(calls) == 1 and calls[0] is not None  # the shared path ran
    per_option = option_logprobs(model, tok, prompts, options, batch_size, share_prompts=False)
    assert len(calls) == 1
    for s_row, o_row, n_row in zip(shared, per_option, naive_mixed):
        assert [(n, b) for _, n, b in s_row] == [(n, b) for _, n, b in o_row] == [(n, b) for _, n, b in n_row]
        for (s, _, _), (o, _, _), (n, _, _) in zip(s_row, o_row, n_row):
            assert isinstance(s, float) and s == pytest.approx(o, **TOL) and s == pytest.approx(n, **TOL)
    for rule in RULES:  # every rule picks as the naive loop and as the one-pass path
        for row, s_row, o_row, n_row in zip(MIXED, shared, per_option, naive_mixed):
            want = naive_pick(naive_scores(rule, row, n_row))
            assert naive_pick(naive_scores(rule, row, s_row)) == naive_pick(naive_scores(rule, row, o_row)) == want


@pytest.mark.parametrize("world, batch_size", [(1, 3), (2, 1), (2, 8)])
def test_one_prompt_forward_under_one_and_two_ranks(lm, naive_mixed, monkeypatch, world, batch_size):
    """Each rank of W scores its rank_slice with the shared path; the last rank is handed every
    rank's part (as all_gather_object would) and returns records that carry the naive loop's picks
    and scores under every rule."""
    model, tok = lm
    rows = []
    for i, (r, opts) in enumerate(zip(MIXED, naive_mixed)):
        answer = naive_pick([lp for lp, _, _ in opts]) if i % 2 == 0 else 0
        rows.append({**copy.deepcopy(r), "answer": answer, "source": f"m{i}", "reference": r["choices"][answer]})
    calls = spy_shared(monkeypatch)
    for rule in RULES:
        parts = []
        monkeypatch.setattr(choice, "gather", lambda obj, parts=parts: parts.append(obj) or list(parts))
        for rank in range(world):
            metrics, records = choice_scores(model, tok, rows, rank, world, batch_size=batch_size, normalize=rule)
        assert [len(p["records"]) for p in parts] == [len(range(r * len(rows) // world, (r + 1) * len(rows) // world))
                                                      for r in range(world)]
        want = [naive_pick(naive_scores(rule, r, opts)) for r, opts in zip(rows, naive_mixed)]
        assert [rec["picked"] for rec in records] == want, rule
        for rec, r, opts in zip(records, rows, naive_mixed):
            assert rec["logprobs"] == pytest.approx(naive_scores(rule, r, opts), **TOL)
        assert metrics["accuracy"] == sum(p == r["answer"] for p, r in zip(want, rows)) / len(rows)
    assert len(calls) == 3 * world and all(c is not None for c in calls)


class OwnModel(torch.nn.Module):
    """A model of one's own around the tiny one: logits only, no cache."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, attention_mask=None, use_cache=False):
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)


def test_models_without_a_shareable_cache_take_a_forward_per_option(lm, naive_mixed, monkeypatch):
    """A non-Transformers model is never offered the shared path; a Transformers model whose cache is
    not a plain DynamicCache (here: sliding-window layers) is declined after its first prompt batch.
    Both score one forward per option, equal to the naive loop."""
    model, tok = lm
    prompts, options = [r["prompt"] for r in MIXED], [r["choices"] for r in MIXED]
    calls = spy_shared(monkeypatch)
    own = option_logprobs(OwnModel(model), tok, prompts, options, 4)
    assert calls == []
    cfg = copy.deepcopy(model.config)
    cfg.use_sliding_window, cfg.sliding_window, cfg.max_window_layers = True, 4096, 0
    cfg.layer_types = ["sliding_attention"] * cfg.num_hidden_layers
    sliding = type(model)(cfg).eval()
    sliding.load_state_dict(model.state_dict())
    slid = option_logprobs(sliding, tok, prompts, options, 4)
    assert calls == [None]  # offered, declined
    for got in (own, slid):
        for g_row, n_row in zip(got, naive_mixed):
            for (g, g_n, g_b), (n, n_n, n_b) in zip(g_row, n_row):
                assert (g_n, g_b) == (n_n, n_b) and g == pytest.approx(n, **TOL)
