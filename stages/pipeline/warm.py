"""The rank started ahead: when a flow will train on one process of this machine, its rank starts
before the stages ahead of train run and imports meanwhile (launch/ahead.py); `warm_imports` imports
what this process's stages will (the CLI, while a Prefect server starts)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from ..models.base import model_config_json
from .plans import Plan, requires


def _trains_here(p: Plan, runs: set[str] | None = None, forced: set[str] | frozenset[str] = frozenset()) -> bool:
    """Whether the stages `runs` (default all) of this plan train, and with sftflow's own worker (a custom
    worker's imports are its own)."""
    trains = "train" in p.stages and "train" in (p.stages if runs is None else runs) and not p.cfg.actor.worker
    return trains and (p.status("train") != "complete" or bool(forced & ({"train"} | requires(p, "train"))))


def warm_imports(p: Plan, runs: set[str] | None = None, forced: set[str] | frozenset[str] = frozenset()) -> None:
    """Imports now the libraries the stages this plan computes import first in this process (torch,
    transformers and the model's modeling code to build a builtin model and tokenize; MLflow's SQL store):
    seconds on a cold interpreter, which a caller with time to spare (the CLI while a Prefect server
    starts) spends here instead of on the run's path. A fully cached plan imports nothing. `runs` and
    `forced` as for `launch_ahead`."""
    import importlib
    if all(p.status(s) == "complete" for s in p.stages):
        return
    from ..train import start_rank_ahead, warm_modules
    model_type = _model_type(p)
    if _trains_here(p, runs, forced):  # its rank imports alongside: the flow's `launch_ahead` then finds it waiting
        start_rank_ahead(p.cfg, p.fingerprints["train"], model_type)
    # what this process builds and tokenizes with (the model's own modeling code included), and MLflow's store
    for name in ["torch", *[m for m in warm_modules(model_type) if m.startswith("transformers.")],
                 "mlflow.store.tracking.sqlalchemy_store"]:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the stage that needs it imports it again and says why
            pass


def _model_type(p: Plan) -> str | None:
    """The Hugging Face `model_type` of the plan's base model, when its config can be read without loading it."""
    found = model_config_json(p.cfg, p.fingerprints["models"])
    return found[0].get("model_type") if found else None


@contextmanager
def launch_ahead(p: Plan, runs: set[str] | None = None,
                 forced: set[str] | frozenset[str] = frozenset()) -> Iterator[None]:
    """Around a flow's stages (`runs`: those it may run, default all): when they will train on one process
    of this machine (train not complete, or forced, or downstream of a forced stage), its rank starts now
    and imports while the stages before train run (launch/ahead.py); stopped at the end if no launch took it."""
    handle = None
    if _trains_here(p, runs, forced):
        from ..train import start_rank_ahead
        handle = start_rank_ahead(p.cfg, p.fingerprints["train"], _model_type(p))
    try:
        yield
    finally:
        if handle is not None:
            handle.close()
