"""Resumable checkpoints with torch.distributed.checkpoint (DCP).

`checkpoints/step_00000040/` holds the sharded model and optimizer state (DCP reshards them
on load, so a different world size can resume), `trainer_state.json` (step, data position,
LR scheduler, world size), per-rank RNG states (`rng_rank*.json`), and `COMPLETE`, written last.
DCP's own `.metadata` is a pickle: load checkpoints you (or this project) wrote, as with any
PyTorch checkpoint. A checkpoint
is written under `step_XXXXXXXX.tmp` and renamed once complete; one without the marker is
ignored with a warning.
"""

from __future__ import annotations

import base64
import json
import random
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

COMPLETE = "COMPLETE"
# Frozen parameters (LoRA's base weights) are rebuilt from the base model, never saved: a LoRA
# checkpoint holds the adapters and their optimizer state. Full fine-tuning freezes nothing.
TRAINED = StateDictOptions(ignore_frozen_params=True)
LOAD_TRAINED = StateDictOptions(ignore_frozen_params=True, strict=False)


def _name(step: int) -> str:
    return f"step_{step:08d}"


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode()


def _tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def rng_state() -> dict:
    """Every RNG stream of this process as plain JSON: a checkpoint holds no pickle of ours, so
    loading one runs no code (torch.load would)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    return {"torch": _b64(torch.get_rng_state()),
            "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(gauss)],
            "python": [version, list(internal), gauss_next],
            "cuda": [_b64(t) for t in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else None}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(_tensor(state["torch"]))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_tensor(t) for t in state["cuda"]])


def save_checkpoint(root: Path, step: int, model, optimizer, trainer_state: dict, keep: int,
                    before_complete=None) -> Path:
    rank = dist.get_rank()
    root = Path(root)
    tmp, final = root / (_name(step) + ".tmp"), root / _name(step)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    state = {"model": get_model_state_dict(model, options=TRAINED), "optim": get_optimizer_state_dict(model, optimizer)}
    dcp.save(state, checkpoint_id=str(tmp))
    (tmp / f"rng_rank{rank}.json").write_text(json.dumps(rng_state()))
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


def checkpoint_problem(path: Path) -> str | None:
    """What makes a complete checkpoint unusable, or None. Cheap and the same on every rank (only
    sizes and small files are read): `trainer_state.json` parses, DCP's `.metadata` reads, and every
    data file holds the byte ranges the metadata points into (a truncated `.distcp` fails here)."""
    path = Path(path)
    try:
        state = json.loads((path / "trainer_state.json").read_text())
        missing = [k for k in ("step", "data_position", "scheduler") if k not in state]
        if missing:
            return f"trainer_state.json lacks {missing}"
    except (OSError, ValueError) as e:
        return f"trainer_state.json can't be read ({type(e).__name__})"
    try:
        storage = dcp.FileSystemReader(str(path)).read_metadata().storage_data
    except Exception as e:  # noqa: BLE001 - any unreadable metadata means the same: unusable
        return f".metadata can't be read ({type(e).__name__})"
    need: dict[str, int] = {}
    for info in storage.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(need.items()):
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size < size:
            return f"{name} is truncated ({f.stat().st_size} of {size} bytes)"
    return None


def newest_usable(root: Path, warn) -> Path | None:
    """The newest complete checkpoint that passes `checkpoint_problem`; each newer one that doesn't is
    skipped with a warning naming it (a crash or a full disk can leave one half-written)."""
    for path in reversed(list_checkpoints(root, warn=warn)):
        problem = checkpoint_problem(path)
        if problem is None:
            return path
        warn(f"skipping checkpoint {path}: {problem}; falling back to the one before it")
    return None


def load_checkpoint(path: Path, model, optimizer) -> tuple[dict, bool]:
    """Restores model/optimizer in place; returns (trainer_state, rng_restored)."""
    path = Path(path)
    state = {"model": get_model_state_dict(model, options=TRAINED), "optim": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=str(path))  # every key asked for must be in the checkpoint
    set_model_state_dict(model, state["model"], options=LOAD_TRAINED)
    set_optimizer_state_dict(model, optimizer, state["optim"])
    trainer_state = json.loads((path / "trainer_state.json").read_text())
    rng_file = path / f"rng_rank{dist.get_rank()}.json"
    restored = trainer_state.get("world_size") == dist.get_world_size() and rng_file.is_file()
    if restored:
        set_rng_state(json.loads(rng_file.read_text()))
    return trainer_state, restored


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
