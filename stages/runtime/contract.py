"""The extension contract of `SFTWorker` (docs/adding-a-model.md): one name per hook, one return
type per hook, and a worker class checked against it before any process group starts.

The hooks a subclass may override are `HOOKS`. `get_train_model_output` returns a `TrainOutput`
and nothing else; `get_eval_model_output` a dict of summable numbers. A class that defines a hook
under its old name (`build_dataset`, which nothing would call) or declares another return type is a
`WorkerContractError` from `check_worker_class`, which planning (`check_worker_config`) and every
torchrun rank (`load_worker_class`) call first. What a hook returns at run time is read by
`train_output` / `add_eval_output`: anything else is the same error, naming the hook and what it
returned. The old side channels need no check of their own: reading `self.last_kl` / `self.last_ce`
is Python's AttributeError naming it, and an output without the `kl_sum` / `ce_sum` the config asks
for stops the loop at its first step, naming the hook (worker.py `forward_backward`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from stages.core.errors import ConfigError

# hook -> what it returns (the documented type, as the messages name it)
HOOKS = {
    "build_dataloader": "a dataset: len(), ds[i], int arrays `lengths` and `trainable`",
    "collate": "a dict of tensors on self.device",
    "get_train_model_output": "TrainOutput",
    "get_eval_model_output": "dict",
}
# names a subclass may no longer define -> what replaced them
DROPPED = {
    "build_dataset": "the hook is named build_dataloader: rename the method",
}


class WorkerContractError(ConfigError):
    """A worker class or a hook's return value that breaks the contract; one line naming the hook."""


@dataclass(frozen=True)
class TrainOutput:
    """What `get_train_model_output` returns for one micro-batch. The loop adds `loss_sum` and
    `n_tokens` up over all micro-batches and ranks of the step and divides once."""

    loss_sum: torch.Tensor       # sum of the per-token (per-unit) losses, attached to the graph
    n_tokens: float              # how many tokens (units) `loss_sum` sums over
    # `actor.kl_to_base`: the KL(base || tuned) sum, which `loss_sum` includes times the weight;
    # the metrics' `kl` and the logged `loss` (without that term) are computed from it
    kl_sum: torch.Tensor | None = None
    # `actor.loss` other than ce: the plain cross-entropy sum (the metrics' `ce`), `loss_sum` being
    # that objective's
    ce_sum: torch.Tensor | None = None


def train_output(out, hook: str) -> TrainOutput:
    """`out` when it is a TrainOutput with a tensor loss and a count; else the one-line error."""
    if not isinstance(out, TrainOutput):
        raise WorkerContractError(f"{hook} returned {type(out).__name__}; it must return "
                                  "stages.runtime.worker.TrainOutput(loss_sum, n_tokens) (docs/adding-a-model.md)")
    if not torch.is_tensor(out.loss_sum):
        raise WorkerContractError(f"{hook} returned a TrainOutput whose loss_sum is {type(out.loss_sum).__name__}, "
                                  "not a tensor")
    n = out.n_tokens
    if torch.is_tensor(n) and n.is_floating_point() or not isinstance(n, (int, float, torch.Tensor)):
        raise WorkerContractError(f"{hook} returned a TrainOutput whose n_tokens is {type(n).__name__}, not a count")
    return out


def add_eval_output(sums: dict[str, float], out, hook: str) -> None:
    """Adds what `get_eval_model_output` returned (a dict of summable numbers) into `sums`."""
    if not isinstance(out, dict):
        raise WorkerContractError(f"{hook} returned {type(out).__name__}; it must return a dict of summable "
                                  "numbers ('loss_sum', 'n_tokens', 'correct', 'total', ...)")
    for key, v in out.items():
        sums[key] = sums.get(key, 0.0) + float(v)


def check_worker_class(cls: type, base: type) -> None:
    """The contract, on a subclass `cls` of `base`, before anything runs: no dropped name defined,
    and hooks that declare a return type declare the documented one."""
    own = [c for c in cls.__mro__ if issubclass(c, base) and c is not base]
    for c in own:
        for attr, value in vars(c).items():
            where = f"{c.__name__}.{attr}"
            if attr in DROPPED:
                raise WorkerContractError(f"actor.worker: {where}: {DROPPED[attr]}")
            if attr in ("get_train_model_output", "get_eval_model_output"):
                func = inspect.unwrap(value.__func__ if isinstance(value, (classmethod, staticmethod)) else value)
                _check_return_annotation(func, where, HOOKS[attr])


def _check_return_annotation(func, where: str, expected: str) -> None:
    ret = getattr(func, "__annotations__", {}).get("return")
    if ret is None:
        return
    text = ret if isinstance(ret, str) else getattr(ret, "__name__", repr(ret))
    head = text.split("[", 1)[0].rsplit(".", 1)[-1].strip()
    if head != expected:
        raise WorkerContractError(f"actor.worker: {where} is declared to return {text}; it must return {expected}")
