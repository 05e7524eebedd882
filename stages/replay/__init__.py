"""replay: the base model answers a file of prompts; its kept answers become a training source.

Contract (docs/data.md, "Replay"): the prompts (`replay.prompt_paths`; rows as `chatdata.readers.to_prompt`
reads them: messages, conversations, prompt or instruction, a trailing reply left out) are answered
greedily with the generation code evaluate
uses (`stages.inference.generation`: batched, left-padded, `replay.max_new_tokens`), in this process or,
with `actor.nproc_per_node` > 1, under torchrun as evaluate is. An answer is dropped, and counted by
reason, when it is empty, cut off at `max_new_tokens` without an end token, or degenerate (one word
4-gram `max_repeats` times); an unreadable prompt row is dropped as `unreadable`. The folder's
fingerprint is the base model, the prompt files' contents and these settings, never the training
data, so trials, sweeps and retrains reuse it.

Output folder: conversations.jsonl (the kept conversations, messages format: data.mix.replay's rows),
answers.jsonl (every prompt: file:line, answer, kept, reason), spec.json, replay.log (torchrun only),
manifest.json.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Callable

from stages.chatdata.readers import RowError, iter_records, parse_record, to_prompt
from stages.core.cache.artifacts import StageBuild
from stages.core.config import REPLAY_PROMPTS, SFTConfig
from stages.core.errors import StageError
from stages.launch.launcher import run_torchrun, torchrun_command

from .spec import ReplaySpec

CONVERSATIONS = "conversations.jsonl"
REASONS = ("unreadable", "empty", "cut_off", "repetition")


class ReplayFailed(StageError):
    """Generating the replay answers failed."""


def read_prompts(cfg: SFTConfig) -> tuple[list[dict], list[dict]]:
    """(prompts, unreadable rows): every row of the prompt files in order, as {source, prompt}."""
    kept, bad = [], []
    for path in cfg.inputs()[REPLAY_PROMPTS]:
        for line, rec in iter_records(path, "val"):
            source = f"{path}:{line}"
            try:
                kept.append({"source": source, "prompt": to_prompt(parse_record(rec), cfg.data.columns)})
            except RowError as e:
                bad.append({"source": source, "kept": False, "reason": "unreadable",
                            "detail": f"{e.reason} {e.detail}"})
    return kept, bad


def repeats(text: str, n: int = 4) -> int:
    """How often the answer's most frequent word n-gram occurs."""
    words = re.findall(r"\w+", text.lower())
    grams = Counter(tuple(words[i:i + n]) for i in range(len(words) - n + 1))
    return max(grams.values(), default=0)


def verdict(answer: dict, max_repeats: int) -> str | None:
    """Why an answer is dropped (a REASONS entry), or None when it is kept."""
    if not answer["text"].strip():
        return "empty"
    if not answer["stopped"]:
        return "cut_off"
    if repeats(answer["text"]) >= max_repeats:
        return "repetition"
    return None


def run_replay(cfg: SFTConfig, fp: str, model_path: str, on_line: Callable[[str], None] = print) -> dict:
    """Writes the replay folder for fingerprint `fp`; returns its manifest metrics."""
    prompts, unreadable = read_prompts(cfg)
    if not prompts:
        raise ReplayFailed(f"replay: no readable prompt in {', '.join(cfg.replay.prompt_paths)}")
    build = StageBuild(cfg.artifacts_path, "replay", fp)
    spec = ReplaySpec(config=cfg, model_path=model_path, prompts=prompts, out_dir=str(build.partial))
    spec_path = build.partial / "spec.json"
    spec_path.write_text(spec.model_dump_json(indent=2))
    if cfg.actor.world_size == 1:
        from .runner import answer_spec
        answers = answer_spec(spec)
    else:
        run_torchrun(torchrun_command(cfg, spec_path, module="stages.replay"), build.partial / "replay.log",
                     ReplayFailed, "replay", on_line, cfg.actor.nproc_per_node)
        answers = [json.loads(x) for x in (build.partial / "generated.jsonl").read_text(encoding="utf-8").splitlines()]
        (build.partial / "generated.jsonl").unlink()
    rows, dropped = [], Counter({r: 0 for r in REASONS})
    dropped["unreadable"] = len(unreadable)
    with open(build.partial / CONVERSATIONS, "w", encoding="utf-8") as out:
        for p, a in zip(prompts, answers):
            reason = verdict(a, cfg.replay.max_repeats)
            rows.append({"source": p["source"], "answer": a["text"], "new_tokens": a["new_tokens"],
                         "kept": reason is None, "reason": reason})
            if reason is None:
                messages = [*p["prompt"], {"role": "assistant", "content": a["text"].strip()}]
                out.write(json.dumps({"messages": messages}, ensure_ascii=False) + "\n")
            else:
                dropped[reason] += 1
    with open(build.partial / "answers.jsonl", "w", encoding="utf-8") as f:
        for r in [*rows, *unreadable]:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    kept = sum(r["kept"] for r in rows)
    if kept == 0:
        raise ReplayFailed(f"replay: every answer was dropped ({dict(dropped)}); see {build.partial / 'answers.jsonl'}")
    on_line(f"replay: kept {kept} of {len(rows) + len(unreadable)} answers; dropped "
            + ", ".join(f"{k} {v}" for k, v in dropped.items()))
    metrics = {"prompts": len(rows) + len(unreadable), "kept": kept, **{f"dropped_{k}": v for k, v in dropped.items()}}
    build.commit({"metrics": metrics, "model_path": model_path, "conversations": CONVERSATIONS,
                  "prompt_files": [str(p) for p in cfg.inputs()[REPLAY_PROMPTS]]})
    return metrics


def conversations_file(folder: str | Path) -> str:
    """The replay folder's training rows (data.mix.replay)."""
    return str(Path(folder) / CONVERSATIONS)
