"""Resumable checkpoints with torch.distributed.checkpoint (DCP).

`checkpoints/step_00000040/` holds the sharded model and optimizer state (DCP reshards them
on load, so a different world size can resume), `trainer_state.json` (step, data position,
LR scheduler, world size), per-rank RNG states, and `COMPLETE`, written last. A checkpoint
is written under `step_XXXXXXXX.tmp` and renamed once complete; one without the marker is
ignored with a warning.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

COMPLETE = "COMPLETE"


def _name(step: int) -> str:
    return f"step_{step:08d}"


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(root: Path, step: int, model, optimizer, trainer_state: dict, keep: int,
                    before_complete=None) -> Path:
    rank = dist.get_rank()
    root = Path(root)
    tmp, final = root / (_name(step) + ".tmp"), root / _name(step)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    dcp.save(state, checkpoint_id=str(tmp))
    torch.save(rng_state(), tmp / f"rng_rank{rank}.pt")
    dist.barrier()
    if before_complete is not None:  # test hook: a crash here leaves a checkpoint without its marker
        before_complete()
    if rank == 0:
        (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=2))
        (tmp / COMPLETE).write_text(str(step))
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        for old in list_checkpoints(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def list_checkpoints(root: Path, warn=None) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for d in sorted(root.glob("step_*")):
        if (d / COMPLETE).is_file() and not d.name.endswith(".tmp"):
            out.append(d)
        elif warn:
            warn(f"ignoring incomplete checkpoint {d} (no {COMPLETE} marker: interrupted while saving)")
    return out


def load_checkpoint(path: Path, model, optimizer) -> tuple[dict, bool]:
    """Restores model/optimizer in place; returns (trainer_state, rng_restored)."""
    path = Path(path)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])
    trainer_state = json.loads((path / "trainer_state.json").read_text())
    rng_file = path / f"rng_rank{dist.get_rank()}.pt"
    same_world = trainer_state.get("world_size") == dist.get_world_size()
    if same_world and rng_file.is_file():
        set_rng_state(torch.load(rng_file, weights_only=False))
    return trainer_state, same_world


def load_model_weights(model, path: str) -> dict:
    """The model half of a training checkpoint (any world size) into an unsharded `model`, read
    whole by this one process; returns the loaded state (what the checkpoint holds of the model)."""
    import warnings
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    state = {k: v for k, v in model.state_dict().items() if f"model.{k}" in saved}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"model": state}, checkpoint_id=path, no_dist=True)
    return state
