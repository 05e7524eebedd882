"""lm-evaluation-harness tasks as eval sets (`mode: harness`, docs/evaluation.md "Harness sets").

References: a local multiple-choice task picks, item by item, what `mode: choice` picks on the same
rows (and `option_logprobs`); a local generative task's regex filter is checked against the model's
greedy replies from sftflow's own generation, extracted by hand; the guard, the paired comparison and
the champion comparison run through the normal stage paths.
"""

import json
import re
import sys
from pathlib import Path

import pytest

from conftest import tiny_config_dict, write_config, write_jsonl
from stages.core.cache.artifacts import read_manifest
from stages.core.config import load_config
from stages.core.errors import ConfigError
from stages.pipeline import REFERENCES, plan, run_stage

pytest.importorskip("lm_eval")

QUESTIONS = ["Which is a colour?", "Pick a number.", "Which word is a fruit?", "Say yes or no.", "Where is Paris?",
             "Which one flies?"]
OPTIONS = [["red", "table", "run"], ["seven", "blue"], ["apple", "car", "sky", "stone"], ["yes", "no"],
           ["France", "Japan", "Peru"], ["bird", "fish", "rock"]]
GEN_QUESTIONS = ["Tell me about rivers.", "What is a cat?", "Name a colour.", "Count to three.", "Say hello."]
MAX_NEW = 8
LAST_WORD = r"(\w+)"  # with group_select -1: the reply's last word

MC_TASK = """task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: mc.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list:
  - metric: acc
  - metric: acc_norm
"""

GEN_TASK = """task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: gen.jsonl
test_split: test
output_type: generate_until
doc_to_text: "{{question}}"
doc_to_target: "{{answer}}"
generation_kwargs:
  until: ["<<never>>"]
  max_gen_toks: %d
  do_sample: false
filter_list:
  - name: last-word
    filter:
      - function: regex
        regex_pattern: "%s"
        group_select: -1
      - function: take_first
metric_list:
  - metric: exact_match
""" % (MAX_NEW, LAST_WORD.replace("\\", "\\\\"))


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def picks_of(model, tok, questions, options) -> list[int]:
    from stages.evaluate.choice import option_logprobs
    scores = option_logprobs(model, tok, [user(q) for q in questions], options, 16)
    return [max(range(len(s)), key=lambda k: (s[k][0], -k)) for s in scores]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tuned model (noisy, saved as a folder) and the base model; a multiple-choice task whose answers
    are the base model's picks (so a guard with max_drop 0 fails exactly when the tuned model loses an
    item), the same rows as a `mode: choice` set, and a generative task with a regex filter whose
    targets are, for even items, the last word the tuned model will say; one evaluation of all of them."""
    import torch
    from conftest import base_model, noisy_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stages.inference.generation import generate
    tmp = tmp_path_factory.mktemp("harness")
    raw = tiny_config_dict(tmp, n_train=48, n_val=4, actor={"nproc_per_node": 1},
                           eval={"batch_size": 4, "max_new_tokens": MAX_NEW})
    cfg = load_config(write_config(tmp, raw))
    base_dir = base_model(cfg)
    model, tok = noisy_model(base_dir, tmp / "model")
    base = AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32).eval()
    base_tok = AutoTokenizer.from_pretrained(base_dir)

    base_picks = picks_of(base, base_tok, QUESTIONS, OPTIONS)
    tasks = tmp / "tasks"
    tasks.mkdir()
    write_jsonl(tasks / "mc.jsonl", [{"question": q, "choices": o, "answer": k}
                                     for q, o, k in zip(QUESTIONS, OPTIONS, base_picks)])
    (tasks / "mc.yaml").write_text(MC_TASK)
    replies = [p["text"] for p in generate(model, tok, [user(q) for q in GEN_QUESTIONS], MAX_NEW, 4)]
    targets = [(re.findall(LAST_WORD, r) or ["[invalid]"])[-1] if i % 2 == 0 else "zebra"
               for i, r in enumerate(replies)]
    write_jsonl(tasks / "gen.jsonl", [{"question": q, "answer": t} for q, t in zip(GEN_QUESTIONS, targets)])
    (tasks / "gen.yaml").write_text(GEN_TASK)

    raw["data"].pop("val_data_paths")
    raw["eval"].update(model=str(tmp / "model"), primary="mc_h", sets={
        "mc_h": {"mode": "harness", "task": str(tasks / "mc.yaml"), "max_drop": 0.0},
        "mc": {"data_paths": [str(tasks / "mc.jsonl")], "mode": "choice"},
        "gen": {"mode": "harness", "task": str(tasks / "gen.yaml"), "max_drop": 1.0}})
    cfg = load_config(write_config(tmp, raw, "harness.yaml"))
    p = plan(cfg)
    run_stage(p, "prepare", on_line=lambda line: None)
    run_stage(p, "prepare_eval", on_line=lambda line: None)
    for ref in REFERENCES:
        if ref in p.stages:
            run_stage(p, ref, on_line=lambda line: None)
    result = run_stage(p, "evaluate", on_line=lambda line: None)
    records = read_jsonl(Path(result.path) / "predictions.jsonl")
    return {"tmp": tmp, "tasks": tasks, "raw": raw, "cfg": cfg, "plan": p, "model": model, "tok": tok,
            "base_picks": base_picks, "replies": replies, "targets": targets, "result": result,
            "records": {s: [r for r in records if r["set"] == s] for s in ("mc_h", "mc", "gen")},
            "baseline": read_jsonl(p.folder("baseline") / "predictions.jsonl")}


def test_a_local_multiple_choice_task_picks_what_mode_choice_picks(setup):
    """The same rows as an lm-eval task and as a `mode: choice` set: the same pick and correctness on every
    item, for the tuned and the base model, so the same wins and losses; lm-eval's log-likelihoods differ
    from choice's by one constant per item at most (the generation prompt's trailing newline, which
    lm-eval scores with each option)."""
    harness, choice = setup["records"]["mc_h"], setup["records"]["mc"]
    picks = picks_of(setup["model"], setup["tok"], QUESTIONS, OPTIONS)
    assert [r["picked"] for r in choice] == picks
    assert [r["picked"] for r in harness] == picks
    assert [r["choices"] for r in harness] == OPTIONS  # the chat template: no delimiter before an option
    assert [r["correct"] for r in harness] == [r["correct"] for r in choice] == \
        [p == k for p, k in zip(picks, setup["base_picks"])]
    assert [r["doc_id"] for r in harness] == list(range(len(QUESTIONS)))
    assert [r["prompt"]["question"] for r in harness] == QUESTIONS
    for h, c in zip(harness, choice):
        shift = [a - b for a, b in zip(h["logprobs"], c["logprobs"])]
        assert max(shift) - min(shift) < 1e-4
    base = {s: [r for r in setup["baseline"] if r["set"] == s] for s in ("mc_h", "mc")}
    assert [r["picked"] for r in base["mc_h"]] == [r["picked"] for r in base["mc"]] == setup["base_picks"]
    assert all(r["correct"] for r in base["mc_h"])  # the answers are the base model's picks
    m = setup["result"].metrics["sets"]
    for key in ("accuracy", "correct", "total", "base_accuracy", "delta", "delta_low", "delta_high"):
        assert m["mc_h"][key] == pytest.approx(m["mc"][key]), key
    assert m["mc_h"]["vs_base"] == m["mc"]["vs_base"]
    assert m["mc_h"]["accuracy"] == pytest.approx(m["mc_h"]["lm_eval"]["acc,none"])
    assert {"acc,none", "acc_norm,none", "acc_stderr,none"} <= set(m["mc_h"]["lm_eval"])
    assert (m["mc_h"]["task"], m["mc_h"]["metric"], m["mc_h"]["filter"]) == ("tiny_mc", "acc", "none")


def test_the_guard_on_a_harness_set_holds_back_a_loss(setup):
    """max_drop 0 on the harness set: the tuned model lost items the base model got right, so the guard
    fails and register's reason names the set; max_drop 1 on the other harness set holds."""
    from stages.register import failed_guards
    m = setup["result"].metrics
    mc = m["sets"]["mc_h"]
    losses = sum(p != k for p, k in zip(picks_of(setup["model"], setup["tok"], QUESTIONS, OPTIONS),
                                        setup["base_picks"]))
    assert losses > 0  # the check means something
    assert (mc["vs_base"]["wins"], mc["vs_base"]["losses"]) == (0, losses)
    assert mc["base_accuracy"] == 1.0 and mc["delta"] == pytest.approx(-losses / len(QUESTIONS))
    assert mc["guard_ok"] is False and mc["decided_on"] == "estimate"
    assert m["sets"]["gen"]["guard_ok"] is True
    reasons = failed_guards(m)
    assert len(reasons) == 1 and reasons[0].startswith("'mc_h' accuracy") and "max_drop" in reasons[0]


def test_a_local_generative_task_scores_its_regex_filter(setup):
    """Each document's answer is the regex filter's extraction (the last word) from the model's greedy
    reply, which equals sftflow's own greedy generation; an item is correct when it equals the target."""
    gen = setup["records"]["gen"]
    replies, targets = setup["replies"], setup["targets"]
    assert [r["response"].strip() for r in gen] == [r.strip() for r in replies]
    extracted = [(re.findall(LAST_WORD, r) or ["[invalid]"])[-1] for r in replies]
    assert [r["prediction"] for r in gen] == extracted
    want = [e == t for e, t in zip(extracted, targets)]
    assert [r["correct"] for r in gen] == want
    assert want == [i % 2 == 0 and e != "[invalid]" for i, e in enumerate(extracted)] and 0 < sum(want) < len(want)
    g = setup["result"].metrics["sets"]["gen"]
    assert (g["metric"], g["filter"]) == ("exact_match", "last-word")
    assert g["accuracy"] == pytest.approx(sum(want) / len(want)) == pytest.approx(g["lm_eval"]["exact_match,last-word"])


def test_champion_comparison_and_mlflow_names_work_on_harness_sets(setup, tmp_path):
    """Register's comparison with a champion pairs harness items like any set's (the baseline folder,
    given a version number, stands in for a champion stage's: the same files); `if_better` decides on
    it; MLflow gets lm-eval's numbers under lm-eval's names."""
    import shutil

    from stages.register import champion_comparison
    from stages.tracking.live import eval_metric_values
    p, m = setup["plan"], setup["result"].metrics
    champion = tmp_path / "champion"
    shutil.copytree(p.folder("baseline"), champion)
    manifest = json.loads((champion / "manifest.json").read_text())
    (champion / "manifest.json").write_text(json.dumps({**manifest, "version": 3}))
    vs = champion_comparison(m, setup["result"].path, str(champion))
    for name in ("mc_h", "gen"):
        assert {k: vs[name][k] for k in m["sets"][name]["vs_base"]} == m["sets"][name]["vs_base"]
        assert vs[name]["version"] == "3" and vs[name]["accuracy"] == m["sets"][name]["base_accuracy"]

    from types import SimpleNamespace

    from stages.register import CHALLENGER, RUN_TAG, decide_alias, failed_guards
    champ = SimpleNamespace(version="3", tags={RUN_TAG: ""})
    client = SimpleNamespace(get_model_version_by_alias=lambda name, alias: champ)
    alias, why = decide_alias(client, "m", "if_better", vs["mc_h"], "mc_h", "this-training")
    assert alias == CHALLENGER and why.startswith("'mc_h' ") and "worse than the champion" in why  # it lost items
    alias, why = decide_alias(client, "m", "if_better", vs["mc_h"], "mc_h", "this-training", guards=failed_guards(m))
    assert alias == CHALLENGER and why.startswith("held back by the retention guard: 'mc_h'")
    from stages.register import predictions_table
    table = predictions_table(Path(setup["result"].path) / "predictions.jsonl")  # the MLflow table of register
    shown = table[table["set"] == "mc_h"].sort_values("prompt")["prompt"].tolist()
    assert sorted(json.dumps(r["prompt"], ensure_ascii=False) for r in setup["records"]["mc_h"]) == shown
    charted = eval_metric_values(m)
    assert charted["eval/mc_h/lm_eval/acc"] == pytest.approx(m["sets"]["mc_h"]["accuracy"])
    assert "eval/mc_h/lm_eval/acc_norm" in charted
    assert charted["eval/gen/lm_eval/exact_match/last-word"] == pytest.approx(m["sets"]["gen"]["accuracy"])
    manifest = read_manifest(setup["result"].path)
    assert set(manifest["eval_sets"]) == {"mc_h", "mc", "gen"}
    assert manifest["eval_sets"]["mc_h"] == read_manifest(p.folder("baseline"))["eval_sets"]["mc_h"]


def test_a_harness_set_needs_no_prepared_rows_and_its_files_are_inputs(setup, tmp_path):
    p = setup["plan"]
    assert {d.name for d in (p.folder("prepare_eval") / "eval").iterdir()} == {"mc"}
    files = [ref for ref, _ in p.inputs["eval/gen"]]
    assert files == [str(setup["tasks"] / "gen.yaml"), str(setup["tasks"] / "gen.jsonl")]
    raw = json.loads(json.dumps(setup["raw"]))
    raw["eval"]["sets"] = {"g": raw["eval"]["sets"]["gen"]}
    raw["eval"].pop("primary")
    only = plan(load_config(write_config(tmp_path, raw)))
    assert "prepare_eval" not in only.stages and "baseline" in only.stages


def test_the_fingerprint_covers_the_task_file_its_data_and_its_keys(setup, tmp_path):
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    write_jsonl(tasks / "mc.jsonl", read_jsonl(setup["tasks"] / "mc.jsonl"))
    (tasks / "mc.yaml").write_text(MC_TASK)
    raw = json.loads(json.dumps(setup["raw"]))
    raw["eval"].pop("primary")
    raw["eval"]["sets"] = {"h": {"mode": "harness", "task": str(tasks / "mc.yaml")}}

    def fps(**keys):
        r = json.loads(json.dumps(raw))
        r["eval"]["sets"]["h"].update(keys)
        f = plan(load_config(write_config(tmp_path, r))).fingerprints
        return f["baseline"], f["evaluate"]

    first = fps()
    assert fps() == first
    (tasks / "mc.yaml").write_text(MC_TASK.replace("{{question}}", "Q: {{question}}"))
    edited_yaml = fps()
    assert edited_yaml[0] != first[0] and edited_yaml[1] != first[1]
    with open(tasks / "mc.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps({"question": "One more?", "choices": ["a", "b"], "answer": 0}) + "\n")
    edited_data = fps()
    assert len({first, edited_yaml, edited_data}) == 3
    variants = [fps(num_fewshot=1), fps(limit=3), fps(chat_template=False), fps(metric="acc_norm"), fps(max_drop=0.1)]
    assert all(v != edited_data for v in variants[:4])
    assert variants[4][0] == edited_data[0]  # a guard judges scores: the baseline's are the same


def test_relative_data_files_are_read_from_the_task_folder_then_the_working_directory(tmp_path, monkeypatch):
    from stages.inference.harness import resolve_task
    (tmp_path / "t").mkdir()
    write_jsonl(tmp_path / "t" / "here.jsonl", [{"question": "q", "choices": ["a", "b"], "answer": 0}])
    write_jsonl(tmp_path / "cwd.jsonl", [{"question": "q", "choices": ["a", "b"], "answer": 0}])
    (tmp_path / "t" / "a.yaml").write_text(MC_TASK.replace("test: mc.jsonl", "test: [here.jsonl, cwd.jsonl]"))
    monkeypatch.chdir(tmp_path)
    r = resolve_task("t/a.yaml", "eval.sets.a.task")
    assert r["name"] == "tiny_mc" and r["output_type"] == "multiple_choice" and r["metrics"] == ["acc", "acc_norm"]
    assert r["files"] == [str(tmp_path / "t" / "a.yaml"), str(tmp_path / "t" / "here.jsonl"),
                          str(tmp_path / "cwd.jsonl")]
    assert r["config"]["dataset_kwargs"]["data_files"] == {"test": [str(tmp_path / "t" / "here.jsonl"),
                                                                    str(tmp_path / "cwd.jsonl")]}
    (tmp_path / "t" / "b.yaml").write_text(MC_TASK.replace("test: mc.jsonl", "test: gone.jsonl"))
    with pytest.raises(ConfigError, match=r"eval.sets.a.task: .*b.yaml: data file 'gone.jsonl' not found"):
        resolve_task("t/b.yaml", "eval.sets.a.task")


def test_an_included_yaml_and_a_function_module_are_part_of_the_task(tmp_path):
    """The files whose contents define a task: the YAML, what it `include`s (its keys first, the file's
    own win, as lm-eval merges them), the module of a `!function` next to it, and its data."""
    from stages.inference.harness import resolve_task
    write_jsonl(tmp_path / "mc.jsonl", [{"question": "q", "choices": ["a", "b"], "answer": 0}])
    (tmp_path / "base.yaml").write_text(MC_TASK.replace("task: tiny_mc", "task: base_mc"))
    (tmp_path / "utils.py").write_text("def process(docs):\n    return docs\n")
    (tmp_path / "child.yaml").write_text("include: base.yaml\ntask: child_mc\nprocess_docs: !function utils.process\n")
    r = resolve_task(str(tmp_path / "child.yaml"), "eval.sets.c.task")
    assert r["name"] == "child_mc" and r["output_type"] == "multiple_choice"
    assert r["files"] == [str(tmp_path / f) for f in ("child.yaml", "utils.py", "base.yaml", "mc.jsonl")]


def one_line_error(raw: dict, tmp_path: Path, match: str) -> str:
    with pytest.raises(ConfigError, match=match) as e:
        plan(load_config(write_config(tmp_path, raw)))
    assert "\n" not in str(e.value)
    return str(e.value)


def harness_raw(setup, **keys) -> dict:
    raw = json.loads(json.dumps(setup["raw"]))
    raw["eval"].pop("primary")
    raw["eval"]["sets"] = {"arc": {"mode": "harness", "task": str(setup["tasks"] / "mc.yaml"), **keys}}
    return raw


def test_without_lm_eval_a_harness_set_is_a_one_line_error_at_planning(setup, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` raises ImportError
    msg = one_line_error(harness_raw(setup), tmp_path, r"^eval.sets.arc: mode: harness needs lm-evaluation-harness")
    assert "sftflow[harness]" in msg


def test_task_errors_are_one_line_naming_the_key(setup, tmp_path):
    one_line_error(harness_raw(setup, task=str(tmp_path / "nope.yaml")), tmp_path,
                   r"^eval.sets.arc.task='.*nope.yaml': task file not found")
    one_line_error(harness_raw(setup, metric="f1"), tmp_path, r"^eval.sets.arc: metric 'f1' is not one of the task's")
    one_line_error(harness_raw(setup, filter="strict"), tmp_path, r"^eval.sets.arc: filter 'strict' is not one of")
    (tmp_path / "group.yaml").write_text("group: g\ntask: [a, b]\n")
    one_line_error(harness_raw(setup, task=str(tmp_path / "group.yaml")), tmp_path, r"not a single task")
    raw = harness_raw(setup)
    cases = [({"mode": "harness"}, "mode: harness needs task"),
             ({"mode": "harness", "task": "x.yaml", "data_paths": ["a.jsonl"]},
              "data_paths does not apply to mode: harness"),
             ({"mode": "harness", "task": "x.yaml", "scorer": "exact"}, "scorer does not apply to mode: harness"),
             ({"mode": "harness", "task": "x.yaml", "length_normalized": "chars"}, "metric: acc_norm"),
             ({"mode": "choice", "data_paths": raw["data"]["train_data_paths"], "task": "arc_easy"},
              "task is a key of harness sets"),
             ({"mode": "generate"}, "data_paths is required")]
    for s, message in cases:
        raw["eval"]["sets"] = {"arc": s}
        with pytest.raises(ConfigError, match=re.escape(message)) as e:
            load_config(write_config(tmp_path, raw))
        assert str(e.value).count("\n") == 0 and "eval.sets.arc" in str(e.value)


@pytest.mark.slow  # builds lm-eval's index of its bundled tasks (reads every YAML: 10-20 s)
def test_a_bundled_task_name_resolves_to_its_yaml_and_unknown_names_are_one_line_errors():
    import lm_eval

    from stages.inference.harness import resolve_task
    r = resolve_task("arc_easy", "eval.sets.arc.task")
    yaml_file = Path(lm_eval.__file__).parent / "tasks" / "arc" / "arc_easy.yaml"
    assert r["files"] == [str(yaml_file.resolve())] and r["config"] is None
    assert (r["name"], r["output_type"], r["metrics"], r["filters"]) == ("arc_easy", "multiple_choice",
                                                                         ["acc", "acc_norm"], ["none"])
    with pytest.raises(ConfigError, match=r"^eval.sets.arc.task='no_such_task': not an lm-eval task name"):
        resolve_task("no_such_task", "eval.sets.arc.task")
    with pytest.raises(ConfigError, match=r"^eval.sets.arc.task='ai2_arc': an lm-eval tag, not a single task"):
        resolve_task("ai2_arc", "eval.sets.arc.task")


@pytest.mark.slow  # launches torchrun
def test_two_processes_give_the_one_process_records(setup):
    """Under torchrun rank 0 runs the task and shares the result: the same records and numbers as one process."""
    raw = json.loads(json.dumps(setup["raw"]))
    raw["actor"].update(nproc_per_node=2, micro_batch_size=4, global_batch_size=16)
    raw["eval"]["launch"] = "torchrun"  # as on GPUs: auto scores so small an evaluation in the stage on CPU
    cfg = load_config(write_config(setup["tmp"], raw, "harness-2.yaml"))
    p = plan(cfg)
    assert p.fingerprints["evaluate"] == setup["plan"].fingerprints["evaluate"]  # the world size is not hashed
    result = run_stage(p, "evaluate", force=True, on_line=lambda line: None)
    records = read_jsonl(Path(result.path) / "predictions.jsonl")
    for s in ("mc_h", "gen"):
        mine = [r for r in records if r["set"] == s]
        assert [(r["doc_id"], r["prediction"], r["correct"]) for r in mine] == \
            [(r["doc_id"], r["prediction"], r["correct"]) for r in setup["records"][s]]
        assert result.metrics["sets"][s]["vs_base"] == setup["result"].metrics["sets"][s]["vs_base"]


def test_the_harness_keys_leave_other_sets_fingerprints_as_they_were():
    """A set that is not a harness set hashes the keys it hashed before harness sets existed, so adding
    them re-scores nothing; a harness set's keys are hashed when set."""
    from stages.core.config import EvalSetConfig, hashed
    assert set(hashed(EvalSetConfig(data_paths=["x.jsonl"]))) == {"scorer", "max_drop", "decide_on", "mode",
                                                                  "length_normalized"}
    h = hashed(EvalSetConfig(mode="harness", task="t.yaml", num_fewshot=0, chat_template=False))
    assert (h["task"], h["num_fewshot"], h["chat_template"]) == ("t.yaml", 0, False) and "limit" not in h


def test_a_task_with_an_include_a_function_and_a_limit_runs_as_lm_eval_reads_it(setup, tmp_path):
    """score_task on its own: the included YAML's keys, the `!function` module (it drops the third
    document) and `limit` all take effect; every record's correctness is lm-eval's per-sample `acc`."""
    from stages.core.config import EvalSetConfig
    from stages.inference.harness import score_task
    write_jsonl(tmp_path / "mc.jsonl", read_jsonl(setup["tasks"] / "mc.jsonl"))
    (tmp_path / "base.yaml").write_text(MC_TASK.replace("task: tiny_mc", "task: base_mc"))
    (tmp_path / "utils.py").write_text("def process(docs):\n    return docs.filter(lambda d: d['question'] != %r)\n"
                                       % QUESTIONS[2])
    (tmp_path / "child.yaml").write_text("include: base.yaml\ntask: child_mc\nprocess_docs: !function utils.process\n")
    s = EvalSetConfig(mode="harness", task=str(tmp_path / "child.yaml"), limit=4)
    metrics, records = score_task(setup["model"], setup["tok"], s, "c", 4)
    assert [r["prompt"]["question"] for r in records] == [QUESTIONS[i] for i in (0, 1, 3, 4)]
    picks = picks_of(setup["model"], setup["tok"], QUESTIONS, OPTIONS)
    assert [r["picked"] for r in records] == [picks[i] for i in (0, 1, 3, 4)]
    assert [r["correct"] for r in records] == [picks[i] == setup["base_picks"][i] for i in (0, 1, 3, 4)]
    assert metrics["task"] == "child_mc" and metrics["total"] == 4
    assert metrics["accuracy"] == pytest.approx(metrics["lm_eval"]["acc,none"])


def test_the_flows_predictions_table_shows_a_harness_document():
    """The Prefect table of predictions read every prompt as chat messages; a harness record's prompt is
    the task's document (a dict): the run scored every set, then stopped with KeyError -1."""
    from flows.sft import _prompt_text
    assert (_prompt_text([{"role": "system", "content": "s"}, {"role": "user", "content": "Who are you?"}])
            == "Who are you?")
    assert (_prompt_text({"question": "What is 2+2?", "choices": ["4", "5"]})
            == '{"question": "What is 2+2?", "choices": ["4", "5"]}')
    assert _prompt_text("plain") == "plain"
