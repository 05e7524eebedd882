"""Evaluate: scorers, and exactness against an independent reference -- a one-prompt-at-a-time
greedy loop over raw logits -- with 1 and 2 processes on 7 samples (batch 3: neither a multiple
of the batch nor of batch x world). Also: which models can be scored (eval.model / --model),
and a non-Hugging-Face model scored through its worker's get_eval_model_output."""

import json
import math
import re
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import ROOT, demo_rows, sftflow, tiny_config_dict, write_config, write_jsonl
from stages.core.config import ConfigError, config_from_dict, load_config
from stages.evaluate.runner import rank_slice
from stages.evaluate.scorers import get_scorer, normalize
from stages.pipeline import REFERENCES, plan, run_stage

N_VAL, BATCH, MAX_NEW = 7, 3, 8


# --------------------------------------------------------------------------- scorers (no model)


def first_word(prediction: str, reference: str) -> bool:
    """A custom scorer, named as 'test_evaluate:first_word'."""
    return normalize(prediction).split()[:1] == normalize(reference).split()[:1]


def test_builtin_scorers():
    exact, norm, contains = get_scorer("exact"), get_scorer("normalized"), get_scorer("contains")
    assert exact(" Paris\n", "Paris") and not exact("paris", "Paris")
    assert normalize("  The  Answer: PARIS!! ") == "the answer paris"
    assert norm("the answer, paris.", "The Answer Paris") and not norm("Paris, France", "Paris")
    assert contains("I think it is Paris, France.", "paris") and not contains("Parisian", "Paris")
    assert not contains("anything", "  ")
    assert contains("我是Lumen，由Orbit Labs开发。", "Lumen") and contains("首都是巴黎。", "巴黎")
    assert contains("I'm Lumen.", "lumen") and not contains("Lumens of light", "Lumen")
    assert not contains("illumenate", "lumen") and contains("Lumen/Orbit", "lumen")
    regex = get_scorer("regex")
    assert regex("so 6 * 7 = 42\n#### 42", "Six times seven.\n#### 42")
    assert not regex("#### 41", "#### 42") and not regex("42", "#### 42")  # no answer marker: wrong
    assert regex("first #### 3 then #### 1,234", "#### 1,234")  # the last match counts
    assert get_scorer("regex", answer_pattern=r"answer is (\w+)")("The answer is B.", "answer is B")
    numeric = get_scorer("numeric")
    assert numeric("#### 1,234.0", "#### 1234") and numeric("about 3.5 apples", "3.50")
    assert numeric("it is 7 then 12", "12") and not numeric("12.5", "12") and not numeric("none", "12")
    assert get_scorer("numeric", numeric_tolerance=0.1)("1.05", "1.0")
    custom = get_scorer("test_evaluate:first_word")
    assert custom("Yes, because", "Yes") and not custom("No", "Yes")


def test_scorer_config_errors_are_one_line(tmp_path):
    for ev, expected in [({"scorer": "fuzzy"}, "eval.scorer: 'fuzzy' is neither a builtin scorer"),
                         ({"answer_pattern": "(unclosed"}, "eval.answer_pattern: not a valid regular expression")]:
        with pytest.raises(ConfigError) as e:
            config_from_dict(tiny_config_dict(tmp_path, eval=ev))
        assert expected in str(e.value) and "\n" not in str(e.value)
    cfg = config_from_dict(tiny_config_dict(tmp_path, eval={"scorer": "no_such_module:fn"}))  # shape is fine
    with pytest.raises(ConfigError, match="eval.scorer='no_such_module:fn': cannot import"):
        plan(cfg)  # before anything runs


def test_rank_slices_cover_every_sample_once():
    for n in range(0, 12):
        for world in (1, 2, 3, 5):
            got = [i for r in range(world) for i in rank_slice(n, r, world)]
            assert got == list(range(n))


# --------------------------------------------------------------------------- a model and its reference


def naive_greedy(model, tok, prompt: list[dict]) -> tuple[str, int]:
    """One prompt, no batching, no padding, no KV cache, no `generate`: argmax of the last logits."""
    ids = list(tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True,
                                       return_dict=True)["input_ids"])
    gen_eos = model.generation_config.eos_token_id
    stops = {tok.eos_token_id, *(gen_eos if isinstance(gen_eos, list) else [gen_eos])}
    new: list[int] = []
    with torch.no_grad():
        while len(new) < MAX_NEW:
            t = int(model(input_ids=torch.tensor([ids + new])).logits[0, -1].argmax())
            if t in stops:
                break
            new.append(t)
    return tok.decode(new, skip_special_tokens=True), len(new)


def naive_loss(model, rows: list[dict]) -> float:
    """Token-weighted cross-entropy over every sample's trainable tokens, one sample at a time."""
    loss_sum, tokens = 0.0, 0
    with torch.no_grad():
        for r in rows:
            ids = torch.tensor(r["input_ids"]).long()
            mask = torch.tensor(r["loss_mask"])[1:].bool()
            logits = model(input_ids=ids[None]).logits[0, :-1]
            loss_sum += F.cross_entropy(logits[mask], ids[1:][mask], reduction="sum").item()
            tokens += int(mask.sum())
    return loss_sum / tokens


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A prepared eval set of 7 prompts whose references match what the model says for some of them,
    a model that says different things to different prompts (and stops early on some), and the
    naive loop's answers."""
    from conftest import base_model, noisy_model
    tmp = tmp_path_factory.mktemp("evaluate")
    raw = tiny_config_dict(tmp, n_train=48, n_val=N_VAL, eval={"batch_size": BATCH, "max_new_tokens": MAX_NEW})
    cfg = load_config(write_config(tmp, raw))
    model_dir = tmp / "model"
    model, tok = noisy_model(base_model(cfg), model_dir)

    rows = demo_rows("eval.jsonl", N_VAL)
    naive = [naive_greedy(model, tok, r["messages"][:-1]) for r in rows]
    for i, r in enumerate(rows):  # some references are exactly what the model will say
        if i % 2 == 0 and naive[i][0].strip():
            r["messages"][-1]["content"] = naive[i][0]
    write_jsonl(tmp / "val.jsonl", rows)
    cfg = load_config(write_config(tmp, raw))
    run_stage(plan(cfg), "prepare")
    return {"tmp": tmp, "raw": raw, "model": model, "tok": tok, "model_dir": model_dir, "naive": naive}


def config(setup, name: str, **sections):
    raw = json.loads(json.dumps(setup["raw"]))
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    return load_config(write_config(setup["tmp"], raw, name))


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def evaluate(cfg, force: bool = False):
    p = plan(cfg)
    if "prepare_eval" in p.stages:
        run_stage(p, "prepare_eval", on_line=lambda line: None)
    for ref in REFERENCES:
        if ref in p.stages:
            run_stage(p, ref, on_line=lambda line: None)
    result = run_stage(p, "evaluate", force=force, on_line=lambda line: None)
    return result, read_jsonl(Path(result.path) / "predictions.jsonl")


def baseline_records(cfg) -> list[dict]:
    return read_jsonl(plan(cfg).folder("baseline") / "predictions.jsonl")


def check_against_naive(setup, metrics: dict, records: list[dict]) -> None:
    naive = setup["naive"]
    assert [r["prediction"] for r in records] == [text for text, _ in naive]
    assert [r["new_tokens"] for r in records] == [n for _, n in naive]
    expected = [text.strip() == r["reference"].strip() for r, (text, _) in zip(records, naive)]
    assert [r["correct"] for r in records] == expected
    assert 0 < sum(expected) < N_VAL  # the check means something
    assert metrics["total"] == N_VAL == len(records)
    assert metrics["correct"] == sum(expected)
    assert metrics["accuracy"] == pytest.approx(sum(expected) / N_VAL)
    assert metrics["mean_generated_tokens"] == pytest.approx(sum(n for _, n in naive) / N_VAL)
    assert any(n < MAX_NEW for _, n in naive)  # some replies stopped at a stop token


def test_one_process_equals_the_naive_loop(setup):
    from stages.evaluate import eval_samples
    cfg = config(setup, "one.yaml", actor={"nproc_per_node": 1}, eval={"model": str(setup["model_dir"])})
    result, records = evaluate(cfg)
    m = result.metrics
    check_against_naive(setup, m, records)
    rows = eval_samples(read_manifest(result.path)["prepare_dir"])
    assert m["eval_loss"] == pytest.approx(naive_loss(setup["model"], rows), rel=1e-5)
    assert m["perplexity"] == pytest.approx(math.exp(m["eval_loss"]))
    assert m["eval_tokens"] == sum(int(np.sum(np.asarray(r["loss_mask"])[1:])) for r in rows)
    assert {"base_accuracy", "base_eval_loss", "token_accuracy"} <= set(m)
    assert len(baseline_records(cfg)) == N_VAL
    assert (Path(result.path) / "metrics.json").is_file()


def test_max_samples_spreads_over_the_whole_set(setup):
    """`eval.max_samples` scores rows from across the set (0, 2, 4 of 7), not its first rows, and
    the scores are the naive loop's on exactly those rows."""
    cfg = config(setup, "three.yaml", actor={"nproc_per_node": 1},
                 eval={"model": str(setup["model_dir"]), "max_samples": 3})
    result, records = evaluate(cfg)
    picked = [0, 2, 4]  # i * 7 // 3
    refs = [r["messages"][-1]["content"] for r in read_jsonl(setup["tmp"] / "val.jsonl")]
    assert [r["reference"] for r in records] == [refs[i] for i in picked]
    naive = [setup["naive"][i] for i in picked]
    assert [r["prediction"] for r in records] == [text for text, _ in naive]
    assert result.metrics["total"] == 3
    assert result.metrics["correct"] == sum(text.strip() == refs[i].strip() for i, (text, _) in zip(picked, naive))


def read_manifest(path) -> dict:
    return json.loads((Path(path) / "manifest.json").read_text())


@pytest.mark.slow
def test_two_processes_equal_the_naive_loop_and_one_process(setup):
    one = config(setup, "one.yaml", actor={"nproc_per_node": 1}, eval={"model": str(setup["model_dir"])})
    # torchrun's ranks, as on GPUs (auto scores so small an evaluation in the stage's process on CPU)
    two = config(setup, "two.yaml", actor={"nproc_per_node": 2}, eval={"model": str(setup["model_dir"]),
                                                                       "eval_base": False, "launch": "torchrun"})
    assert plan(two).fingerprints["evaluate"] != plan(one).fingerprints["evaluate"]  # eval_base differs
    result, records = evaluate(two)
    check_against_naive(setup, result.metrics, records)
    first, first_records = evaluate(one)  # cached by the test above, or computed now
    assert records == first_records
    for k in ("accuracy", "correct", "total", "eval_loss", "eval_tokens", "token_accuracy", "mean_generated_tokens"):
        assert result.metrics[k] == pytest.approx(first.metrics[k], rel=1e-6), k
    assert "evaluate model" in (Path(result.path) / "eval.log").read_text()
    assert read_manifest(result.path)["world_size"] == 2


def test_a_checkpoint_and_the_base_model_can_be_scored_without_training(setup):
    import torch.distributed.checkpoint as dcp
    ckpt = setup["tmp"] / "checkpoints" / "step_00000003"
    with pytest.warns(UserWarning, match="single process"):
        dcp.save({"model": setup["model"].state_dict()}, checkpoint_id=str(ckpt), no_dist=True)
    (ckpt / "COMPLETE").write_text("3")
    cfg = config(setup, "ckpt.yaml", actor={"nproc_per_node": 1}, eval={"model": str(ckpt), "eval_base": False})
    p = plan(cfg)
    assert p.status("train") == "missing"  # evaluate of another model needs only prepare
    result, records = evaluate(cfg)
    assert read_manifest(result.path)["model_kind"] == "checkpoint"
    check_against_naive(setup, result.metrics, records)

    base = config(setup, "base.yaml", actor={"nproc_per_node": 1}, eval={"model": "base"})
    result, _ = evaluate(base)
    assert result.metrics["base_accuracy"] == result.metrics["accuracy"]
    assert len({plan(c).fingerprints["evaluate"] for c in (cfg, base, config(setup, "d.yaml"))}) == 3
    with pytest.raises(ConfigError, match="register: eval.model="):
        run_stage(plan(base), "register")


def test_model_identity_is_in_the_fingerprint(setup, tmp_path):
    import shutil
    copy = tmp_path / "copy"
    shutil.copytree(setup["model_dir"], copy)
    a = plan(config(setup, "a.yaml", eval={"model": str(setup["model_dir"])})).fingerprints["evaluate"]
    b = plan(config(setup, "b.yaml", eval={"model": str(copy)})).fingerprints["evaluate"]
    (copy / "generation_config.json").write_text((copy / "generation_config.json").read_text() + "\n")
    c = plan(config(setup, "c.yaml", eval={"model": str(copy)})).fingerprints["evaluate"]
    assert len({a, b, c}) == 3  # the path is part of eval.*; the content too (b -> c: same path, edited file)
    with pytest.raises(ConfigError, match="is not a model folder"):
        plan(config(setup, "e.yaml", eval={"model": str(tmp_path)}))


def test_cli_stage_evaluate_model_option(setup, tmp_path):
    cfg_path = write_config(tmp_path, tiny_config_dict(tmp_path, n_train=48, n_val=N_VAL))
    proc = sftflow("stage", "evaluate", "-c", str(cfg_path), "--model", str(setup["model_dir"]), cwd=tmp_path,
                   timeout=120)
    assert proc.returncode == 2
    assert "needs the prepare stage" in proc.stderr  # not train: --model replaces the trained model
    proc = sftflow("stage", "train", "-c", str(cfg_path), "--model", "base", cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and "--model applies to `sftflow stage evaluate` only" in proc.stderr


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_api")
def test_cli_evaluate_model_with_upstream_prepares_but_never_trains(tmp_path):
    cfg_path = write_config(tmp_path, tiny_config_dict(tmp_path, n_train=48, n_val=N_VAL,
                                                       actor={"nproc_per_node": 1, "global_batch_size": 4}))
    proc = sftflow("stage", "evaluate", "-c", str(cfg_path), "--model", "base", "--with-upstream", cwd=tmp_path,
                   timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "scored: base" in proc.stdout
    art = tmp_path / "artifacts"
    assert list((art / "prepare").glob("[!.]*/manifest.json")) and list((art / "evaluate").glob("[!.]*/manifest.json"))
    assert not (art / "train").exists()


# --------------------------------------------------------------------------- a non-Hugging-Face model


@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_custom_worker_accuracy_is_summed_over_every_sample(setup, tmp_path, monkeypatch, nproc):
    from safetensors.torch import save_file
    import custom_model
    monkeypatch.setenv("PYTHONPATH", str(ROOT / "tests") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    torch.manual_seed(5)
    net = custom_model.build_tiny_mlp({}, None)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn(p.shape) * 0.5)
    (tmp_path / "mlp").mkdir()
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(tmp_path / "mlp" / "model.safetensors"))
    cfg = config(setup, f"mlp{nproc}.yaml", actor={"nproc_per_node": nproc, "worker": "custom_model:MLPWorker",
                                                   "model": {"model_type": "tiny_mlp"}},
                 eval={"model": str(tmp_path / "mlp"), "batch_size": 10})
    result, records = evaluate(cfg)
    ds = custom_model.Blobs(96, seed=1)  # what MLPWorker evaluates on
    with torch.no_grad():
        logits = net(torch.from_numpy(ds.x))
        base_logits = custom_model.build_tiny_mlp({}, None)(torch.from_numpy(ds.x))
    correct = int((logits.argmax(-1).numpy() == ds.y).sum())
    m = result.metrics
    assert (m["mode"], m["total"], m["correct"]) == ("worker", 96, correct)
    assert m["accuracy"] == pytest.approx(correct / 96)
    assert m["eval_loss"] == pytest.approx(F.cross_entropy(logits, torch.from_numpy(ds.y)).item(), rel=1e-5)
    assert m["base_correct"] == int((base_logits.argmax(-1).numpy() == ds.y).sum()) != correct
    assert records == []


def test_a_model_that_cannot_be_scored_says_why(setup, tmp_path):
    from safetensors.torch import save_file
    import custom_model
    from stages.evaluate import EvaluationError
    (tmp_path / "mlp").mkdir()
    save_file(custom_model.build_tiny_mlp({}, None).state_dict(), str(tmp_path / "mlp" / "model.safetensors"))
    cfg = config(setup, "nohf.yaml", actor={"nproc_per_node": 1, "model": {"model_type": "tiny_mlp"}},
                 eval={"model": str(tmp_path / "mlp")})
    with pytest.raises(EvaluationError, match="not a Hugging Face causal LM.*get_eval_model_output"):
        evaluate(cfg)


def test_named_eval_sets_are_each_scored_with_their_own_scorer(setup):
    """Two sets from their own files, no val split: each equals the naive loop scored by its scorer; the
    primary set is the top-level accuracy; base and tuned side by side; the guard is delta >= -max_drop."""
    from stages.evaluate.scorers import contains
    tmp, naive = setup["tmp"], setup["naive"]
    rows = demo_rows("eval.jsonl", N_VAL)
    for i, r in enumerate(rows):
        if i % 2 == 0 and naive[i][0].strip():
            r["messages"][-1]["content"] = naive[i][0]
    # "words": the first word of the model's reply as a `contains` reference for some, a foreign word for others
    words = [dict(r, messages=r["messages"][:-1] + [{"role": "assistant", "content": (
        naive[i][0].split()[0] if i % 3 == 0 and naive[i][0].split() else "zebra")}]) for i, r in enumerate(rows)]
    write_jsonl(tmp / "words.jsonl", words)
    raw = json.loads(json.dumps(setup["raw"]))
    raw["data"].pop("val_data_paths")
    raw["actor"]["nproc_per_node"] = 1
    raw["eval"].update(model=str(setup["model_dir"]), primary="echo", sets={
        "words": {"data_paths": [str(tmp / "words.jsonl")], "scorer": "contains", "max_drop": 0.0},
        "echo": {"data_paths": [str(tmp / "val.jsonl")]}})
    cfg = load_config(write_config(tmp, raw, "sets.yaml"))
    p = plan(cfg)
    run_stage(p, "prepare")
    run_stage(p, "prepare_eval")  # named sets: prepared apart from what trains
    assert {d.name for d in (p.folder("prepare_eval") / "eval").iterdir()} == {"words", "echo"}
    assert not (p.folder("prepare") / "val").exists() and not (p.folder("prepare") / "eval").exists()
    result, records = evaluate(cfg)
    m = result.metrics
    assert m["primary_set"] == "echo" and list(m["sets"]) == ["echo", "words"]
    echo = [r for r in records if r["set"] == "echo"]
    check_against_naive(setup, m, echo)  # the top level is the primary set
    assert m["sets"]["echo"]["accuracy"] == m["accuracy"]
    got = [r for r in records if r["set"] == "words"]
    want = [contains(text, w["messages"][-1]["content"]) for w, (text, _) in zip(words, naive)]
    assert [r["correct"] for r in got] == want and 0 < sum(want) < len(want)
    w = m["sets"]["words"]
    assert w["accuracy"] == pytest.approx(sum(want) / len(want)) and w["total"] == len(want)
    assert w["delta"] == pytest.approx(w["accuracy"] - w["base_accuracy"])
    assert w["guard_ok"] is (w["delta"] >= 0) and "guard_ok" not in m["sets"]["echo"]
    base = baseline_records(cfg)
    assert sorted({r["set"] for r in base}) == ["echo", "words"] and len(base) == 2 * N_VAL
    manifest = read_manifest(result.path)
    assert (set(manifest["eval_sets"]) == {"echo", "words"}
            and manifest["eval_set_fingerprint"] == manifest["eval_sets"]["echo"])


def test_eval_set_config_errors_are_one_line(tmp_path):
    raw = tiny_config_dict(tmp_path)
    val = raw["data"]["val_data_paths"]
    cases = [({"sets": {"a b": {"data_paths": val}}}, "set name(s) ['a b']"),
             ({"sets": {"a": {"data_paths": val}}, "primary": "b"}, "eval.primary='b' is not one of eval.sets (a)"),
             ({"sets": {"a": {"data_paths": val, "max_drop": 0.1}}, "eval_base": False}, "needs eval.eval_base=true"),
             ({"sets": {"a": {"data_paths": [str(tmp_path / "nope.jsonl")]}}}, "eval.sets.a.data_paths"),
             ({"sets": {"a": {"data_paths": val, "scorer": "nosuch"}}}, "neither a builtin scorer")]
    for ev, message in cases:
        with pytest.raises(ConfigError, match=re.escape(message)):
            config_from_dict({**raw, "eval": ev})


def test_a_choice_set_is_scored_by_log_likelihood_and_compared_item_by_item(setup):
    """A `mode: choice` set read from question/choices/answer rows: each pick is the option with the
    highest log-likelihood (option_logprobs, itself checked against a naive loop in test_choice.py),
    and every set's comparison with the base model counts wins and losses item by item."""
    from stages.evaluate.choice import option_logprobs
    from stages.core.stats.paired import delta_interval
    tmp, model, tok = setup["tmp"], setup["model"], setup["tok"]
    questions = ["Which is a colour?", "Pick a number.", "Which word is a fruit?", "Say yes or no.", "Where is Paris?"]
    options = [["red", "table", "run"], ["seven", "blue"], ["apple", "car", "sky", "stone"], ["yes", "no"],
               ["France", "Japan", "Peru"]]
    write_jsonl(tmp / "mc.jsonl", [{"question": q, "choices": o, "answer": i % len(o)}
                                   for i, (q, o) in enumerate(zip(questions, options))])
    raw = json.loads(json.dumps(setup["raw"]))
    raw["data"].pop("val_data_paths")
    raw["data"]["format"] = "messages"  # the choice set is read as choice rows whatever data.format says
    raw["actor"]["nproc_per_node"] = 1
    raw["eval"].update(model=str(setup["model_dir"]), primary="echo", sets={
        "echo": {"data_paths": [str(tmp / "val.jsonl")]},
        "mc": {"data_paths": [str(tmp / "mc.jsonl")], "mode": "choice", "max_drop": 0.2}})
    cfg = load_config(write_config(tmp, raw, "mc.yaml"))
    run_stage(plan(cfg), "prepare")
    result, records = evaluate(cfg)
    mc = [r for r in records if r["set"] == "mc"]
    scores = option_logprobs(model, tok, [[{"role": "user", "content": q}] for q in questions], options, 16)
    picks = [max(range(len(s)), key=lambda k: (s[k][0], -k)) for s in scores]
    assert [r["picked"] for r in mc] == picks
    assert [r["prediction"] for r in mc] == [o[k] for o, k in zip(options, picks)]
    assert [r["correct"] for r in mc] == [k == i % len(o) for i, (o, k) in enumerate(zip(options, picks))]
    m = result.metrics["sets"]["mc"]
    assert m["total"] == 5 and m["correct"] == sum(r["correct"] for r in mc) and "eval_loss" in m

    base = {s: [r for r in baseline_records(cfg) if r["set"] == s] for s in ("echo", "mc")}
    for name in ("echo", "mc"):
        mine = [r for r in records if r["set"] == name]
        wins = sum(a["correct"] and not b["correct"] for a, b in zip(mine, base[name]))
        losses = sum(b["correct"] and not a["correct"] for a, b in zip(mine, base[name]))
        got = result.metrics["sets"][name]
        assert (got["vs_base"]["wins"], got["vs_base"]["losses"], got["vs_base"]["n"]) == (wins, losses, len(mine))
        assert got["delta"] == pytest.approx((wins - losses) / len(mine))
        assert (got["delta_low"], got["delta_high"]) == pytest.approx(delta_interval(wins, losses, len(mine)))
    assert result.metrics["vs_base"] == result.metrics["sets"]["echo"]["vs_base"]  # the top level is the primary's
    assert m["guard_ok"] is (m["delta"] >= -0.2)


def test_a_bad_choice_row_is_quarantined_with_its_reason(setup, tmp_path):
    from stages.chatdata.readers import RowError, to_conversations
    for row, reason in [({"question": "q", "choices": ["a"], "answer": 0}, "bad_choices"),
                        ({"question": "q", "choices": ["a", "b"], "answer": 2}, "bad_answer"),
                        ({"question": "q", "choices": ["a", "b"], "answer": True}, "bad_answer"),
                        ({"question": 3, "choices": ["a", "b"], "answer": 0}, "non_string_content")]:
        with pytest.raises(RowError) as e:
            to_conversations(row, "choice")
        assert e.value.reason == reason
