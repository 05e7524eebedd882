"""Batched greedy generation for a Hugging Face chat model (evaluate, `sftflow chat`, and the
registered pyfunc model, which ships this file as its code: torch and transformers only).

Replies are those of one `model.generate` per prompt (greedy). The decode loop is our own because
of where `generate` per left-padded batch spent its time (docs/benchmarks.md, "Generation: where
the time goes"): every row decoded until its batch's longest reply ended (29% of the decode
row-steps on the quickstart's retention set were on finished rows) and the system prompt every row
shares was prefilled again for each (58% of the prefill tokens). Here a row leaves the batch at its
stop token and, while prompts are waiting, freed slots are refilled (continuous batching), and the
shared prefix is computed once, on models whose KV cache is plain full attention; sliding-window
caches keep fixed batches, without their finished rows. A generation config that changes greedy
decoding's logits (repetition penalty, minimum length, ...) or a model without the cache API goes
through `model.generate` per batch, as before.
"""

from __future__ import annotations

import inspect

import torch

try:  # inside the project
    from stages.core.chat.chat_tokens import stop_token_ids
    from stages.core.machine.bf16_speed import dims_of
    from stages.core.machine.precision import on_device as resolve_precision
    from stages.inference.weights import config_folder, load_merged
except ImportError:  # inside a logged model: these files ship beside this one (register's code_paths)
    from chat_tokens import stop_token_ids
    from bf16_speed import dims_of
    from precision import on_device as resolve_precision
    from weights import config_folder, load_merged

# Generation-config fields that make greedy `generate` differ from the argmax of the last logits,
# with the value that changes nothing; our loop applies none of them, so any other value means
# `model.generate` decodes.
_NEUTRAL = {"repetition_penalty": (None, 1.0), "encoder_repetition_penalty": (None, 1.0),
            "no_repeat_ngram_size": (None, 0), "encoder_no_repeat_ngram_size": (None, 0),
            "bad_words_ids": (None,), "min_length": (None, 0), "min_new_tokens": (None, 0),
            "suppress_tokens": (None,), "begin_suppress_tokens": (None,), "forced_bos_token_id": (None,),
            "forced_eos_token_id": (None,), "sequence_bias": (None,), "exponential_decay_length_penalty": (None,),
            "renormalize_logits": (None, False), "guidance_scale": (None, 1.0), "watermarking_config": (None,),
            "diversity_penalty": (None, 0.0), "num_beams": (None, 1), "assistant_model": (None,),
            "prompt_lookup_num_tokens": (None,), "max_length_penalty": (None,)}

# Refill a running batch once this share of its slots is free: each refill is one prefill forward,
# so refilling a single slot at a time costs a forward per reply.
REFILL_SHARE = 0.25
# A prefix every prompt shares (the template's system prompt) is computed once when at least this long.
MIN_SHARED = 4


def load(model_dir: str, trust_remote_code: bool = False, device: str | None = None, precision: str = "auto",
         key: str = "actor.precision", roots=()):
    """(model, tokenizer) on `device` in `precision` as `key` (replay, chat and the registered model: the
    config's `actor.precision`) resolves there (the one rule, core/machine/precision.py: `auto` is bf16 on
    a GPU that computes it natively, or a CPU where it measured faster at this model's shapes).
    `model.sftflow_precision` says which ran. A LoRA folder (adapter + base.json) loads merged
    (inference/weights.py; `roots`: artifacts folders whose bases/ may hold its base)."""
    from transformers import AutoTokenizer
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    tok = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    chosen = resolve_precision(precision, device, dims_of(config_folder(model_dir, roots)), key)
    dtype = torch.bfloat16 if chosen == "bf16" else torch.float32
    model = load_merged(model_dir, trust_remote_code, dtype, roots).to(device)
    model.eval()
    model.sftflow_precision = chosen
    return model, tok


def stop_ids(model, tok) -> list[int]:
    """The ids a reply stops at (core/chat/chat_tokens.py), the loaded model's generation config read."""
    return stop_token_ids(tok, getattr(model.generation_config, "eos_token_id", None))


def _reply(tok, ids: list[int], stops) -> dict:
    n = next((k for k, t in enumerate(ids) if t in stops), len(ids))
    return {"text": tok.decode(ids[:n], skip_special_tokens=True), "new_tokens": n, "stopped": n < len(ids)}


@torch.no_grad()
def generate(model, tok, prompts: list[list[dict]], max_new_tokens: int, batch_size: int,
             loop: str = "auto", fp32_head: bool = True) -> list[dict]:
    """Greedy replies for chat prompts, in their order; special tokens stripped.

    Each reply ends at its first stop token (eos or the template's end-of-turn marker), which is
    neither decoded nor counted: `new_tokens` is the reply's length in tokens. At most
    `batch_size` prompts decode together. `loop`: "auto" (ours where it applies), "generate"
    (`model.generate` per left-padded batch in the input order: the former path, kept to compare).
    A bf16 or fp16 model picks each token with its output head in fp32 (`Fp32Head`; `fp32_head=False`:
    the model's own logits, to measure what that rule changes)."""
    if not prompts:
        return []
    tok.padding_side = "left"
    if tok.pad_token is None:  # Llama-3, Mistral: no pad token; left pads are masked out anyway
        tok.pad_token = tok.eos_token
    stops = stop_ids(model, tok)
    texts = [tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
    if loop == "generate" or max_new_tokens < 1 or not _own_loop_applies(model):
        return _with_generate(model, tok, texts, stops, max_new_tokens, batch_size)
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    head = Fp32Head.of(model) if fp32_head else None
    tokens = _decode(model, ids, set(stops), max_new_tokens, max(1, batch_size), head)
    return [_reply(tok, t, stops) for t in tokens]


def _with_generate(model, tok, texts, stops, max_new_tokens, batch_size) -> list[dict]:
    out = []
    for i in range(0, len(texts), batch_size):
        enc = tok(texts[i:i + batch_size], add_special_tokens=False, padding=True, return_tensors="pt").to(model.device)
        gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=stops,
                             pad_token_id=tok.pad_token_id, use_cache=True)
        out += [_reply(tok, row.tolist(), stops) for row in gen[:, enc["input_ids"].shape[1]:]]
    return out


def _cache_name(model) -> str | None:
    """The name `model.forward` takes a KV cache by, for a decoder our loop can drive (positions and
    a mask as inputs); None otherwise (an encoder-decoder, a custom model without a config)."""
    params = inspect.signature(model.forward).parameters
    config = getattr(model, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        return None
    if not {"position_ids", "attention_mask"} <= set(params):
        return None
    return "cache" if "cache" in params else "past_key_values" if "past_key_values" in params else None


def _own_loop_applies(model) -> bool:
    if _cache_name(model) is None:
        return False
    gc = getattr(model, "generation_config", None)
    return gc is None or all(getattr(gc, k, None) in ok for k, ok in _NEUTRAL.items())


def _new_cache(model):
    from transformers import DynamicCache
    return DynamicCache(config=model.config.get_text_config(decoder=True))


class Fp32Head:
    """The argmax of the next token with the output head computed in fp32, for a model that computes
    in bf16 or fp16: its decoder body runs as it is, and the last hidden state goes through an fp32
    copy of the head's weights. bf16 logits hold 8 significant bits (0.125 apart near 20), so a
    reduced-precision head makes exact ties common, broken by the rounding of whichever batch the row
    decoded in. On the SmolLM2 quickstart this narrows bf16's differing replies between batch sizes
    from 42-47% to 37-39%; it does not make bf16 agree, fp32 does (docs/evaluation.md, "Replies, batch
    size and precision").
    The model's own post-head transforms (Gemma2's soft cap, Cohere's logit scale) are monotone and
    leave the argmax alone. `of(model)` is None where it does not apply: an fp32 model (its head
    is fp32 already) or a model without the decoder/head split."""

    def __init__(self, body, head: torch.nn.Linear):
        self.body = body
        self.cache_name = _cache_name(body)
        self.weight = head.weight.detach().float()
        self.bias = None if head.bias is None else head.bias.detach().float()

    @classmethod
    def of(cls, model, fp32_too: bool = False) -> "Fp32Head | None":
        """The head split from `model`'s body; None for an fp32 model (unless `fp32_too`: tests) or
        where the split is not there."""
        if next(model.parameters()).dtype == torch.float32 and not fp32_too:
            return None
        get_body, get_head = getattr(model, "get_decoder", None), getattr(model, "get_output_embeddings", None)
        body, head = (get_body() if get_body else None), (get_head() if get_head else None)
        if body is None or body is model:  # transformers 4.x: get_decoder() is None or the model itself
            body = getattr(model, "base_model", None)
        if body is None or body is model or not isinstance(head, torch.nn.Linear):
            return None
        params = inspect.signature(body.forward).parameters
        if not {"input_ids", "attention_mask", "position_ids"} <= set(params) or _cache_name(body) is None:
            return None
        return cls(body, head)

    def argmax(self, cache, ids, mask, pos) -> torch.Tensor:
        out = self.body(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                        **{self.cache_name: cache})
        last = out.last_hidden_state[:, -1].float()
        return torch.nn.functional.linear(last, self.weight, self.bias).argmax(-1)


def _forward(model, cache, ids, mask, pos, head: Fp32Head | None = None):
    """One forward of `ids` [rows, n] after `cache`; the argmax of each row's last logits (through
    `head` when given)."""
    if head is not None:
        return head.argmax(cache, ids, mask, pos)
    kw = {_cache_name(model): cache}
    # the last position's logits only, as `generate` asks
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        kw["logits_to_keep"] = 1
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **kw)
    return out.logits[:, -1, :].float().argmax(-1)


def _prefill(model, rows: list[list[int]], prefix=None, head: Fp32Head | None = None):
    """Left-padded prefill of `rows` in a fresh cache: (cache, 2D mask, next tokens, last positions).
    Positions count real tokens (`generate`'s cumsum of the mask); a batch without padding passes
    no mask, as `generate` drops an all-ones one. `prefix`: (its cache, its length P), the first P
    tokens of every row, already computed once: its keys and values are every row's first P
    (they depend on those tokens only), the rest follows after the pads."""
    dev = model.device
    start = prefix[1] if prefix else 0
    tails = [r[start:] for r in rows]
    width = max(len(t) for t in tails)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.ones((len(rows), start + width), dtype=torch.long)
    for i, t in enumerate(tails):
        ids[i, width - len(t):] = torch.tensor(t)
        mask[i, start:start + width - len(t)] = 0
    ids, mask = ids.to(dev), mask.to(dev)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = prefix_cache(model, prefix, len(rows)) if prefix else _new_cache(model)
    nxt = _forward(model, cache, ids, None if bool(mask.all()) else mask, pos[:, start:], head)
    return cache, mask, nxt, pos[:, -1]


def shared_prefix(model, prompts: list[list[int]], limit: int | None = None):
    """The tokens every prompt starts with (a chat template's system prompt), computed once: (cache, P),
    or None when there is nothing worth sharing. Each prompt keeps at least its last token to feed;
    `limit` caps P (the teacher-forced loss keeps every trained token's predecessor out of it)."""
    if len(prompts) < 2:
        return None
    first, n = prompts[0], min(len(p) for p in prompts) - 1
    if limit is not None:
        n = min(n, limit)
    common = next((k for k in range(n) if any(p[k] != first[k] for p in prompts)), n)
    if common < MIN_SHARED:
        return None
    cache = _new_cache(model)
    ids = torch.tensor([first[:common]], device=model.device)
    _forward(model, cache, ids, None, torch.arange(common, device=model.device)[None])
    return cache, common


def prefix_cache(model, prefix, rows: int):
    """A fresh cache whose first P columns are `prefix`'s, for `rows` rows: its keys and values are
    every row's (they depend on those tokens only), shared by view, not copied."""
    cache = _new_cache(model)
    for layer, shared in zip(cache.layers, prefix[0].layers):
        _init_layer(layer, shared.keys, shared.values)
        layer.keys = shared.keys.expand(rows, -1, -1, -1)
        layer.values = shared.values.expand(rows, -1, -1, -1)
    return cache


def _init_layer(layer, keys, values) -> None:
    """`layer.lazy_initialization` (dtype, device, empty tensors) as this transformers declares it: it
    takes the keys and the values since v5, the keys alone in 4.56-4.57."""
    if len(inspect.signature(layer.lazy_initialization).parameters) >= 2:
        layer.lazy_initialization(keys, values)
    else:
        layer.lazy_initialization(keys)


def cache_argument(model) -> str | None:
    """The name `model.forward` takes a KV cache by, when a prefix can be shared with it: a decoder
    with positions, a mask and plain full-attention cache layers (a sliding window counts slots)."""
    name = _cache_name(model)
    try:
        return name if name and _plain_layers(_new_cache(model)) else None
    except (AttributeError, TypeError, ValueError):  # no text config a cache can be built from
        return None


def _plain_layers(cache) -> bool:
    from transformers.cache_utils import DynamicLayer
    return all(type(layer) is DynamicLayer for layer in cache.layers)


def _left_pad(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    if t.shape[dim] == width:
        return t
    shape = list(t.shape)
    shape[dim] = width - t.shape[dim]
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def _merge(cache, mask, other, other_mask):
    """Rows of `other` appended to `cache` (plain full-attention layers): both left-padded to one
    length; the pads are masked, so no row attends to them."""
    width = max(mask.shape[1], other_mask.shape[1])
    for a, b in zip(cache.layers, other.layers):
        a.keys = torch.cat([_left_pad(a.keys, width, 2), _left_pad(b.keys, width, 2)])
        a.values = torch.cat([_left_pad(a.values, width, 2), _left_pad(b.values, width, 2)])
    return torch.cat([_left_pad(mask, width, 1), _left_pad(other_mask, width, 1)])


def _trim(cache, mask):
    """Drop leading columns no remaining row attends to (left by rows that left)."""
    first = int(mask.any(0).long().argmax())
    if first == 0:
        return mask
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys[:, :, first:], layer.values[:, :, first:]
    return mask[:, first:]


class _Running:
    """The batch decoding now: its cache, the 2D mask over the cache's columns, the prompts' indices
    (`rows`), each row's last token and position."""

    def __init__(self, cache, mask, rows: list[int], last, pos):
        self.cache, self.mask, self.rows, self.last, self.pos = cache, mask, rows, last, pos

    def keep(self, keep: list[int], trim: bool) -> None:
        """Only the rows at positions `keep` go on; with `trim`, the cache columns none of them
        attends to go (plain full-attention layers only)."""
        if len(keep) < len(self.rows):
            idx = torch.tensor(keep, device=self.mask.device)
            self.cache.batch_select_indices(idx)
            self.mask, self.last, self.pos = self.mask[idx], self.last[idx], self.pos[idx]
            self.rows = [self.rows[k] for k in keep]
        if trim:
            self.mask = _trim(self.cache, self.mask)

    def join(self, other: "_Running") -> None:
        self.mask = _merge(self.cache, self.mask, other.cache, other.mask)
        self.rows = self.rows + other.rows
        self.last, self.pos = torch.cat([self.last, other.last]), torch.cat([self.pos, other.pos])


def _decode(model, prompts: list[list[int]], stops: set[int], max_new_tokens: int,
            batch_size: int, head: Fp32Head | None = None) -> list[list[int]]:
    """Greedy tokens per prompt (up to and including its stop token); `head`: the argmax through it."""
    # shortest prompts first: a prefill pads its rows to the longest, so similar lengths pad least
    queue = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[list[int]] = [[] for _ in prompts]
    refill = max(1, int(batch_size * REFILL_SHARE))

    def going_on(rows: list[int], tokens) -> list[int]:
        """Appends each row's token; the positions of the rows still decoding."""
        keep = []
        for k, (i, t) in enumerate(zip(rows, tokens.tolist())):
            out[i].append(t)
            if t not in stops and len(out[i]) < max_new_tokens:
                keep.append(k)
        return keep

    # plain full-attention layers: rows join a running batch, pads in the middle of a row are masked;
    # a sliding window counts cache slots, so there rows only leave, and nothing is shared
    continuous = _plain_layers(_new_cache(model))
    prefix = shared_prefix(model, prompts) if continuous else None
    batch: _Running | None = None
    while queue or batch is not None:
        free = batch_size - (len(batch.rows) if batch else 0)
        if batch is None or (continuous and queue and free >= refill):
            take, queue = queue[:free], queue[free:]
            cache, mask, last, pos = _prefill(model, [prompts[i] for i in take], prefix, head)
            new = _Running(cache, mask, take, last, pos)
            keep = going_on(take, last)
            if keep:
                new.keep(keep, trim=continuous and batch is None)
                if batch is None:
                    batch = new
                else:
                    batch.join(new)
            continue
        batch.mask = torch.cat([batch.mask, batch.mask.new_ones((len(batch.rows), 1))], dim=1)
        batch.pos = batch.pos + 1
        batch.last = _forward(model, batch.cache, batch.last[:, None],
                              None if bool(batch.mask.all()) else batch.mask, batch.pos[:, None], head)
        keep = going_on(batch.rows, batch.last)
        if keep:
            batch.keep(keep, trim=continuous and len(keep) < len(batch.rows))
        else:
            batch = None
    return out
