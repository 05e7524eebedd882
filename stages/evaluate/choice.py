"""Log-likelihood multiple choice, scored the way lm-evaluation-harness scores ARC/MMLU: no
generation; the model's pick is the option it finds most likely after the prompt.

Tokenization (one definition, used for every model):
  * context = `tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)`, as
    `stages.inference.generation.generate` renders prompts; context ids = `tok(context,
    add_special_tokens=False).input_ids` (whatever BOS the template writes is kept, none is added);
  * option ids = `tok(option, add_special_tokens=False).input_ids`, tokenized on its own, with no
    leading space added: after a chat template's generation prompt the reply starts fresh;
  * sequence = context ids + option ids. An option that tokenizes to no tokens is a ValueError.
The option's log-likelihood is sum_t log_softmax(logits[t-1])[id_t] over the option's positions t,
in float32 (whatever the model's dtype).

One prompt forward per item (`_logprobs_shared_prompt`): the context ids but the last run once, in
batches of `batch_size` items, right-padded with an attention mask; each option then runs as
[last context id] + option ids from a copy of its item's KV cache, at positions len(context) - 1...,
in batches of `batch_size` option rows. Token ids and positions are exactly the sequence's, so the
log-likelihoods are those of one forward of context + option, up to float rounding (tests: 1e-5, or
2e-6 relative). Real tokens keep positions 0..n-1 and never see a pad. A model whose forward does
not take a cache and position ids, whose class is not Transformers' own (remote code, a worker's
own model), or whose cache is not a plain DynamicCache (sliding-window, linear-attention layers),
and any call with a one-token context, take one forward of context + option per option instead
(`_logprobs_one_pass_per_option`, the code before; `share_prompts=False` forces it).

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

import inspect

import torch

from stages.core.stats.scores import counted
from stages.runtime.batches import pad_token_id
from stages.runtime.distributed import add_up, gather, rank_slice

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


def _shares_prompts(model) -> bool:
    """Whether `model` takes the shared-prompt path: a Transformers class of Transformers' own (not
    remote code, not a worker's own module) whose forward takes a cache and position ids."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is a dependency
        return False
    if not isinstance(model, PreTrainedModel) or not type(model).__module__.startswith("transformers."):
        return False
    params = inspect.signature(model.forward).parameters
    return _cache_arg(model) is not None and all(p in params for p in ("attention_mask", "position_ids"))


def _cache_arg(model) -> str | None:
    """The forward's name for a KV cache: `cache` (Transformers >= 5.2x) or `past_key_values`."""
    params = inspect.signature(model.forward).parameters
    return next((name for name in ("cache", "past_key_values") if name in params), None)


def _logprobs_shared_prompt(model, encoded, batch_size: int, pad_id: int, device) -> list[list[float]] | None:
    """Option log-likelihoods with one forward per prompt: the prefix `context[:-1]` of up to
    `batch_size` items runs once, right-padded, and its KV cache (a DynamicCache) is copied to each
    option row, which then runs `[context[-1]] + option ids` at positions len(prefix)... The token
    ids and their positions are exactly the one-pass sequence's (context ids + option ids), so
    every logit is the same up to float rounding. Option rows run in batches of `batch_size`, each
    with the cache of its own item selected (cut to the longest prefix among them); pads left in a
    shorter prefix sit between it and the option and are masked out.
    None when the model's cache is not a plain DynamicCache (sliding window, linear attention, ...):
    the caller then scores everything the one-pass way."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer
    cache_arg = _cache_arg(model)
    keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    sums = [[0.0] * len(opts) for _, opts in encoded]
    items = sorted(range(len(encoded)), key=lambda i: -len(encoded[i][0]))  # longest prompt first
    for b in range(0, len(items), batch_size):
        batch = items[b:b + batch_size]
        prefixes = [encoded[i][0][:-1] for i in batch]
        width = max(len(p) for p in prefixes)
        input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        prefix_mask = torch.zeros((len(batch), width), dtype=torch.long)
        for r, p in enumerate(prefixes):
            input_ids[r, :len(p)] = torch.tensor(p, dtype=torch.long)
            prefix_mask[r, :len(p)] = 1
        prefix_mask = prefix_mask.to(device)
        out = model(input_ids=input_ids.to(device), attention_mask=prefix_mask, use_cache=True, **keep)
        cache = getattr(out, "cache", None) if cache_arg == "cache" else getattr(out, "past_key_values", None)
        del out
        layers = getattr(cache, "layers", None)
        if type(cache) is not DynamicCache or not layers or any(
                type(layer) is not DynamicLayer or not isinstance(getattr(layer, "keys", None), torch.Tensor)
                or layer.keys.dim() != 4 or layer.keys.shape[0] != len(batch) or layer.keys.shape[-2] != width
                for layer in layers):
            return None
        kv = [(layer.keys, layer.values) for layer in layers]
        del cache, layers
        # (row of this prompt batch, item, option), longest option first
        rows = sorted(((r, i, j) for r, i in enumerate(batch) for j in range(len(encoded[i][1]))),
                      key=lambda x: -len(encoded[x[1]][1][x[2]]))
        for c in range(0, len(rows), batch_size):
            part = rows[c:c + batch_size]
            src = torch.tensor([r for r, _, _ in part], dtype=torch.long, device=device)
            past = max(len(prefixes[r]) for r, _, _ in part)
            cont = max(1 + len(encoded[i][1][j]) for _, i, j in part)
            ids = torch.full((len(part), cont), pad_id, dtype=torch.long)
            mask = torch.zeros((len(part), cont), dtype=torch.long)
            pos = torch.zeros((len(part), cont), dtype=torch.long)
            for q, (r, i, j) in enumerate(part):
                seq = [encoded[i][0][-1]] + encoded[i][1][j]
                ids[q, :len(seq)] = torch.tensor(seq, dtype=torch.long)
                mask[q, :len(seq)] = 1
                pos[q] = torch.arange(len(prefixes[r]), len(prefixes[r]) + cont)
            rows_cache = DynamicCache(ddp_cache_data=[(k.index_select(0, src)[:, :, :past],
                                                       v.index_select(0, src)[:, :, :past]) for k, v in kv])
            full_mask = torch.cat([prefix_mask.index_select(0, src)[:, :past], mask.to(device)], dim=1)
            logits = model(input_ids=ids.to(device), attention_mask=full_mask, position_ids=pos.to(device),
                           use_cache=True, **{cache_arg: rows_cache}).logits
            for q, (_, i, j) in enumerate(part):
                opt = encoded[i][1][j]  # logits at q's position t predict option token t
                lp = torch.log_softmax(logits[q, :len(opt)].float(), dim=-1)
                target = torch.tensor(opt, dtype=torch.long, device=lp.device)
                sums[i][j] = float(lp.gather(-1, target[:, None]).sum())
            del logits, rows_cache
    return sums


def _logprobs_one_pass_per_option(model, encoded, batch_size: int, pad_id: int, device) -> list[list[float]]:
    """Option log-likelihoods with one forward of context ids + option ids per option (the path for
    models without a cache the shared-prompt path can use)."""
    # one entry per (row, option): (row, option, context ids, option ids)
    seqs = [(i, j, ctx, ids) for i, (ctx, opts) in enumerate(encoded) for j, ids in enumerate(opts)]
    # longest first: batches of similar lengths pad little (the result does not depend on the order)
    order = sorted(range(len(seqs)), key=lambda k: -(len(seqs[k][2]) + len(seqs[k][3])))
    sums = [[0.0] * len(opts) for _, opts in encoded]
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
        for r, (i, j, ctx, ids) in enumerate(chunk):
            start = len(ctx) - 1  # logits at t-1 predict token t; option tokens sit at len(ctx)...
            lp = torch.log_softmax(logits[r, start:start + len(ids)].float(), dim=-1)
            target = torch.tensor(ids, dtype=torch.long, device=lp.device)
            sums[i][j] = float(lp.gather(-1, target[:, None]).sum())
    return sums


@torch.no_grad()
def option_logprobs(model, tok, prompts: list[list[dict]], options: list[list[str]], batch_size: int, *,
                    first_row: int = 0, share_prompts: bool = True) -> list[list[tuple[float, int, int]]]:
    """For each prompt and each of its options: (sum of the option tokens' log-probs given the
    rendered prompt, number of option tokens, option length in UTF-8 bytes). See the module doc for
    the tokenization. `first_row` only numbers rows in error messages (row = first_row + index).
    `share_prompts=False` forces one forward per option (the bench's baseline)."""
    if batch_size < 1:
        raise ValueError(f"option_logprobs: batch_size must be >= 1, got {batch_size}")
    encoded = _encode(tok, prompts, options, first_row)
    pad_id = pad_token_id(tok)
    device = _device(model)
    sums = None
    if share_prompts and encoded and all(len(ctx) >= 2 for ctx, _ in encoded) and _shares_prompts(model):
        sums = _logprobs_shared_prompt(model, encoded, batch_size, pad_id, device)
    if sums is None:
        sums = _logprobs_one_pass_per_option(model, encoded, batch_size, pad_id, device)
    return [[(sums[i][j], len(ids), len(options[i][j].encode("utf-8"))) for j, ids in enumerate(opts)]
            for i, (_, opts) in enumerate(encoded)]


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
    metrics = {**counted(total["correct"], total["total"]),
               **{f"accuracy_{rule}": counted(total[f"correct_{rule}"], total["total"])["accuracy"]
                  for rule in NORMALIZATIONS},
               "mode": "choice"}
    return metrics, records
