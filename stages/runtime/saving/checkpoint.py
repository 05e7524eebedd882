"""Resumable checkpoints with torch.distributed.checkpoint (DCP).

`checkpoints/step_00000040/` holds the sharded model and optimizer state (DCP reshards them
on load, so a different world size can resume), `trainer_state.json` (step, data position,
LR scheduler, world size), per-rank RNG states (`rng_rank*.json`), and `COMPLETE`, written last.
A checkpoint is written under `step_XXXXXXXX.tmp` and renamed once complete; one without the
marker is ignored with a warning.

DCP's own `.metadata` is a pickle, and DCP reads it with `pickle.load`: a crafted checkpoint
folder (`--model FOLDER`, `runner.resume=FOLDER`) would run code on load. Every read here goes
through `SafeReader`, whose unpickler resolves only the types DCP's metadata is made of
(`METADATA_GLOBALS`); anything else is a `CheckpointError` naming the folder, before any of it
runs. The data files DCP reads with `torch.load(weights_only=True)`, which is safe already.
"""

from __future__ import annotations

import base64
import dataclasses
import importlib
import json
import pickle
import random
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from stages.core.errors import StageError

COMPLETE = "COMPLETE"
# Frozen parameters (LoRA's base weights) are rebuilt from the base model, never saved: a LoRA
# checkpoint holds the adapters and their optimizer state. Full fine-tuning freezes nothing.
TRAINED = StateDictOptions(ignore_frozen_params=True)
LOAD_TRAINED = StateDictOptions(ignore_frozen_params=True, strict=False)
# Prefixes that wrappers put in parameter names but state dict keys don't carry (torch.compile's
# module, activation checkpointing's wrapper, FSDP1's): stripped so the two name sets compare.
_WRAPPER_PARTS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def _key(name: str) -> str:
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


def trained_state(model) -> dict:
    """What a checkpoint holds of the model: its state without any frozen parameter. DCP's own
    `ignore_frozen_params` drops the names `named_parameters()` yields, and that lists a tied weight
    once: the frozen output head sharing the embedding (the builtin model, SmolLM2, Qwen2.5-0.5B)
    stayed in every LoRA checkpoint under its second name (SmolLM2: 113 MB of 168 MB)."""
    state = get_model_state_dict(model, options=TRAINED)
    frozen = {_key(n) for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {k: v for k, v in state.items() if _key(k) not in frozen}


class CheckpointError(StageError):
    """A checkpoint folder that can't be loaded: damaged, or its `.metadata` names something other
    than DCP's metadata types. One line naming the folder (the CLI shows it as it is, exit code 1);
    `problem` is the line without the folder."""

    problem: str = ""


def _unusable(folder, problem: str) -> CheckpointError:
    e = CheckpointError(f"checkpoint {folder}: {problem}")
    e.problem = problem
    return e


def _metadata_globals() -> frozenset:
    """(module, name) of everything a DCP `.metadata` pickle may reference: the classes of DCP's
    metadata module, its per-file storage record, torch.Size, the torch dtypes, the layout lookup
    torch registers for pickling `torch.strided`, and the path type `storage_meta.checkpoint_id`
    holds. Read off real checkpoints (model and AdamW state in 10 dtypes, a Hugging Face model,
    `dcp.save(no_dist=True)`; tests/test_checkpoint_safety.py lists them again)."""
    md = dcp_metadata.__name__
    allowed = {(md, n) for n, v in vars(dcp_metadata).items() if isinstance(v, type) and v.__module__ == md}
    allowed |= {("torch", n) for n, v in vars(torch).items() if isinstance(v, torch.dtype)}
    allowed |= {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
                ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
                ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset")}
    return frozenset(allowed)


METADATA_GLOBALS = _metadata_globals()
_ALLOWED = {id(getattr(importlib.import_module(m), n)) for m, n in METADATA_GLOBALS}
# the only objects whose state a pickle may set (BUILD): fresh instances of DCP's dataclasses, never
# a class (setting attributes on pathlib.PosixPath would redirect every path in the process) or an enum member
_BUILDABLE = frozenset(v for m, n in METADATA_GLOBALS
                       if dataclasses.is_dataclass(v := getattr(importlib.import_module(m), n))
                       and isinstance(v, type))


class _Forbidden(pickle.UnpicklingError):
    pass


class _MetadataUnpickler(pickle._Unpickler):
    """The pure-Python unpickler (its opcodes can be overridden; the C one's can't), resolving only
    `METADATA_GLOBALS` (before importing anything), calling only them, and setting state only on
    fresh instances of DCP's dataclasses: no other callable can be reached, and no shared object changed."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def find_class(self, module: str, name: str):
        if (module, name) not in METADATA_GLOBALS:
            raise _Forbidden(f"references {module}.{name}")
        return super().find_class(module, name)

    def _callable(self, f) -> None:
        if id(f) not in _ALLOWED:
            raise _Forbidden(f"calls a {type(f).__name__}")

    def _reduce(self):
        self._callable(self.stack[-2])
        pickle._Unpickler.load_reduce(self)

    def _newobj(self):
        self._callable(self.stack[-2])
        pickle._Unpickler.load_newobj(self)

    def _newobj_ex(self):
        self._callable(self.stack[-3])
        pickle._Unpickler.load_newobj_ex(self)

    def _instantiate(self, klass, args):  # INST and OBJ (protocol 0/1)
        self._callable(klass)
        pickle._Unpickler._instantiate(self, klass, args)

    def _build(self):
        if type(self.stack[-2]) not in _BUILDABLE:
            raise _Forbidden(f"sets the state of a {type(self.stack[-2]).__name__}")
        pickle._Unpickler.load_build(self)

    def persistent_load(self, pid):
        raise _Forbidden("holds a persistent id")

    dispatch[pickle.REDUCE[0]] = _reduce
    dispatch[pickle.NEWOBJ[0]] = _newobj
    dispatch[pickle.NEWOBJ_EX[0]] = _newobj_ex
    dispatch[pickle.BUILD[0]] = _build


def load_metadata(file, folder, name: str = ".metadata") -> dcp_metadata.Metadata:
    """DCP metadata from the open metadata file `name` of checkpoint `folder`, unpickled safely; a
    CheckpointError naming the folder for a forbidden global or a damaged file."""
    try:
        metadata = _MetadataUnpickler(file).load()
    except _Forbidden as e:
        raise _unusable(folder, f"{name} {e}, which DCP metadata never does: not loaded "
                                "(unpickling it would run code; a crafted or foreign checkpoint?)") from None
    except Exception as e:  # noqa: BLE001 - truncated, not a pickle, a type that no longer fits, ...
        raise _unusable(folder, f"{name} can't be read ({type(e).__name__})") from None
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise _unusable(folder, f"{name} holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


class SafeReader(dcp.FileSystemReader):
    """`dcp.FileSystemReader` that reads `.metadata` (and DCP's rank-local fallback,
    `__<rank>.metadata`) with `load_metadata`; what it does after unpickling is torch's own."""

    def read_metadata(self, *args, **kwargs) -> dcp_metadata.Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = load_metadata(f, self.path, Path(path).name)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def read_metadata(path) -> dcp_metadata.Metadata:
    """The DCP metadata of checkpoint folder `path`, read safely (CheckpointError if it can't be)."""
    try:
        return SafeReader(str(path)).read_metadata()
    except OSError as e:
        raise _unusable(path, f".metadata can't be read ({type(e).__name__})") from None


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


def _save_step(root: Path, step: int, state: dict, rank_files: dict[str, str] | None = None,
               rank0_files: dict[str, str] | None = None, before_complete=None, keep: int | None = None) -> Path:
    """`root/step_N` written as DCP under `.tmp` (plus each rank's and rank 0's small files), marked complete
    and renamed by rank 0, so a reader never sees half a step; `keep`: the newest complete steps left."""
    rank = dist.get_rank()
    root = Path(root)
    tmp, final = root / (_name(step) + ".tmp"), root / _name(step)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    dcp.save(state, checkpoint_id=str(tmp))
    for name, text in (rank_files or {}).items():
        (tmp / name).write_text(text)
    dist.barrier()
    if before_complete is not None:  # test hook: a crash here leaves a checkpoint without its marker
        before_complete()
    if rank == 0:
        for name, text in (rank0_files or {}).items():
            (tmp / name).write_text(text)
        (tmp / COMPLETE).write_text(str(step))
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        if keep is not None:
            for old in list_checkpoints(root)[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def save_checkpoint(root: Path, step: int, model, optimizer, trainer_state: dict, keep: int,
                    before_complete=None) -> Path:
    state = {"model": trained_state(model), "optim": get_optimizer_state_dict(model, optimizer)}
    return _save_step(root, step, state, {f"rng_rank{dist.get_rank()}.json": json.dumps(rng_state())},
                      {"trainer_state.json": json.dumps(trainer_state, indent=2)}, before_complete, keep)


def save_weights(root: Path, step: int, model) -> Path:
    """`root/step_N`: what a checkpoint holds of the model (no optimizer, RNG or trainer state), as
    DCP, written under `.tmp` and renamed once marked complete: the weights of a best validation
    check, kept to be exported at the end at half a checkpoint's size."""
    return _save_step(root, step, {"model": trained_state(model)})


def load_weights(path: Path, model) -> None:
    """`save_weights`' folder (or a checkpoint's model half) into the model in place, resharded."""
    read_metadata(path)
    state = {"model": trained_state(model)}
    dcp.load(state, storage_reader=SafeReader(str(path)))
    set_model_state_dict(model, state["model"], options=LOAD_TRAINED)


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
        storage = read_metadata(path).storage_data
    except CheckpointError as e:  # damaged, or names code to run: unusable either way
        return e.problem
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
    read_metadata(path)  # a CheckpointError here; inside dcp.load it would come wrapped in DCP's own
    state = {"model": trained_state(model), "optim": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, storage_reader=SafeReader(str(path)))  # every key asked for must be in the checkpoint
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
    saved = read_metadata(path).state_dict_metadata
    state = {k: v for k, v in model.state_dict().items() if f"model.{k}" in saved}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"model": state}, storage_reader=SafeReader(str(path)), no_dist=True)
    return state
