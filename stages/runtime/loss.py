"""The token loss every stage agrees on: summed next-token cross-entropy over trainable tokens
(`actor.loss: dft` weights each token's by its own detached probability), with, for
`actor.kl_to_base`, the KL to a reference model over the same tokens.

Sums, not means, so micro-batches and ranks add up exactly and the caller divides once.

Where the output head and the loss run (`model_loss`): a Hugging Face causal LM computes logits
for every position, T x vocab, and their fp32 loss with its gradients is the largest transient of
a step (about 7 GB for 4096 tokens of a 150k vocabulary). Here the model's forward runs as usual up
to its output head, which is fed each row's last position only; the head's whole input (the final
hidden states) is kept, the rows whose next token is trained are gathered, and the model's own head
module (`get_output_embeddings()`: tied or not, peft's LoRA wrapper when the head is targeted) and
its output transform (gemma's final-logit softcapping, cohere's `logit_scale`, granite's
`logits_scaling`) are applied to `LOSS_CHUNK` of them at a time, each chunk checkpointed when there
are several, so backward recomputes one chunk's logits at a time instead of keeping all of them.
This happens inside the model's forward (a forward hook on the model), where FSDP2 holds the
head's weights gathered, and the sums are returned through the model's output, so FSDP2's
pre-backward hook gathers the weights again before backward reaches them.

The transform is checked on every forward: the model's own logits of the last positions (which
its forward still computes) must equal the transform applied to what the head returned for them.
A model without an output head, one whose head runs other than once on (rows, positions, hidden),
or one whose logits are not a transform this module knows, takes the full-logits path (the same
arithmetic on `model(...).logits`), decided once per model on its first batch and logged.
"""

from __future__ import annotations

import copy
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100
# Trained positions per head + loss chunk: one chunk's fp32 logits and their gradients are the loss'
# whole transient (1024 x 150k vocabulary x 4 bytes = 0.6 GB each). stages/planning/memory_plan.py
# counts the same number (tests/test_memory_plan.py holds them equal).
LOSS_CHUNK = 1024


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(sum of cross-entropy over the trainable tokens, their number); `labels` are unshifted
    (position t predicts labels[t+1]) with IGNORE_INDEX where nothing is trained. Sums, not means,
    so micro-batches and ranks add up exactly and the caller divides once."""
    labels = labels[:, 1:]
    loss_sum = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.size(-1)), labels.reshape(-1),
                               ignore_index=IGNORE_INDEX, reduction="sum")
    return loss_sum, int((labels != IGNORE_INDEX).sum())


def token_sums(logits: torch.Tensor, targets: torch.Tensor, ref_logits: torch.Tensor | None = None,
               dft: bool = False, kl_weights: torch.Tensor | None = None) -> torch.Tensor:
    """[sum of cross-entropy, sum of DFT's p x cross-entropy, sum of KL(ref || model)] (fp32) over
    the rows of `logits` (positions x vocab, upcast to fp32), whose next tokens are `targets`; with
    `kl_weights` (one per row) the KL of each row counts that much.

    DFT (Dynamic Fine-Tuning, arXiv 2508.05629): each token's cross-entropy weighted by its own
    probability p = exp(-cross-entropy), detached (a constant to the gradient). Zero unless `dft`;
    the KL is zero without `ref_logits`."""
    logp = F.log_softmax(logits.float(), dim=-1)
    ce = F.nll_loss(logp, targets, reduction="none")
    zero = logp.new_zeros(())
    dft_sum = (torch.exp(-ce.detach()) * ce).sum() if dft else zero
    kl = zero
    if ref_logits is not None and kl_weights is None:
        kl = F.kl_div(logp, F.log_softmax(ref_logits.float(), dim=-1), log_target=True, reduction="sum")
    elif ref_logits is not None:  # per position: the rows the KL holds (Reference.weights)
        per = F.kl_div(logp, F.log_softmax(ref_logits.float(), dim=-1), log_target=True, reduction="none").sum(-1)
        kl = (per * kl_weights.to(per.dtype)).sum()
    return torch.stack([ce.sum(), dft_sum, kl])


@dataclass(frozen=True)
class LossSums:
    """A micro-batch's sums over its trained tokens (`model_loss`)."""

    ce: torch.Tensor     # cross-entropy (fp32; attached to the graph under grad)
    n_tokens: int        # how many tokens the sums are over
    dft: torch.Tensor    # p x cross-entropy, p detached (`dft=True`; else zero)
    kl: torch.Tensor     # KL(reference || model) (with a `reference`; else zero)
    correct: int | None  # argmax hits (`accuracy=True`)
    chunked: bool        # the head ran on the trained positions in chunks (else: the full logits)
    hits: torch.Tensor | None = None  # `accuracy=True`: per trained position, in `_gather`'s order, argmax == label


@dataclass(frozen=True)
class Reference:
    """A reference model's next-token predictions at the trained positions, the target of the KL
    (`reference_outputs`): the output head's input rows (the chunked path applies the head to them
    chunk by chunk, with the head's adapters off) or the logits themselves (the full-logits path)."""

    hidden: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    weights: torch.Tensor | None = None  # per trained position: how much its KL counts (None: every one, 1)


# model -> None (the chunked path) or why it takes the full-logits path; decided on its first batch
_VERDICTS: "weakref.WeakKeyDictionary[nn.Module, str | None]" = weakref.WeakKeyDictionary()


def _unwrap(model: nn.Module) -> nn.Module:
    get_base = getattr(model, "get_base_model", None)  # peft
    return get_base() if callable(get_base) else model


def output_head(model: nn.Module) -> tuple[nn.Module | None, str | None]:
    """(the module the model's logits come out of, None), or (None, why there is none to use)."""
    if getattr(model, "_compiled_call_impl", None) is not None or hasattr(model, "_orig_mod"):
        return None, "the model is compiled as a whole"
    get = getattr(_unwrap(model), "get_output_embeddings", None)
    head = get() if callable(get) else None
    if not isinstance(head, nn.Module):
        return None, "it has no output head (get_output_embeddings)"
    return head, None


def output_transform(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """What the causal LM's forward does to its head's output, as its forward does it: gemma's
    final-logit softcapping (cap x tanh(logits / cap)), cohere's `logit_scale` (a product) and
    granite's `logits_scaling` (a division); identity for the rest (llama, qwen, mistral, ...).
    Checked against the model's own logits on every forward (see the module's docstring)."""
    lm = _unwrap(model)
    config = getattr(lm, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    cap = getattr(text, "final_logit_softcapping", None)
    scale = getattr(lm, "logit_scale", None)
    scale = scale if isinstance(scale, (int, float)) and not isinstance(scale, bool) else None
    divide = getattr(text, "logits_scaling", None)
    divide = divide if isinstance(divide, (int, float)) and not isinstance(divide, bool) else None

    def transform(logits: torch.Tensor) -> torch.Tensor:
        if cap is not None:
            logits = logits / cap
            logits = torch.tanh(logits)
            logits = logits * cap
        if scale is not None:
            logits = logits * scale
        if divide is not None:
            logits = logits / divide
        return logits
    return transform


def _same_logits(ours: torch.Tensor, theirs: torch.Tensor) -> bool:
    """Equal, up to a few units in the last place of the coarser dtype (a model may upcast first)."""
    if ours.shape != theirs.shape:
        return False
    if ours.dtype == theirs.dtype and torch.equal(ours, theirs):
        return True
    eps = max(torch.finfo(ours.dtype).eps, torch.finfo(theirs.dtype).eps)
    a, b = ours.float(), theirs.float()
    return bool(((a - b).abs() <= 4 * eps * b.abs().clamp_min(1.0)).all())


@contextmanager
def _tapped(model: nn.Module, head: nn.Module, labels: torch.Tensor,
            compute: Callable[[torch.Tensor], tuple] | None) -> Iterator[dict]:
    """Inside: `model(...)` feeds its output head only each row's last position; the head's whole
    input is `compute`d on inside the forward (where FSDP2 holds the head's weights gathered) and
    the forward returns `(its output, compute's tensors)`, so that FSDP2 gathers the weights again
    before backward reaches them. The dict yielded holds "problem" when the head ran other than
    once on (rows, positions, hidden) = labels' shape, or the logits are no transform of its output
    that `output_transform` knows; then `compute` did not run and the output is the model's own."""
    tap: dict = {"calls": 0}
    transform = output_transform(model)

    def head_pre(mod, args, kwargs):
        tap["calls"] += 1
        if tap["calls"] == 1 and args and torch.is_tensor(args[0]) and args[0].dim() == 3:
            tap["hidden"] = args[0]
            return (args[0][:, -1:], *args[1:]), kwargs
        return None

    def head_post(mod, args, kwargs, output):
        if tap["calls"] == 1:
            tap["head_out"] = output

    def model_post(mod, args, kwargs, output):
        hidden, logits = tap.get("hidden"), getattr(output, "logits", None)
        if tap["calls"] != 1:
            tap["problem"] = f"its output head ran {tap['calls']} times in one forward"
        elif hidden is None or tuple(hidden.shape[:2]) != tuple(labels.shape):
            tap["problem"] = "its output head's input is not (rows, positions, hidden) of the batch"
        elif not torch.is_tensor(logits) or not torch.is_tensor(tap.get("head_out")):
            tap["problem"] = "its output has no logits"
        else:
            with torch.no_grad():
                same = _same_logits(transform(tap["head_out"]), logits)
            if not same:
                tap["problem"] = "its logits are not a transform of its output head's result that this module knows"
        tap.pop("head_out", None)
        if "problem" in tap or compute is None:
            return output
        return output, compute(tap.pop("hidden"), transform)

    handles = [head.register_forward_pre_hook(head_pre, with_kwargs=True),
               head.register_forward_hook(head_post, with_kwargs=True),
               # before FSDP2's post-forward hook: the head's weights are still gathered
               model.register_forward_hook(model_post, with_kwargs=True, prepend=True)]
    try:
        yield tap
    finally:
        for h in handles:
            h.remove()


def _verdict(model: nn.Module, inputs: dict, labels: torch.Tensor) -> str | None:
    """None when `model` takes the chunked path, else why not; decided on its first batch with one
    forward without gradients (its head computes the last positions only) and logged once."""
    if model in _VERDICTS:
        return _VERDICTS[model]
    head, why = output_head(model)
    if head is not None:
        # a KV cache grows in a forward: the deciding one gets a copy, the caller's stays as it is
        inputs = {k: copy.deepcopy(v) if k in ("cache", "past_key_values") else v for k, v in inputs.items()}
        try:
            with torch.no_grad(), _tapped(model, head, labels, None) as tap:
                model(**inputs, use_cache=False)
            why = tap.get("problem")
        # e.g. a forward that needs every position's logits
        except (RuntimeError, ValueError, IndexError, TypeError) as e:
            with torch.no_grad():
                model(**inputs, use_cache=False)  # fails too: the model's own error, raised as it is
            why = f"its forward fails with its head fed the last positions only ({type(e).__name__}: {e})"
    _VERDICTS[model] = why
    from .distributed import log
    log(f"loss: {type(_unwrap(model)).__name__}: " + (
        f"output head and loss on the trained positions only, {LOSS_CHUNK} at a time" if why is None
        else f"full logits ({why})"))
    return why


def _gather(hidden_or_logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the rows of the positions whose next token is trained, those next tokens), in row-major order."""
    keep = labels[:, 1:] != IGNORE_INDEX
    return hidden_or_logits[:, :-1][keep], labels[:, 1:][keep]


def _chunked(hidden: torch.Tensor, labels: torch.Tensor, head: nn.Module, transform, *, dft: bool,
             reference: Reference | None, accuracy: bool, chunk: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(token_sums over the trained positions, each one's argmax hit or None), the head applied `chunk`
    positions at a time; under grad each chunk is checkpointed (backward recomputes its logits),
    unless there is only one: then its logits are held until its backward either way."""
    rows, targets = _gather(hidden, labels)
    recompute = torch.is_grad_enabled() and rows.size(0) > chunk
    total = rows.new_zeros(3, dtype=torch.float32)
    hits: list[torch.Tensor] | None = [] if accuracy else None
    for start in range(0, rows.size(0), chunk):
        part = slice(start, start + chunk)
        t = targets[part]

        w = reference.weights[part] if reference is not None and reference.weights is not None else None

        def ref_logits(part=part):
            if reference is None:
                return None
            if reference.logits is not None:
                return reference.logits[part]
            from .lora import adapters_off  # the head's own adapters (if it is a LoRA target) off too
            with torch.no_grad(), adapters_off(head):
                return transform(head(reference.hidden[part]))

        def sums(h, t=t, ref_logits=ref_logits, w=w):
            return token_sums(transform(head(h)), t, ref_logits(), dft, w)

        if recompute:
            total = total + checkpoint(sums, rows[part], use_reentrant=False)
        else:
            logits = transform(head(rows[part]))
            total = total + token_sums(logits, t, ref_logits(), dft, w)
            if hits is not None:
                hits.append(logits.argmax(-1) == t)
    if rows.size(0) == 0 and torch.is_grad_enabled():  # nothing trained: zero, yet backward must still run
        total = total + rows.sum()                       # through the model (FSDP2's collectives on every rank)
    if hits is None:
        return total, None
    return total, torch.cat(hits) if hits else targets.new_zeros(0, dtype=torch.bool)


def model_loss(model: nn.Module, inputs: dict, labels: torch.Tensor, *, dft: bool = False,
               reference: Reference | None = None, accuracy: bool = False) -> LossSums:
    """One forward of `model` on `inputs` (the batch less its labels) and its sums over the trained
    tokens of `labels` (unshifted, IGNORE_INDEX where nothing is trained): cross-entropy, DFT's
    weighted cross-entropy (`dft`), KL(reference || model) (`reference`, from `reference_outputs`)
    and argmax hits (`accuracy`: their count, and `hits` per trained position). The output head and
    the loss run chunked on the trained positions where the model allows it (see the module's
    docstring), else on the full logits."""
    why = _verdict(model, inputs, labels)
    n_tokens = int((labels[:, 1:] != IGNORE_INDEX).sum())
    if why is None:
        head, _ = output_head(model)
        chunk = LOSS_CHUNK

        def compute(hidden, transform):
            total, correct = _chunked(hidden, labels, head, transform, dft=dft, reference=reference,
                                      accuracy=accuracy, chunk=chunk)
            return (total,) if correct is None else (total, correct)

        with _tapped(model, head, labels, compute) as tap:
            out = model(**inputs, use_cache=False)
        if "problem" in tap:  # decided on the model's first batch; a model whose logits change rule is not trusted
            raise RuntimeError(f"loss: {type(_unwrap(model)).__name__}: {tap['problem']} on this batch, unlike "
                               "on its first one")
        total = out[1][0]
        hits = out[1][1] if accuracy else None
        return LossSums(total[0], n_tokens, total[1], total[2], None if hits is None else int(hits.sum()),
                        chunked=True, hits=hits)
    if reference is not None and reference.logits is None:
        raise RuntimeError("loss: a chunked reference for a model on the full-logits path")
    logits, targets = _gather(model(**inputs, use_cache=False).logits, labels)
    total = token_sums(logits, targets, reference.logits if reference is not None else None, dft,
                       reference.weights if reference is not None else None)
    hits = logits.argmax(-1) == targets if accuracy else None
    return LossSums(total[0], n_tokens, total[1], total[2], None if hits is None else int(hits.sum()),
                    chunked=False, hits=hits)


def reference_outputs(model: nn.Module, inputs: dict, labels: torch.Tensor,
                      kl_mask: torch.Tensor | None = None) -> Reference:
    """The model's predictions at the trained positions, as `model_loss`'s KL reference. Call it
    without gradients and in the reference's state (e.g. `lora.adapters_off`); `model_loss` applies
    the head to the kept hidden states with the head's own adapters off. `kl_mask` (labels' shape):
    the tokens whose KL counts (a warm start's earlier sources), else every trained token's."""
    ref = _reference(model, inputs, labels)
    if kl_mask is None:
        return ref
    weights = kl_mask[:, 1:][labels[:, 1:] != IGNORE_INDEX].float()
    return Reference(ref.hidden, ref.logits, weights)


def _reference(model: nn.Module, inputs: dict, labels: torch.Tensor) -> Reference:
    if _verdict(model, inputs, labels) is None:
        head, _ = output_head(model)
        with _tapped(model, head, labels, lambda hidden, transform: (_gather(hidden, labels)[0],)) as tap:
            out = model(**inputs, use_cache=False)
        if "problem" in tap:
            raise RuntimeError(f"loss: {type(_unwrap(model)).__name__}: {tap['problem']} on this batch, unlike "
                               "on its first one")
        return Reference(hidden=out[1][0])
    return Reference(logits=_gather(model(**inputs, use_cache=False).logits, labels)[0])
