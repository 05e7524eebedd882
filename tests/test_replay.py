"""The replay stage: the base model's answers against a naive one-prompt-at-a-time loop, every dropped
answer counted by its reason, what its fingerprint depends on, the contamination check, and (slow)
two processes under torchrun equal one."""

import json
from pathlib import Path

import pytest
import torch

from conftest import base_model, demo_rows, noisy_model, tiny_config_dict, write_config, write_jsonl
from stages.chatdata.readers import RowError, to_prompt
from stages.core.config import ConfigError, load_config
from stages.pipeline import plan, run_stage
from stages.replay import repeats, verdict

MAX_NEW = 12


def test_a_prompt_row_in_each_shape():
    user = {"role": "user", "content": "Hi?"}
    assert to_prompt({"messages": [user, {"role": "assistant", "content": "Hello."}]}) == [user]
    assert to_prompt({"messages": [{"role": "system", "content": "Be brief."}, user]})[-1] == user
    assert to_prompt({"conversations": [{"from": "human", "value": "Hi?"}]}) == [user]
    assert to_prompt({"prompt": "Hi?", "completion": "Hello."}) == [user]
    assert to_prompt({"instruction": "Add", "input": "2 and 2"}) == [{"role": "user", "content": "Add\n\n2 and 2"}]
    assert to_prompt({"q": "Hi?"}, {"prompt": "q"}) == [user]
    for bad in ({"messages": [{"role": "assistant", "content": "x"}]}, {"text": "x"}, {"prompt": "  "}, [1]):
        with pytest.raises(RowError):
            to_prompt(bad)


def test_answers_are_dropped_for_a_reason():
    assert verdict({"text": " \n", "stopped": True}, 3) == "empty"
    assert verdict({"text": "Paris is", "stopped": False}, 3) == "cut_off"
    loop = "I am a cat. " * 3
    assert repeats(loop) == 3 and verdict({"text": loop, "stopped": True}, 3) == "repetition"
    assert verdict({"text": loop, "stopped": True}, 4) is None
    assert verdict({"text": "Paris.", "stopped": True}, 3) is None


def naive_answer(model, tok, prompt: list[dict], max_new: int) -> tuple[str, bool]:
    """One prompt, no batching, no padding, no KV cache, no `generate`: argmax of the last logits until
    the tokenizer's end-of-sequence or end-of-turn token."""
    ids = list(tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True,
                                       return_dict=True)["input_ids"])
    gen_eos = model.generation_config.eos_token_id
    stops = {tok.eos_token_id, *(gen_eos if isinstance(gen_eos, list) else [gen_eos])}
    stops |= {tok.convert_tokens_to_ids(t) for t in tok.all_special_tokens if t in ("<|im_end|>", "<|endoftext|>")}
    new: list[int] = []
    with torch.no_grad():
        while len(new) < max_new:
            t = int(model(input_ids=torch.tensor([ids + new])).logits[0, -1].argmax())
            if t in stops:
                return tok.decode(new, skip_special_tokens=True), True
            new.append(t)
    return tok.decode(new, skip_special_tokens=True), False


@pytest.fixture(scope="module")
def replayed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("replay")
    raw = tiny_config_dict(tmp, n_train=24)
    model, tok = noisy_model(base_model(load_config(write_config(tmp, raw))), tmp / "model")
    prompts = [{"messages": r["messages"][:-1]} for r in demo_rows("train.jsonl", 400)[-40:]]
    write_jsonl(tmp / "prompts.jsonl", [*prompts, {"text": "not a prompt row"}])
    raw["actor"]["model"] = {"model_path": str(tmp / "model")}
    raw["actor"]["nproc_per_node"] = 1
    raw["data"]["mix"] = {"train": {"weight": 0.5}, "replay": {"weight": 0.5}}
    raw["replay"] = {"prompt_paths": [str(tmp / "prompts.jsonl")], "max_new_tokens": MAX_NEW, "batch_size": 8,
                     "max_repeats": 3}
    cfg = load_config(write_config(tmp, raw))
    p = plan(cfg)
    result = run_stage(p, "replay", on_line=lambda line: None)
    return {"tmp": tmp, "raw": raw, "model": model, "tok": tok, "prompts": prompts, "plan": p, "result": result,
            "answers_text": (Path(result.path) / "answers.jsonl").read_text()}


def test_replay_answers_equal_the_naive_loop_and_every_drop_is_counted(replayed):
    folder = Path(replayed["result"].path)
    answers = [json.loads(line) for line in (folder / "answers.jsonl").read_text().splitlines()]
    assert len(answers) == 41 and answers[-1]["reason"] == "unreadable"
    want_reasons = {}
    for prompt, got in zip(replayed["prompts"], answers):
        text, stopped = naive_answer(replayed["model"], replayed["tok"], prompt["messages"], MAX_NEW)
        assert got["answer"] == text
        reason = verdict({"text": text, "stopped": stopped}, 3)
        assert got["reason"] == reason and got["kept"] is (reason is None)
        want_reasons[reason] = want_reasons.get(reason, 0) + 1
    metrics = json.loads((folder / "manifest.json").read_text())["metrics"]
    assert metrics["prompts"] == 41 and metrics["dropped_unreadable"] == 1
    for reason in ("empty", "cut_off", "repetition"):
        assert metrics[f"dropped_{reason}"] == want_reasons.get(reason, 0)
    assert metrics["kept"] == want_reasons.get(None, 0) > 0 and metrics["dropped_cut_off"] > 0
    kept = [json.loads(line)["messages"] for line in (folder / "conversations.jsonl").read_text().splitlines()]
    assert kept == [[*p["messages"], {"role": "assistant", "content": a["answer"].strip()}]
                    for p, a in zip(replayed["prompts"], answers) if a["kept"]]


def test_the_kept_answers_are_the_replay_source_of_the_mixture(replayed):
    p = replayed["plan"]
    run_stage(p, "prepare", on_line=lambda line: None)
    manifest = json.loads((p.folder("prepare") / "manifest.json").read_text())
    kept = json.loads((Path(replayed["result"].path) / "manifest.json").read_text())["metrics"]["kept"]
    assert manifest["mix"] == [{"source": "train", "rows": 24}, {"source": "replay", "rows": kept}]


def test_the_replay_fingerprint_is_the_model_prompts_and_settings_never_the_training_data(replayed):
    tmp, raw = replayed["tmp"], replayed["raw"]
    fp = replayed["plan"].fingerprints["replay"]

    def replay_fp(name, **changes):
        r = json.loads(json.dumps(raw))
        for dotted, value in changes.items():
            section, key = dotted.split("__")
            r[section][key] = value
        return plan(load_config(write_config(tmp, r, name))).fingerprints["replay"]
    more = write_jsonl(tmp / "more.jsonl", demo_rows("train.jsonl", 30))
    assert replay_fp("a.yaml", data__train_data_paths=[str(more)], runner__seed=3) == fp
    assert replay_fp("b.yaml", replay__max_new_tokens=MAX_NEW + 1) != fp
    write_jsonl(tmp / "other-prompts.jsonl", replayed["prompts"][:5])
    assert replay_fp("c.yaml", replay__prompt_paths=[str(tmp / "other-prompts.jsonl")]) != fp


@pytest.mark.parametrize("where", ["replay", "train"])
def test_a_prompt_that_is_also_an_eval_prompt_is_refused_at_planning(tmp_path, where):
    raw = tiny_config_dict(tmp_path, n_train=24)
    rows = demo_rows("eval.jsonl", 6)
    write_jsonl(tmp_path / "set.jsonl", rows)
    leaked = dict(rows[3], messages=[{"role": "user",
                                      "content": "  " + rows[3]["messages"][-2]["content"].upper() + "!"},
                                     {"role": "assistant", "content": "x"}])
    target = tmp_path / ("prompts.jsonl" if where == "replay" else "train.jsonl")
    lines = (demo_rows("train.jsonl", 24) if where == "train" else [{"prompt": "Unrelated?"}]) + [leaked]
    write_jsonl(target, lines)
    raw["eval"]["sets"] = {"held": {"data_paths": [str(tmp_path / "set.jsonl")]}}
    if where == "replay":
        raw["data"]["mix"] = {"train": {"weight": 1}, "replay": {"weight": 1}}
        raw["replay"] = {"prompt_paths": [str(target)]}
    with pytest.raises(ConfigError) as e:
        plan(load_config(write_config(tmp_path, raw)))
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"{target}:{len(lines)}:") and f"{tmp_path / 'set.jsonl'}:4" in line
    assert "eval set 'held'" in line


@pytest.mark.slow
def test_two_processes_under_torchrun_answer_as_one(replayed):
    tmp = replayed["tmp"]
    raw = json.loads(json.dumps(replayed["raw"]))
    raw["actor"].update(nproc_per_node=2, micro_batch_size=4, global_batch_size=16)
    p = plan(load_config(write_config(tmp, raw, "two.yaml")))
    assert p.fingerprints["replay"] == replayed["plan"].fingerprints["replay"]
    import shutil
    shutil.rmtree(p.folder("replay"))
    two = run_stage(p, "replay", on_line=lambda line: None)
    assert (Path(two.path) / "replay.log").is_file()  # it ran under torchrun
    assert (Path(two.path) / "answers.jsonl").read_text() == replayed["answers_text"]


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_api")
def test_a_two_trial_sweep_runs_the_replay_stage_once_and_both_trials_train_on_it(replayed):
    """The replay folder is a shared stage of a sweep: one folder for both trials, built once (its
    manifest written before the sweep started is left as it was), and the one prepare folder both
    trials train on holds its kept answers as the `replay` source."""
    from conftest import sftflow
    raw = json.loads(json.dumps(replayed["raw"]))
    raw["runner"].update(max_steps=2)
    raw["actor"].update(global_batch_size=8)
    cfg_path = write_config(replayed["tmp"], raw, "sweep.yaml")
    replay_manifest = Path(replayed["result"].path) / "manifest.json"
    stamp = replay_manifest.stat().st_mtime_ns
    proc = sftflow("sweep", "-c", str(cfg_path), "actor.optim.lr=1e-3,2e-3", cwd=replayed["tmp"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    art = replayed["tmp"] / "artifacts"

    def folders(stage):
        return [d for d in (art / stage).iterdir() if not d.name.startswith(".")]
    assert folders("replay") == [Path(replayed["result"].path)] and replay_manifest.stat().st_mtime_ns == stamp
    trains = [json.loads((d / "manifest.json").read_text()) for d in folders("train")]
    assert len(trains) == 2 and len({t["prepare_dir"] for t in trains}) == 1
    prepared = json.loads((Path(trains[0]["prepare_dir"]) / "manifest.json").read_text())
    assert [s["ref"] for s in prepared["sources"] if s["mix"] == "replay"] == [
        str(Path(replayed["result"].path) / "conversations.jsonl")]
    assert all(t["metrics"]["mix_replay_per_epoch"] > 0 for t in trains)
