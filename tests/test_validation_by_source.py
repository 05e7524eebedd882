"""Validation by source (docs/data.md, "Validation by source"; runtime/validation.py): with a mixture,
data.val_fraction holds out each source's own share by content hash (train's in val/, the others'
in heldout/<source>/), the same rows whichever order a file holds them in; validation scores each
source apart (loss and the replies' teacher-forced token accuracy, against a naive per-row loop with
the plain model); the guards of `runner.best_model_guard` keep a check from shipping (the rule on
metric streams, and resumed from its state). The end-to-end run under torchrun, killed and resumed
to the same choice, is slow."""

import hashlib
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import demo_rows, tiny_config_dict, write_config, write_jsonl
from stages.chatdata.shards import read_shards
from stages.core.config import ConfigError, RunnerConfig, load_config
from stages.core.config.fields import hashed
from stages.pipeline import plan, run_stage
from stages.pipeline.show import validation_report
from stages.runtime.validation import BestCheck

FRACTION = 0.25


def held_by_rule(line: str, fraction: float = FRACTION) -> bool:
    """docs/data.md's rule, written out: a JSONL row is held out when the first 8 bytes of the BLAKE2b
    digest of its stripped line, as a big-endian number, fall below fraction x 2^64."""
    h = hashlib.blake2b(line.strip().encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(h, "big") < fraction * 2 ** 64


def mixed(tmp: Path, extra_rows: list[dict], name: str = "config.yaml", with_val_files: bool = False, **sections):
    raw = tiny_config_dict(tmp, **sections)
    extra = write_jsonl(tmp / f"extra-{name}.jsonl", extra_rows)
    raw["data"]["mix"] = {"train": {"weight": 0.5}, "extra": {"paths": [str(extra)], "weight": 0.5}}
    raw["data"]["val_fraction"] = FRACTION
    if not with_val_files:
        raw["data"]["val_data_paths"] = []
    return load_config(write_config(tmp, raw, name)), extra


def contents(folder: Path) -> list[str]:
    """The held-out rows' conversations (prepare keeps their messages), as comparable text."""
    return [json.dumps(json.loads(m), sort_keys=True) for m in read_shards(folder, ["messages"]).column(0).to_pylist()]


def test_each_source_holds_out_its_share_by_content_whatever_the_order(tmp_path):
    rows = demo_rows("eval.jsonl", 40)
    (tmp_path / "a").mkdir()
    cfg, extra = mixed(tmp_path / "a", rows)
    p = plan(cfg)
    before = validation_report(p)  # `sftflow show`: the rule applied to the files
    run_stage(p, "prepare", on_line=lambda line: None)
    folder = p.folder("prepare")
    manifest = json.loads((folder / "manifest.json").read_text())
    after = validation_report(plan(cfg))  # prepare's count
    assert before["held_out"] == after["held_out"] == [
        {"source": m["source"], "rule": "0.25 by content hash", "rows": m["rows"]} for m in manifest["val_mix"]]
    assert after["line"].startswith(f"validation: {sum(m['rows'] for m in manifest['val_mix'])} held-out rows, "
                                    "scored per source: train ")
    train_lines = Path(cfg.data.train_data_paths[0]).read_text().splitlines()
    extra_lines = extra.read_text().splitlines()
    want = {"train": sum(map(held_by_rule, train_lines)), "extra": sum(map(held_by_rule, extra_lines))}
    assert 0 < want["extra"] < len(extra_lines) and 0 < want["train"] < len(train_lines)
    assert [{k: m[k] for k in ("source", "rows", "dir")} for m in manifest["val_mix"]] == [
        {"source": "train", "rows": want["train"], "dir": "val"},
        {"source": "extra", "rows": want["extra"], "dir": "heldout/extra"}]
    # what trains is the rest: every row of each source is in exactly one of train and its held-out folder
    assert manifest["mix"] == [{"source": "train", "rows": len(train_lines) - want["train"]},
                               {"source": "extra", "rows": len(extra_lines) - want["extra"]}]
    assert manifest["splits"]["val"]["rows_kept"] == want["train"]  # val/ is train's alone, as evaluate reads it
    held_extra = sorted(contents(folder / "heldout" / "extra"))
    assert held_extra == sorted(json.dumps(json.loads(line)["messages"], sort_keys=True)
                                for line in extra_lines if held_by_rule(line))
    # the same file reordered (and another config around it) holds out the same rows
    (tmp_path / "b").mkdir()
    other, _ = mixed(tmp_path / "b", rows[::-1])
    q = plan(other)
    run_stage(q, "prepare", on_line=lambda line: None)
    assert sorted(contents(q.folder("prepare") / "heldout" / "extra")) == held_extra


def test_val_files_validate_train_and_the_other_sources_hold_out_their_share(tmp_path):
    cfg, extra = mixed(tmp_path, demo_rows("eval.jsonl", 40), with_val_files=True)
    p = plan(cfg)
    run_stage(p, "prepare", on_line=lambda line: None)
    manifest = json.loads((p.folder("prepare") / "manifest.json").read_text())
    n_val = len(Path(cfg.data.val_data_paths[0]).read_text().splitlines())
    n_train = len(Path(cfg.data.train_data_paths[0]).read_text().splitlines())
    held = sum(map(held_by_rule, extra.read_text().splitlines()))
    assert [(m["source"], m["rows"]) for m in manifest["val_mix"]] == [("train", n_val), ("extra", held)]
    assert manifest["mix"][0] == {"source": "train", "rows": n_train}  # nothing of train's held out by hash


def test_the_guard_keys_are_outside_every_fingerprint_until_set(tmp_path):
    default = RunnerConfig()
    assert not {"best_model_guard", "metric_for_best_model"} & set(hashed(default))
    on = RunnerConfig(val_check_interval=1, load_best_model_at_end=True, metric_for_best_model="val_loss/train",
                      best_model_guard={"source": "rehearse", "max_drop": 0.1})
    assert hashed(on)["best_model_guard"] == [{"source": "rehearse", "metric": "val_loss", "max_drop": 0.1}]
    with pytest.raises(ValueError, match="runner.metric_for_best_model: 'val_los/train' is not"):
        RunnerConfig(metric_for_best_model="val_los/train")
    with pytest.raises(ValueError, match="runner.best_model_guard .* needs runner.load_best_model_at_end"):
        RunnerConfig(val_check_interval=1, early_stopping_patience=2,
                     best_model_guard=[{"source": "extra", "max_drop": 0.1}])


# --------------------------------------------------------------------------- the guard's rule (fast)

GUARD = [("val_loss/rehearse", 0.2)]


def guarded(patience: int = 0) -> BestCheck:
    return BestCheck("val_token_accuracy/train", patience, 0.0, True, GUARD)


def feed(rule: BestCheck, stream):
    return [rule.observe(step, acc, {"val_loss/rehearse": loss}) for step, acc, loss in stream]


def test_a_check_that_forgot_the_rehearsed_rows_never_ships():
    rule = guarded()
    # the start (step 0), a check within the bound, a better one beyond it, a better one back within it
    stream = [(0, 0.10, 2.00), (2, 0.40, 2.15), (4, 0.70, 2.30), (6, 0.50, 2.19)]
    assert feed(rule, stream) == [True, True, False, True]
    assert rule.start == {"val_loss/rehearse": 2.0}
    assert (rule.best_step, rule.best, rule.eligible_checks, rule.checks) == (6, 0.50, 3, 4)
    assert [r["step"] for r in rule.rejected] == [4]
    assert rule.rejected[0]["guard"].startswith("val_loss/rehearse 2.3 is 0.3 worse than the start's 2 (max_drop 0.2)")
    assert rule.summary(6, 6).startswith("shipping step 6: val_token_accuracy/train 0.5, best of 4 checks; 3 of 4 "
                                         "checks kept val_loss/rehearse within 0.2 of the start's 2")
    report = rule.report(6)
    assert (report["shipped_step"], report["rejected_steps"], report["shipped_start"]) == (6, [4], False)


def test_when_no_trained_check_keeps_the_guard_the_start_ships_and_patience_counts_them():
    rule = guarded(patience=2)
    assert feed(rule, [(0, 0.1, 2.0), (1, 0.9, 2.5), (2, 0.95, float("nan"))]) == [True, False, False]
    assert rule.stopped_at == 2 and rule.shipped_step(2) == 0
    assert rule.summary(2, 10).startswith("shipping step 0, the start (the weights training began from): no trained "
                                          "check was eligible and better than its val_token_accuracy/train 0.1")
    assert rule.report(2)["shipped_start"] is True


def test_a_loss_guard_and_an_accuracy_guard_bound_opposite_ways():
    rule = BestCheck("val_loss/train", 0, 0.0, True, [("val_token_accuracy/rehearse", 0.05)])
    assert [rule.observe(s, loss, {"val_token_accuracy/rehearse": acc})
            for s, loss, acc in [(0, 3.0, 0.60), (1, 2.0, 0.54), (2, 1.5, 0.56)]] == [True, False, True]
    assert rule.best_step == 2


def test_the_guarded_state_resumes_the_same_decisions():
    stream = [(0, 0.1, 2.0), (1, 0.3, 2.1), (2, 0.6, 2.4), (3, 0.4, 2.05), (4, 0.35, 2.0), (5, 0.38, 2.0)]
    whole = guarded(patience=2)
    feed(whole, stream)
    first = guarded(patience=2)
    feed(first, stream[:3])
    resumed = guarded(patience=2)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))  # as trainer_state.json holds it
    feed(resumed, stream[3:])
    assert resumed.state_dict() == whole.state_dict()
    assert (whole.best_step, whole.stopped_at) == (3, 5)
    other = BestCheck("val_token_accuracy/train", 2, 0.0, True, [("val_loss/rehearse", 0.3)])
    other.load_state_dict(first.state_dict())  # another bound is another rule: its state does not carry over
    assert other.checks == 0 and other.start is None
    with pytest.raises(ConfigError, match="runner.best_model_guard: no start values"):
        other.observe(4, 0.5, {"val_loss/rehearse": 2.0})


def test_reply_accuracy_is_watched_with_token_accuracy_breaking_its_ties():
    on = RunnerConfig(val_check_interval=1, load_best_model_at_end=True,
                      metric_for_best_model="val_reply_accuracy/train",
                      best_model_guard={"source": "rehearse", "metric": "val_reply_accuracy", "max_drop": 0.1})
    rule = BestCheck.from_runner(on)
    assert rule.higher_is_better and rule.keys() == ["val_reply_accuracy/train", "val_token_accuracy/train",
                                                     "val_reply_accuracy/rehearse"]
    # (step, reply accuracy, its tie-breaker token accuracy, the guard's reply accuracy on the rehearsed rows)
    stream = [(0, 0.0, 0.60, 1.0), (2, 0.0, 0.70, 1.0), (4, 0.0, 0.80, 1.0), (6, 0.25, 0.85, 1.0),
              (8, 0.5, 0.9, 0.875), (10, 0.5, 0.9, 1.0), (12, 0.5, 0.88, 1.0), (14, 0.5, 0.91, 1.0),
              (16, 0.25, 0.99, 1.0), (18, 0.5, 0.91, 1.0), (20, 0.5, 0.99, 0.75)]
    got = [rule.observe(s, v, {"val_reply_accuracy/rehearse": g}, tie=t) for s, v, t, g in stream]
    # no row exact yet, the tokens closer: improving (patience 2 would have stopped at step 4 without the
    # tie-breaker); step 8 lost 1/8 of the rehearsed rows (> 0.1); 10 is 8's value within the guard; 12
    # ties below; 14 ties above; 16 has more tokens right and fewer rows; 18 ties 14 exactly; 20 would win
    # the tie but broke the guard
    assert got == [True, True, True, True, False, True, False, True, False, False, False]
    assert (rule.best_step, rule.best, rule.best_tie, rule.since_best) == (14, 0.5, 0.91, 3)
    assert [r["step"] for r in rule.rejected] == [8, 20]
    assert rule.split([0.5, 0.9, 1.0]) == (0.5, 0.9, {"val_reply_accuracy/rehearse": 1.0})
    assert rule.report(20)["tie_breaker"] == "val_token_accuracy/train"
    assert rule.summary(20, 20).startswith("shipping step 14: val_reply_accuracy/train 0.5 (val_token_accuracy/train "
                                           "0.91), best of 11 checks")
    resumed = BestCheck.from_runner(on)
    resumed.load_state_dict(json.loads(json.dumps(BestCheck.from_runner(on).state_dict())))
    half = BestCheck.from_runner(on)
    for s, v, t, g in stream[:5]:
        half.observe(s, v, {"val_reply_accuracy/rehearse": g}, tie=t)
    resumed.load_state_dict(json.loads(json.dumps(half.state_dict())))
    for s, v, t, g in stream[5:]:
        resumed.observe(s, v, {"val_reply_accuracy/rehearse": g}, tie=t)
    assert resumed.state_dict() == rule.state_dict()  # the tie-breaker's best resumes too
    with pytest.raises(ConfigError, match="needs MyWorker.get_eval_model_output to count `reply_correct` and "
                                          "`reply_total`"):
        BestCheck("val_reply_accuracy", 0, 0.0, True).values({"val_loss": 1.0}, "MyWorker.get_eval_model_output")


def test_a_missing_per_source_metric_is_one_line_naming_the_key():
    rule = guarded()
    with pytest.raises(ConfigError, match="runner.metric_for_best_model: validation reported no "
                                          "val_token_accuracy/train; it needs held-out rows of the mixture source "
                                          "'train'.*sources held out: extra"):
        rule.values({"val_loss": 1.0, "val_loss/extra": 1.0}, "SFTWorker.get_eval_model_output")


# --------------------------------------------------------------------------- scored per source (fast)


@pytest.fixture(scope="module")
def one_process_group(tmp_path_factory):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{tmp_path_factory.mktemp('pg') / 'store'}", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


def random_rows(n: int, seed: int) -> list[dict]:
    """Rows of 5..20 random tokens whose second half (a reply) is trained."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(5, 21, (1,), generator=g))
        ids = torch.randint(3, 97, (length,), generator=g)
        mask = torch.zeros(length, dtype=torch.int8)
        mask[length // 2:] = 1
        out.append({"input_ids": ids.numpy(), "loss_mask": mask.numpy()})
    return out


def greedy_rows(model, rows: list[dict]) -> list[dict]:
    """`rows` with each reply replaced by the model's own greedy continuation of the prompt: their
    teacher-forced token accuracy is 1 by construction."""
    out = []
    with torch.no_grad():
        for r in rows:
            ids = torch.as_tensor(r["input_ids"], dtype=torch.long)
            keep = int((r["loss_mask"] == 0).sum())
            seq = ids[:keep]
            while len(seq) < len(ids):
                seq = torch.cat([seq, model(input_ids=seq[None]).logits[0, -1].argmax()[None]])
            out.append({"input_ids": seq.numpy(), "loss_mask": r["loss_mask"]})
    return out


def naive(model, rows: list[dict]) -> dict:
    """Loss and token accuracy of `rows`, one unpadded row at a time through the plain model: position t
    predicts token t+1, counted where token t+1 is trained."""
    loss, correct, n = 0.0, 0, 0
    with torch.no_grad():
        for r in rows:
            ids = torch.as_tensor(r["input_ids"], dtype=torch.long)
            logits = model(input_ids=ids[None]).logits[0].double()
            for t in range(len(ids) - 1):
                if r["loss_mask"][t + 1]:
                    loss += float(F.cross_entropy(logits[t], ids[t + 1]))
                    correct += int(logits[t].argmax()) == int(ids[t + 1])
                    n += 1
    return {"val_loss": loss / n, "val_token_accuracy": correct / n, "val_tokens": n}


def test_validation_scores_each_source_as_a_naive_loop_does(tmp_path, one_process_group):
    from test_loss import tiny_lm

    from stages.core.config import SFTConfig
    from stages.runtime.validation import Joined
    from stages.runtime.worker import SFTWorker, WorkerSpec
    model = tiny_lm("qwen2-untied").eval()
    new, rehearsed = random_rows(7, 1), greedy_rows(model, random_rows(5, 2))
    cfg = SFTConfig.model_validate(tiny_config_dict(tmp_path, actor={"micro_batch_size": 3, "global_batch_size": 3}))
    spec = WorkerSpec(config=cfg, out_dir=str(tmp_path), val_mix=[{"source": "train", "rows": 7, "dir": "val"},
                                                                   {"source": "replay", "rows": 0, "dir": "x"},
                                                                   {"source": "rehearse", "rows": 5, "dir": "y"}])
    w = SFTWorker.for_eval(spec, model, torch.device("cpu"), 0, 1)
    w.val_ds = Joined([new, rehearsed])
    got = w.validate()
    want = {"": naive(model, new + rehearsed), "/train": naive(model, new), "/rehearse": naive(model, rehearsed)}
    for suffix, metrics in want.items():
        for key, value in metrics.items():
            assert got[key + suffix] == pytest.approx(value, rel=1e-5, abs=1e-6), key + suffix
    # what the model reproduces scores 1, random replies next to nothing: the metric tells them apart
    assert got["val_token_accuracy/rehearse"] == 1.0 and got["val_token_accuracy/train"] < 0.2
    assert not any(k.endswith("/replay") for k in got)  # a source without held-out rows reports nothing
    assert model.training  # validation hands the model back in training mode


def greedy_replies(model, prefix: torch.Tensor, n: int, margins: list | None = None) -> torch.Tensor:
    """`n` tokens decoded greedily after `prefix`, one forward per token (no cache, nothing shared with
    the loss code); `margins` gets each pick's lead over the runner-up logit."""
    seq = prefix
    with torch.no_grad():
        for _ in range(n):
            logits = model(input_ids=seq[None]).logits[0, -1]
            if margins is not None:
                top = logits.topk(2).values
                margins.append(float(top[0] - top[1]))
            seq = torch.cat([seq, logits.argmax()[None]])
    return seq[len(prefix):]


def decoded_exactly(model, row: dict) -> bool:
    """The reference for `val_reply_accuracy`: greedy decoding, given the row's reference turns before
    each reply, answers every reply of the row token for token."""
    ids = torch.as_tensor(row["input_ids"], dtype=torch.long)
    mask = list(row["loss_mask"])
    t = 1  # a packed row's first token is never trained (collate_packed)
    while t < len(ids):
        if not mask[t]:
            t += 1
            continue
        end = t
        while end < len(ids) and mask[end]:
            end += 1
        if not torch.equal(greedy_replies(model, ids[:t], end - t), ids[t:end]):
            return False
        t = end
    return True


def conversation(model, turns: list[tuple[int, int]], seed: int, wrong_turn: int | None = None) -> dict:
    """A row of (prompt length, reply length) turns: random prompts, each reply the model's own greedy
    one, except that the last token of reply `wrong_turn` is changed (one token of the row differs).
    Prompts are drawn again until every greedy pick leads its runner-up by 1e-3: no near-tie that another
    CPU's rounding, or the batched forward's, could flip."""
    g = torch.Generator().manual_seed(seed)
    while True:
        ids, mask, margins = torch.zeros(0, dtype=torch.long), [], []
        for k, (prompt, reply) in enumerate(turns):
            ids = torch.cat([ids, torch.randint(3, 97, (prompt,), generator=g)])
            answer = greedy_replies(model, ids, reply, margins)
            if k == wrong_turn:
                answer[-1] = (answer[-1] - 3 + 1) % 94 + 3
            ids = torch.cat([ids, answer])
            mask += [0] * prompt + [1] * reply
        if min(margins) > 1e-3:
            break
    return {"input_ids": ids.numpy(), "loss_mask": torch.tensor(mask, dtype=torch.int8).numpy()}


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_reply_accuracy_counts_the_rows_greedy_decoding_answers_exactly(tmp_path, one_process_group, monkeypatch,
                                                                         packing):
    """`val_reply_accuracy`: a row counts when every one of its replies is what greedy decoding answers
    given the reference turns before it, checked here by decoding them; one changed token makes a row
    wrong while its token accuracy stays high (a fact's one differing value, e.g. the panel's nova)."""
    from test_loss import tiny_lm

    import stages.runtime.loss as loss
    from stages.core.config import SFTConfig
    from stages.runtime.validation import Joined
    from stages.runtime.worker import SFTWorker, WorkerSpec
    monkeypatch.setattr(loss, "LOSS_CHUNK", 5)  # the hits of several head chunks, joined in order
    model = tiny_lm("qwen2-untied").eval()
    one_turn, two_turns = [(4, 6)], [(3, 4), (2, 5)]
    new = [conversation(model, one_turn, 1), conversation(model, one_turn, 2, wrong_turn=0),
           conversation(model, two_turns, 3), conversation(model, two_turns, 4, wrong_turn=1),
           conversation(model, two_turns, 5, wrong_turn=0), *random_rows(2, 6)]
    rehearsed = [conversation(model, two_turns, 7), conversation(model, one_turn, 8)]
    cfg = SFTConfig.model_validate(tiny_config_dict(tmp_path, actor={"micro_batch_size": 3, "global_batch_size": 3}))
    spec = WorkerSpec(config=cfg, out_dir=str(tmp_path), val_mix=[{"source": "train", "rows": 7, "dir": "val"},
                                                                   {"source": "rehearse", "rows": 2, "dir": "y"}])
    w = SFTWorker.for_eval(spec, model, torch.device("cpu"), 0, 1)
    w.packing = packing
    w.val_ds = Joined([new, rehearsed])
    got = w.validate()
    right = [decoded_exactly(model, r) for r in new + rehearsed]
    assert right == [True, False, True, False, False, False, False, True, True]  # the rows were built so
    assert got["val_reply_accuracy/train"] == pytest.approx(sum(right[:7]) / 7)
    assert got["val_reply_accuracy/rehearse"] == 1.0 and got["val_reply_accuracy"] == pytest.approx(4 / 9)
    assert got["val_token_accuracy/train"] > 0.6  # the rows with one changed token are nearly all right by tokens
    assert got["val_token_accuracy/rehearse"] == 1.0


def test_the_worker_keeps_the_weights_of_the_checks_the_tie_breaker_prefers(tmp_path, one_process_group, capsys):
    """SFTWorker._observe, the loop's hook: each check's values through the broadcast into the rule, the
    best's weights kept, train.log's line with the tie-breaker's value."""
    from types import SimpleNamespace

    from test_loss import tiny_lm

    from stages.core.config import SFTConfig
    from stages.runtime.worker import SFTWorker, WorkerSpec
    cfg = SFTConfig.model_validate(tiny_config_dict(tmp_path))
    w = SFTWorker.for_eval(WorkerSpec(config=cfg, out_dir=str(tmp_path)), tiny_lm("qwen2-untied"),
                           torch.device("cpu"), 0, 1)
    kept = []
    w.checkpointer = SimpleNamespace(save_best=lambda step, model: kept.append(step))
    rule = BestCheck("val_reply_accuracy/train", 2, 0.0, True)
    for step, reply, tokens in [(2, 0.0, 0.5), (4, 0.0, 0.6), (6, 0.0, 0.6), (8, 1 / 3, 0.55), (10, 1 / 3, 0.7)]:
        w._observe(rule, step, {"val_reply_accuracy/train": reply, "val_token_accuracy/train": tokens,
                                "val_loss": 1.0})
    assert kept == [2, 4, 8, 10] and rule.stopped_at is None
    out = capsys.readouterr().out
    assert "check at step 6: val_reply_accuracy/train 0 (val_token_accuracy/train 0.6) (not better)" in out
    assert "check at step 10: val_reply_accuracy/train 0.333333 (val_token_accuracy/train 0.7) (the best so far)" in out


# --------------------------------------------------------------------------- torchrun (slow)

# lr 0.2 (warmup 4) makes the tiny model's loss on the extra source's held-out rows jump above the
# start's (6.54) by more than 1 at steps 4, 5 and 7 (measured: 4.94 6.18 6.08 9.89 10.22 7.15 11.50),
# while its token accuracy on train's held-out rows peaks at step 1 (0.114) and patience 6 stops at 7.
GUARDED = dict(runner={"max_epochs": 3, "max_steps": 12, "val_check_interval": 1, "save_interval": 1,
                       "keep_checkpoints": 20, "early_stopping_patience": 6, "load_best_model_at_end": True,
                       "metric_for_best_model": "val_token_accuracy/train",
                       "best_model_guard": {"source": "extra", "metric": "val_loss", "max_drop": 1.0}},
               actor={"optim": {"lr": 0.2, "warmup": 4}})


def the_rule_by_hand(folder: Path, start_acc: float, start_extra: float, max_drop: float, patience: int) -> dict:
    """The shipping rule, applied by hand to the metrics the run logged: the best val_token_accuracy/train
    among the start and the checks whose val_loss/extra is within max_drop of the start's; patience
    counts the trained checks that did not improve on it."""
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    best, best_step, since, rejected, stopped = start_acc, 0, 0, [], None
    for r in rows:
        if r["val_loss/extra"] - start_extra > max_drop:
            rejected.append(r["step"])
            since += 1
        elif r["val_token_accuracy/train"] > best:
            best, best_step, since = r["val_token_accuracy/train"], r["step"], 0
        else:
            since += 1
        if since >= patience:
            stopped = r["step"]
            break
    return {"shipped_step": best_step, "best_metric": best, "rejected_steps": rejected, "stopped_at": stopped}


@pytest.mark.slow
def test_a_guarded_run_killed_twice_resumes_to_the_same_choice_and_weights(tmp_path):
    import re

    from test_early_stopping import checkpoint_weights
    from test_train_core import train
    from test_train_core import weights as exported

    from stages.train import TrainingFailed
    rows = demo_rows("eval.jsonl", 40)[::-1]
    (tmp_path / "whole").mkdir()
    (tmp_path / "killed").mkdir()
    whole = Path(train(mixed(tmp_path / "whole", rows, **GUARDED)[0]).path)
    runtime = json.loads((whole / "runtime.json").read_text())
    log = (whole / "train.log").read_text()
    start = re.search(r"check at step 0: val_token_accuracy/train (\S+); the start's val_loss/extra (\S+)", log)
    assert runtime["guard_start"] == {"val_loss/extra": pytest.approx(float(start[2]), rel=1e-5)}
    want = the_rule_by_hand(whole, float(start[1]), runtime["guard_start"]["val_loss/extra"], 1.0, 6)
    assert want["rejected_steps"] and want["stopped_at"] is not None  # the guard and patience both acted
    assert runtime["best_metric"] == pytest.approx(want.pop("best_metric"), rel=1e-12)
    assert {k: runtime[k] for k in want} == want
    assert runtime["shipped_start"] is (want["shipped_step"] == 0)
    # visible: every rejection and the choice in train.log, the manifest, the MLflow run
    assert "validation: " in log and "held-out rows, scored per source: train " in log
    for step in want["rejected_steps"]:
        assert re.search(rf"check at step {step}: .*, not eligible: val_loss/extra \S+ is \S+ worse than the "
                         r"start's", log)
    assert re.search(rf"shipping step {want['shipped_step']}: val_token_accuracy/train \S+, best of \d+ checks; "
                     rf"\d+ of \d+ checks kept val_loss/extra within 1 of the start's", log)
    manifest = json.loads((whole / "manifest.json").read_text())
    assert manifest["metrics"]["shipped_step"] == want["shipped_step"]
    assert [m["source"] for m in manifest["held_out"]] == ["train", "extra"]
    from mlflow.tracking import MlflowClient
    cfg_whole = mixed(tmp_path / "whole", rows, **GUARDED)[0]
    run = MlflowClient(cfg_whole.resolved_tracking_uri).get_run(manifest["mlflow_run_id"])
    assert run.data.tags["sftflow.shipped_step"] == str(want["shipped_step"])
    assert run.data.params["runtime.rejected_steps"] == str(want["rejected_steps"])
    # the exported weights are the loop's at the shipped step
    got, at_best = exported(whole), checkpoint_weights(whole, want["shipped_step"])
    assert all(torch.equal(got[k], at_best[k]) for k in got)

    # killed after the first checkpoint (the start's values come back from its state, not a new check)
    # and while saving a rejected check's step; the resumed run decides and ships the same
    cfg = mixed(tmp_path / "killed", rows, **GUARDED)[0]
    p = plan(cfg)
    for fault in ("after_save:1", "save:5"):
        with pytest.raises(TrainingFailed, match="killed by SIGKILL|training failed"):
            train(cfg, {"SFTFLOW_FAULT": fault}, p)
    done = Path(train(cfg, p=p).path)
    log = (done / "train.log").read_text()
    assert log.count("check at step 0:") == 1  # the start was validated once, before the first kill
    assert json.loads((done / "runtime.json").read_text()) == runtime
    theirs = exported(done)
    assert theirs.keys() == got.keys()
    assert max((theirs[k] - got[k]).abs().max().item() for k in got) <= 1e-6


def test_a_watched_source_without_held_out_rows_stops_before_torchrun(tmp_path):
    from test_train_core import train
    cfg, _ = mixed(tmp_path, demo_rows("eval.jsonl", 40), with_val_files=True,
                   runner={"val_check_interval": 1, "load_best_model_at_end": True,
                           "best_model_guard": {"source": "extra", "max_drop": 0.1}})
    cfg.data.val_fraction = 0.0  # val files for train, nothing held out of extra
    with pytest.raises(ConfigError, match=r"runner.best_model_guard: val_loss/extra needs held-out rows of the source "
                                          r"'extra'; held out: train 12, extra 0"):
        train(cfg)
    assert not list(cfg.artifacts_path.joinpath("train").glob("*/train.log"))


def test_a_warm_start_watching_train_through_val_files_is_told_so(tmp_path):
    """A day's config copied from day 1 keeps day 1's data.val_data_paths: the `train` source's validation
    is then day 1's rows, not the day's new ones (the panel month chose its checks by the identity rows).
    train.log and `sftflow show` say so; nothing is said where the check watches the day's own rows."""
    from stages.core.config import stale_train_validation
    val = str(write_jsonl(tmp_path / "val.jsonl", demo_rows("eval.jsonl", 4)))
    selecting = {"val_check_interval": 2, "load_best_model_at_end": True,
                 "metric_for_best_model": "val_token_accuracy/train"}

    def cfg(name, runner=selecting, data=None, init_from="champion"):
        raw = tiny_config_dict(tmp_path, runner=runner, actor={"init_from": init_from},
                               data={"val_data_paths": [val], **(data or {})})
        return load_config(write_config(tmp_path, raw, name))

    note = stale_train_validation(cfg("a.yaml"))
    assert note and "data.val_data_paths" in note and val in note
    p = plan(cfg("a.yaml"))
    assert validation_report(p)["note"] == note
    assert stale_train_validation(cfg("b.yaml", init_from="base")) is None  # day 1: its own rows
    assert stale_train_validation(cfg("c.yaml", data={"val_data_paths": [], "val_fraction": 0.2})) is None
    # val_loss (no source) is train's too; a guard on train counts; a check of rehearse alone does not
    assert stale_train_validation(cfg("d.yaml", runner={**selecting, "metric_for_best_model": "val_loss"}))
    guard = {"source": "train", "metric": "val_loss", "max_drop": 0.1}
    assert stale_train_validation(cfg("e.yaml", runner={**selecting, "metric_for_best_model": "val_loss/replay",
                                                          "best_model_guard": guard}))
    assert stale_train_validation(cfg("f.yaml", runner={**selecting, "metric_for_best_model": "val_loss/replay"})) \
        is None
