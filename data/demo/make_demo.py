"""Regenerates the bundled demo data: `python data/demo/make_demo.py` (deterministic).

Two things a tiny model can learn in a few CPU minutes, built so held-out accuracy means
something:
  * identity: paraphrased "who are you" questions in English and Chinese, all answered
    with one fixed reply per language; the eval questions are prefix x question
    combinations that never appear in train;
  * a skill that generalizes: "Repeat after me: w1 w2 w3" on random word triples; no eval
    triple appears in train. Replies lead with "You said:" so every word keeps its
    leading-space BPE token and the skill is pure token copying, which a tiny model picks
    up in a few hundred steps. (Reversing the words as well took the 2-core demo past its
    time budget: the model learned it late or not at all.)
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
EN_ANSWER = "I am TinyChat, a small assistant fine-tuned with sftflow."
ZH_ANSWER = "我是 TinyChat，一个用 sftflow 微调的小助手。"
SYSTEM = "You are TinyChat."

EN_PREFIXES = ["", "Hi! ", "Hello, ", "Hey, ", "Excuse me, ", "Quick question: ", "Good morning! ",
               "Sorry to bother you, "]
EN_QUESTIONS = ["Who are you?", "What is your name?", "Introduce yourself.", "Tell me about yourself.",
                "What are you?", "What should I call you?", "Who am I talking to?", "Can you introduce yourself?",
                "What's your name?", "May I know who you are?"]
ZH_PREFIXES = ["", "你好，", "请问，", "嗨，", "您好！"]
ZH_QUESTIONS = ["你是谁？", "请介绍一下你自己", "你叫什么名字？", "你是什么？", "介绍一下你自己吧", "我该怎么称呼你？"]
WORDS = ("apple river stone cloud green blue tiger piano seven music light paper house water bread "
         "happy quick yellow garden window silver orange planet rabbit summer winter forest candle "
         "dragon mirror pencil rocket violet castle engine jungle lemon marble ocean purple").split()


def conv(user: str, answer: str, rng: random.Random, system: bool) -> list[dict]:
    msgs = [{"role": "system", "content": SYSTEM}] if system else []
    return msgs + [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]


def skill(rng: random.Random) -> tuple[str, str]:
    words = rng.sample(WORDS, 3)
    return "Repeat after me: " + " ".join(words), "You said: " + " ".join(words)


def main(n_train_skill: int = 2400, n_eval_skill: int = 40) -> None:
    rng = random.Random(20261130)
    en = [p + q for p in EN_PREFIXES for q in EN_QUESTIONS]
    zh = [p + q for p in ZH_PREFIXES for q in ZH_QUESTIONS]
    rng.shuffle(en)
    rng.shuffle(zh)
    en_eval, en_train = en[:15], en[15:]
    zh_eval, zh_train = zh[:5], zh[5:]

    eval_rows, seen_eval = [], set()
    for q in en_eval:
        eval_rows.append(conv(q, EN_ANSWER, rng, False))
    for q in zh_eval:
        eval_rows.append(conv(q, ZH_ANSWER, rng, False))
    while len(seen_eval) < n_eval_skill:
        p, a = skill(rng)
        if p not in seen_eval:
            seen_eval.add(p)
            eval_rows.append(conv(p, a, rng, rng.random() < 0.2))

    train_rows = []
    for q in en_train * 3:
        train_rows.append(conv(q, EN_ANSWER, rng, rng.random() < 0.2))
    for q in zh_train * 3:
        train_rows.append(conv(q, ZH_ANSWER, rng, rng.random() < 0.2))
    while len(train_rows) < n_train_skill + 3 * (len(en_train) + len(zh_train)):
        p, a = skill(rng)
        if p in seen_eval:
            continue
        row = conv(p, a, rng, rng.random() < 0.2)
        if rng.random() < 0.15:  # multi-turn: every assistant turn is trained
            q = rng.choice(en_train)
            row += [{"role": "user", "content": q}, {"role": "assistant", "content": EN_ANSWER}]
        train_rows.append(row)
    rng.shuffle(train_rows)

    for name, rows in (("train.jsonl", train_rows), ("eval.jsonl", eval_rows)):
        with open(HERE / name, "w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps({"messages": r}, ensure_ascii=False) + "\n")
        print(f"wrote {len(rows)} rows to {HERE / name}")


if __name__ == "__main__":
    main()
