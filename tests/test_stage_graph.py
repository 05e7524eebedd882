"""The stage table (stages/graph.py) is what the fingerprints do: over every key of the config schema,
changing a key a stage does not read never changes its fingerprint, and changing one it reads always
does; `stage evaluate --model` survives new training data as a cache hit; the docs' stage table is
the table's own rendering."""

import json
import re
import shutil
import time
from pathlib import Path

import pytest
from pydantic import BaseModel, ValidationError

from conftest import ROOT, demo_rows, tiny_config_dict, write_config, write_jsonl
from stages.core.config import SFTConfig, load_config
from stages.core.errors import ConfigError
from stages.graph import BY_NAME, FACT_AFTER, FACTS, TABLE, Stage, planning_order, render_markdown
from stages.pipeline import plan, run_stage, upstream


def _matches(pattern: str, key: str) -> bool:
    """`key` is `pattern` or under it ('*' matches one name)."""
    p, k = pattern.split("."), key.split(".")
    return len(k) >= len(p) and all(a == "*" or a == b for a, b in zip(p, k))


def _reads(stage: str, key: str, hashed: bool, p) -> bool:
    """Whether `stage`'s result depends on `key` in plan `p`, from the table: read directly (not
    ignored; fingerprints see it: `hashed`), deciding one of its facts, or read by an upstream stage it
    folds."""
    row = BY_NAME[stage]
    if hashed and any(_matches(r, key) for r in row.reads) and not any(_matches(i, key) for i in row.ignores):
        return True
    if any(_matches(k, key) for f in row.facts for k in FACTS[f][1]):
        return True
    skip = row.skips(p.cfg)
    return any(_reads(u, key, hashed, p) for u in row.folds if u in p.fingerprints and u not in skip)


def _leaves(model: BaseModel, prefix: str = ""):
    """(dotted key, value, field) for every leaf of a config: the schema's fields, a dict of sections
    (data.mix, eval.sets) by name."""
    for name, field in type(model).model_fields.items():
        value, key = getattr(model, name), f"{prefix}{name}"
        if isinstance(value, BaseModel):
            yield from _leaves(value, key + ".")
        elif isinstance(value, dict) and value and all(isinstance(v, BaseModel) for v in value.values()):
            for k, v in value.items():
                yield from _leaves(v, f"{key}.{k}.")
        else:
            yield key, value, field


def _hashed(field) -> bool:
    return (field.json_schema_extra or {}).get("fingerprint") is not False


@pytest.fixture(scope="module")
def world(tmp_path_factory, tokenizer_dir):
    tmp = tmp_path_factory.mktemp("graph")
    write_jsonl(tmp / "more.jsonl", demo_rows("train.jsonl", 40)[20:])
    write_jsonl(tmp / "prompts.jsonl", [{"prompt": f"Tell me a fact about the number {i}."} for i in range(6)])
    evals = demo_rows("eval.jsonl", 30)
    write_jsonl(tmp / "set_a.jsonl", evals[:10])
    write_jsonl(tmp / "set_b.jsonl", evals[10:20])
    cfg = tiny_config_dict(tmp, n_train=20, n_val=6)
    cfg["actor"]["lora"] = {"r": 4}
    cfg["data"]["mix"] = {"train": {"weight": 1.0}, "more": {"weight": 0.5, "paths": [str(tmp / "more.jsonl")]},
                       "replay": {"weight": 0.5}}
    cfg["replay"] = {"prompt_paths": [str(tmp / "prompts.jsonl")], "max_new_tokens": 8}
    cfg["eval"]["sets"] = {"a": {"data_paths": [str(tmp / "set_a.jsonl")]},
                           "b": {"data_paths": [str(tmp / "set_b.jsonl")], "scorer": "contains", "max_drop": 0.1}}
    return tmp, cfg, tokenizer_dir


def _copy_files(paths: list[str], tmp: Path) -> list[str]:
    """The same contents under other names (a stage reads contents, never names)."""
    out = []
    for p in paths:
        dst = tmp / "renamed" / Path(p).name
        dst.parent.mkdir(exist_ok=True)
        shutil.copy(p, dst)
        out.append(str(dst))
    return out


# keys whose new value the generic rule can't make (a type it doesn't know, or a value that must exist)
SPECIAL = {
    "actor.model.model_sha256": "ab" * 32,
    "actor.optim.betas": (0.8, 0.9),
    "actor.micro_batch_size": 8,
    "actor.global_batch_size": 32,
    "actor.lora.target_modules": ["q_proj", "v_proj"],
    "actor.lora.quantize_block_size": 32,  # even: two 4-bit codes a byte
    "actor.nproc_per_node": 2,
    "actor.rdzv_endpoint": "127.0.0.1:29400",
    "actor.memory_budget_gb": 12.0,
    "actor.reshard_after_forward": True,
    "actor.init_from": "champion",
    "runner.resume": "never",
    "runner.metric_for_best_model": "val_token_accuracy",
    "eval.scorer": "normalized",
    "eval.sets.a.scorer": "normalized",
    "eval.sets.b.scorer": "exact",
    "eval.sets.b.max_drop": 0.3,
    "eval.sets.b.decide_on": "interval",
    "eval.answer_pattern": r"answer: (\w+)",
    "eval.model": "base",
    "eval.primary": "b",
    "eval.sets.a.max_drop": 0.2,
    "data.columns": {"messages": "turns"},
    "data.mix.more.columns": {"messages": "turns"},
    "data.mix.more.format": "messages",
    "data.max_bad_fraction": 0.5,
    "registry.tracking_uri": "sqlite:///{tmp}/other.db",
    "registry.experiment": "other",
    "registry.model_name": "other-model",
    "registry.ui_url": "http://127.0.0.1:5001",
    "artifacts_dir": "{tmp}/other-artifacts",
    "data.format": "auto",
    "actor.model.model_path": "{tokenizer}",
}
# keys whose change is refused by the schema or needs code this test doesn't bring, each with why
NOT_CHANGED = {
    "actor.model.model_type": "a custom model type needs its code (tests/custom_model.py)",
    "actor.worker": "a custom worker needs its code (tests/custom_model.py)",
    "actor.nnodes": "more nodes need a rendezvous endpoint (a config error)",
    "actor.node_rank": "a node rank needs nnodes > 1 (a config error)",
    "runner.best_model_guard": "needs load_best_model_at_end (a config error alone); test_validation_by_source "
                               "checks that it moves train",
    "eval.sets.a.mode": "a choice or harness set needs rows or a task of that kind",
    "eval.sets.b.mode": "a choice or harness set needs rows or a task of that kind",
}
for _src in ("train", "replay"):
    for _k in ("format", "columns"):
        NOT_CHANGED[f"data.mix.{_src}.{_k}"] = "the train and replay sources take a weight only (a config error)"
NOT_CHANGED["eval.eval_base"] = "set b's max_drop compares with the base model (a config error without it)"
# a harness key on a generate set is a config error; `length_normalized` is for choice sets
for _s in ("a", "b"):
    for _k in ("task", "num_fewshot", "limit", "chat_template", "metric", "filter", "length_normalized"):
        NOT_CHANGED[f"eval.sets.{_s}.{_k}"] = "applies to harness or choice sets only (a config error)"
# keys whose value resolves to what it was: the table's closure does not apply
SAME_RESULT = {"actor.init_from": "champion with no champion in the registry is the base model (start_note)",
               "data.rehearsal.weight": "only a warm start from a version rehearses "
                                        "(tests/test_init_from.py::test_training_continues_from_the_champion_and_names_it,"
                                        " tests/test_rehearsal.py::test_no_rehearsal_when_off_unnamed_or_nothing_new)",
               "data.rehearsal.passes": "only a warm start from a version rehearses "
                                        "(tests/test_rehearsal.py::test_an_epoch_sized_by_its_new_rows)",
               "data.rehearsal.kl_to_base": "only a warm start from a version rehearses "
                                            "(tests/test_config.py::test_a_rehearsal_kl_weight_is_validated_as_actor_"
                                            "kl_to_base: then it trains as actor.kl_to_base, which train reads)",
               "data.rehearsal.kl_on": "only a warm start from a version rehearses "
                                       "(tests/test_rehearsal.py::test_collated_batches_mark_the_rows_the_kl_holds, "
                                       "tests/test_loss.py::test_kl_on_some_rows_is_the_kl_of_those_rows_alone)"}
CITED = re.compile(r"tests/\w+\.py(?:::\w+)?")


def test_the_reasons_name_tests_that_exist():
    """A reason that rests on another test names it, file::function, and that test is there: a file or
    function renamed since would leave the reason pointing at nothing."""
    reasons = {**NOT_CHANGED, **SAME_RESULT}
    cited = {key: CITED.findall(why) for key, why in reasons.items()}
    assert all("::" in c for key in SAME_RESULT if key.startswith("data.rehearsal.") for c in cited[key] or [""])
    missing = []
    for key, refs in cited.items():
        for ref in refs:
            file, _, name = ref.partition("::")
            path = ROOT / file
            if not path.is_file() or (name and not re.search(rf"^def {name}\(", path.read_text(), re.M)):
                missing.append(f"{key}: {ref}")
    assert not missing, missing


def _changed(key: str, value, field, tmp: Path, tokenizer: Path):
    tail = key.rsplit(".", 1)[-1]
    if key.startswith("data.mix.") and tail in ("format", "columns"):
        return SPECIAL[f"data.mix.more.{tail}"]
    if key in SPECIAL:
        v = SPECIAL[key]
        return v.format(tmp=tmp, tokenizer=tokenizer) if isinstance(v, str) else v
    if key.endswith(("paths",)):
        return _copy_files(value, tmp)
    if isinstance(value, bool) or (value is None and "bool" in str(field.annotation)):
        return not value
    if isinstance(value, int) and not isinstance(value, bool):
        return value + 1
    if isinstance(value, float):
        return (value + 0.3) / 2
    if value is None and "float" in str(field.annotation):
        return 3.0
    if value is None and "int" in str(field.annotation):
        return 3
    other = [c for c in _literals(field.annotation) if c != value]
    if other:
        return other[0]
    raise AssertionError(f"{key}: no rule makes a new value of {value!r} ({field.annotation}); add it to SPECIAL")


def _literals(annotation) -> list[str]:
    """The string choices an annotation allows (Literal, inside Optional/Union too)."""
    args = getattr(annotation, "__args__", ())
    return [a for a in args if isinstance(a, str)] + [x for a in args if not isinstance(a, str) for x in _literals(a)]


def _set(d: dict, key: str, value) -> None:
    *head, last = key.split(".")
    for k in head:
        d = d.setdefault(k, {})
    d[last] = value


def test_every_key_changes_exactly_the_stages_that_read_it(world):
    tmp, cfg_dict, tokenizer = world
    before = plan(SFTConfig.model_validate(cfg_dict))
    assert set(before.stages) == {"replay", "prepare", "prepare_eval", "baseline", "train", "evaluate", "register"}
    checked, wrong, refused = [], [], []
    for key, value, field in _leaves(SFTConfig.model_validate(cfg_dict)):
        if key in NOT_CHANGED:
            continue
        d = json.loads(json.dumps(cfg_dict))
        _set(d, key, _changed(key, value, field, tmp, tokenizer))
        try:
            after = plan(SFTConfig.model_validate(d))
        except (ValidationError, ConfigError) as e:
            refused.append(f"{key}: {str(e)[:300]}")
            continue
        for stage in (s for s in before.stages if s in after.stages):
            moved = before.fingerprints[stage] != after.fingerprints[stage]
            expected = _reads(stage, key, _hashed(field), after) and key not in SAME_RESULT
            if key.endswith("paths") and not key.startswith("eval.sets"):
                expected = False  # same contents under other names
            if key.startswith("eval.sets") and key.endswith("data_paths"):
                expected = False
            if moved != expected:
                wrong.append(f"{key}: {stage} {'changed' if moved else 'kept its fingerprint'}")
        checked.append(key)
    assert not refused, "\n".join(refused)
    assert not wrong, "\n".join(wrong)
    assert len(checked) >= 80, checked  # every key of the schema, but the few NOT_CHANGED says why


def test_a_key_a_stage_reads_is_in_its_fingerprint_by_hand():
    """Hand-written expectations (not derived from the table) for the keys people change most."""
    rows = {s.name: s for s in TABLE}
    said = {  # key -> the stages whose own declaration must read it
        "actor.optim.lr": {"train"}, "data.max_length": {"prepare", "prepare_eval", "baseline", "champion"},
        "eval.max_new_tokens": {"baseline", "champion", "evaluate"}, "data.mix.more.weight": {"train"},
        "registry.promote": {"register"}, "eval.sets.b.max_drop": {"evaluate"}, "replay.max_new_tokens": {"replay"},
        "eval.sets.b.champion_tolerance": {"register"},  # judged, never scored: no scoring stage re-runs
    }
    for key, stages in said.items():
        direct = {n for n, r in rows.items()
                  if any(_matches(x, key) for x in r.reads) and not any(_matches(i, key) for i in r.ignores)}
        assert direct == stages, key


def test_stage_evaluate_with_a_model_survives_new_training_data_as_a_cache_hit(tmp_path):
    corpus = write_jsonl(tmp_path / "corpus.jsonl", demo_rows("train.jsonl", 60))
    write_jsonl(tmp_path / "set_a.jsonl", demo_rows("eval.jsonl", 6))
    d = tiny_config_dict(tmp_path, n_train=20, n_val=4,
                         eval={"model": "base", "max_new_tokens": 4,
                               "sets": {"a": {"data_paths": [str(tmp_path / "set_a.jsonl")]}}})
    d["actor"]["model"] = {"corpus_paths": [str(corpus)]}  # the tokenizer does not move with the training data
    cfg = load_config(write_config(tmp_path, d))
    p = plan(cfg)
    assert upstream(p, "evaluate") == ("prepare_eval",)
    for stage in ("prepare_eval", "evaluate"):
        first = run_stage(p, stage, on_line=lambda _: None)
    manifest = Path(first.path) / "manifest.json"
    stamp = manifest.stat().st_mtime_ns
    write_jsonl(tmp_path / "train.jsonl", demo_rows("train.jsonl", 40)[20:])  # new training data
    time.sleep(0.01)
    again = plan(load_config(write_config(tmp_path, d)))
    assert again.fingerprints["train"] != p.fingerprints["train"]
    hit = run_stage(again, "evaluate", on_line=lambda _: None)
    assert hit.cached and hit.path == first.path and manifest.stat().st_mtime_ns == stamp
    folders = [f.name for f in (tmp_path / "artifacts" / "evaluate").iterdir() if not f.name.startswith(".")]
    assert folders == [hit.fingerprint]


def test_the_docs_stage_table_is_the_tables_rendering():
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    begin, end = "<!-- stage table: stages/graph.py render_markdown -->", "<!-- end of the stage table -->"
    assert begin in text and end in text
    assert text.split(begin)[1].split(end)[0].strip() == render_markdown().strip(), \
        "docs/architecture.md's stage table is stale: paste stages.graph.render_markdown()"


def test_each_stage_runs_through_the_function_its_row_names():
    """`run_stage` dispatches from the table: each row's `run` names the stage's own function
    (`module:function`, a function that module defines), and its `call` a function of
    stages/pipeline/calls.py that readies its call; each such function serves some row."""
    import ast
    import importlib.util

    from stages.pipeline import calls
    assert {s.call for s in TABLE} == set(calls.CALLS)
    assert all(callable(getattr(calls, name)) for name in calls.CALLS)
    for s in TABLE:
        module, _, name = s.run.partition(":")
        tree = ast.parse(Path(importlib.util.find_spec(module).origin).read_text())
        assert name in {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}, f"{s.name}: {s.run}"


def test_a_stage_with_input_files_says_which():
    """The docs' `input files` column comes from the rows: a row that reads input files (`inputs`) says
    which, and one that reads none says nothing."""
    no_inputs = Stage.__dataclass_fields__["inputs"].default
    assert [s.name for s in TABLE if (s.inputs is not no_inputs) != bool(s.input_files)] == []


def test_the_planning_order_comes_from_the_table():
    """Each stage is planned after what its fingerprint needs: the upstream it folds and the stages its
    facts are known after (FACT_AFTER), nothing written per stage."""
    order = planning_order()
    assert sorted(order) == sorted(s.name for s in TABLE)
    assert set(FACT_AFTER) <= set(FACTS) and {u for us in FACT_AFTER.values() for u in us} <= set(BY_NAME)
    for s in TABLE:
        before = set(order[:order.index(s.name)])
        assert set(s.folds) <= before, s.name
        assert {u for f in s.facts for u in FACT_AFTER.get(f, ())} <= before, s.name
    assert order.index("train") < order.index("champion") < order.index("register")
