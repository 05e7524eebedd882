"""Log-likelihood multiple choice, scored the way lm-evaluation-harness scores ARC/MMLU: no
generation; the model's pick is the option it finds most likely after the prompt.

Tokenization (one definition, used for every model):
  * context = `tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)`, as
    `stages.runtime.generation.generate` renders prompts; context ids = `tok(context,
    add_special_tokens=False).input_ids` (whatever BOS the template writes is kept, none is added);
  * option ids = `tok(option, add_special_tokens=False).input_ids`, tokenized on its own, with no
    leading space added: after a chat template's generation prompt the reply starts fresh;
  * sequence = context ids + option ids. An option that tokenizes to no tokens is a ValueError.
The option's log-likelihood is sum_t log_softmax(logits[t-1])[id_t] over the option's positions t,
in float32 (whatever the model's dtype). Sequences run in batches of `batch_size`, right-padded
with an attention mask, so real tokens keep positions 0..n-1 and never see a pad.

Picking, with lm-evaluation-harness' names for the same numbers (its `process_results` for
multiple_choice): rule "sum" takes the option with the highest summed log-likelihood (lm-eval's
`acc`); rule "chars" divides each sum by the option's length in characters, `len(option)`, first
(lm-eval's `acc_norm`); rule "bytes" divides by its length in UTF-8 bytes (lm-eval's `acc_bytes`).
The lengths are the option text's, never its tokens'. Ties go to the lowest option index. All three
accuracies are reported (`accuracy_sum`, `accuracy_chars`, `accuracy_bytes`); `accuracy` is the one
`normalize` names.

One difference in the raw log-likelihoods: lm-eval moves a context's trailing whitespace into the
continuation (`_encode_pair`), so after a generation prompt that ends in a newline it scores that
newline with each option. When the newline is a token of its own, that adds log p(newline | prompt)
to every option of an item alike: `acc` picks the same option; the normalized rules divide that
constant by different lengths, so their picks can differ from lm-eval's in near-ties.

Exactness across processes, as in runner.py: rank r of W scores the contiguous slice
`rank_slice(n, r, W)`; records and counts are gathered in rank order (= the original order) and
added up, so counts, picks and records do not depend on the world size (the log-likelihoods can
differ by float rounding between batch compositions, far below any realistic margin).
"""

from __future__ import annotations

import torch

from stages.runtime.distributed import add_up, gather

NORMALIZATIONS = ("sum", "chars", "bytes")  # lm-eval: acc, acc_norm, acc_bytes


def _encode(tok, prompts: list[list[dict]], options: list[list[str]], first_row: int):
    """[(context ids, [option ids, ...]), ...]; ValueError for an option with no tokens."""
    if len(prompts) != len(options):
        raise ValueError(f"option_logprobs: {len(prompts)} prompts but {len(options)} option lists")
    out = []
    for i, (prompt, opts) in enumerate(zip(prompts, options)):
        row = first_row + i
        ctx = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
        ctx_ids = list(tok(ctx, add_special_tokens=False).input_ids)
        if not ctx_ids:
            raise ValueError(f"row {row}: the rendered prompt has no tokens")
        opt_ids = []
        for j, opt in enumerate(opts):
            if not isinstance(opt, str):
                raise ValueError(f"row {row}: choice {j} is {type(opt).__name__}, not a string")
            ids = list(tok(opt, add_special_tokens=False).input_ids)
            if not ids:
                raise ValueError(f"row {row}: choice {j} ({opt!r}) tokenizes to no tokens")
            opt_ids.append(ids)
        out.append((ctx_ids, opt_ids))
    return out


def _device(model) -> torch.device:
    dev = getattr(model, "device", None)
    return dev if isinstance(dev, torch.device) else next(model.parameters()).device


@torch.no_grad()
def option_logprobs(model, tok, prompts: list[list[dict]], options: list[list[str]], batch_size: int, *,
                    first_row: int = 0) -> list[list[tuple[float, int, int]]]:
    """For each prompt and each of its options: (sum of the option tokens' log-probs given the
    rendered prompt, number of option tokens, option length in UTF-8 bytes). See the module doc for
    the tokenization. `first_row` only numbers rows in error messages (row = first_row + index)."""
    if batch_size < 1:
        raise ValueError(f"option_logprobs: batch_size must be >= 1, got {batch_size}")
    encoded = _encode(tok, prompts, options, first_row)
    # one entry per (row, option): (row, option, context ids, option ids)
    seqs = [(i, j, ctx, ids) for i, (ctx, opts) in enumerate(encoded) for j, ids in enumerate(opts)]
    # longest first: batches of similar lengths pad little (the result does not depend on the order)
    order = sorted(range(len(seqs)), key=lambda k: -(len(seqs[k][2]) + len(seqs[k][3])))
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    pad_id = 0 if pad_id is None else pad_id
    device = _device(model)
    sums: list[float] = [0.0] * len(seqs)
    for b in range(0, len(order), batch_size):
        chunk = [seqs[k] for k in order[b:b + batch_size]]
        width = max(len(ctx) + len(ids) for _, _, ctx, ids in chunk)
        input_ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for r, (_, _, ctx, ids) in enumerate(chunk):
            n = len(ctx) + len(ids)
            input_ids[r, :n] = torch.tensor(ctx + ids, dtype=torch.long)
            mask[r, :n] = 1
        logits = model(input_ids=input_ids.to(device), attention_mask=mask.to(device), use_cache=False).logits
        for r, (_, _, ctx, ids) in enumerate(chunk):
            start = len(ctx) - 1  # logits at t-1 predict token t; option tokens sit at len(ctx)...
            lp = torch.log_softmax(logits[r, start:start + len(ids)].float(), dim=-1)
            target = torch.tensor(ids, dtype=torch.long, device=lp.device)
            sums[order[b + r]] = float(lp.gather(-1, target[:, None]).sum())
    out: list[list[tuple[float, int, int]]] = [[] for _ in prompts]
    for k, (i, j, _, ids) in enumerate(seqs):
        out[i].append((sums[k], len(ids), len(options[i][j].encode("utf-8"))))
    return out


def pick(scores: list[float]) -> int:
    """Index of the highest score; ties go to the lowest index."""
    best = 0
    for k, s in enumerate(scores):
        if s > scores[best]:
            best = k
    return best


def _check_row(row: dict, index: int) -> None:
    choices, answer = row.get("choices"), row.get("answer")
    if not isinstance(choices, list) or not choices:
        raise ValueError(f"row {index}: 'choices' must be a non-empty list of strings, got {choices!r}")
    if isinstance(answer, bool) or not isinstance(answer, int) or not 0 <= answer < len(choices):
        raise ValueError(f"row {index}: 'answer' must be an option index in 0..{len(choices) - 1}, got {answer!r}")


def choice_scores(model, tok, rows: list[dict], rank: int, world: int, batch_size: int, normalize: str = "sum",
                  set_name: str | None = None) -> tuple[dict, list[dict]]:
    """Multiple-choice accuracy on this rank's slice, gathered and summed over ranks (as
    runner.generation_scores). Rows: `prompt` (chat messages), `choices` (list of strings),
    `answer` (index of the right choice), `source`, `reference`. `normalize`: "sum", "chars" or
    "bytes" decides `accuracy` and each record's `logprobs`/`picked`; all three accuracies are
    reported."""
    if normalize not in NORMALIZATIONS:
        raise ValueError(f"choice_scores: normalize must be one of {NORMALIZATIONS}, got {normalize!r}")
    from .runner import rank_slice  # here, not at the top: runner may import this module
    r = rank_slice(len(rows), rank, world)
    mine = rows[r.start:r.stop]
    for k, s in enumerate(mine):
        _check_row(s, r.start + k)
    lps = option_logprobs(model, tok, [s["prompt"] for s in mine], [s["choices"] for s in mine], batch_size,
                          first_row=r.start)
    records = []
    sums = {"correct": 0, **{f"correct_{rule}": 0 for rule in NORMALIZATIONS}, "total": 0}
    for s, opts in zip(mine, lps):
        scores = {"sum": [lp for lp, _, _ in opts],
                  "chars": [lp / len(text) for (lp, _, _), text in zip(opts, s["choices"])],
                  "bytes": [lp / nbytes for lp, _, nbytes in opts]}
        picks = {rule: pick(v) for rule, v in scores.items()}
        used, picked = scores[normalize], picks[normalize]
        correct = picked == s["answer"]
        records.append({**({"set": set_name} if set_name is not None else {}), "source": s["source"],
                        "prompt": s["prompt"], "reference": s["reference"], "choices": s["choices"],
                        "answer": s["answer"], "prediction": s["choices"][picked], "picked": picked,
                        "correct": correct, "logprobs": used})
        sums["correct"] += int(correct)
        for rule, p in picks.items():
            sums[f"correct_{rule}"] += int(p == s["answer"])
        sums["total"] += 1
    parts = gather({"records": records, "sums": sums})
    records = [x for part in parts for x in part["records"]]  # rank order = the original order
    total = add_up([part["sums"] for part in parts])
    n = total["total"]
    metrics = {"accuracy": total["correct"] / n if n else 0.0, "correct": int(total["correct"]), "total": int(n),
               **{f"accuracy_{rule}": total[f"correct_{rule}"] / n if n else 0.0 for rule in NORMALIZATIONS},
               "mode": "choice"}
    return metrics, records
