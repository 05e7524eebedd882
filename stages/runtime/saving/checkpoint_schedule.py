"""When a run saves and where it resumes (torchtitan's `CheckpointManager`): `runner.save_interval`,
`runner.keep_checkpoints` and `runner.resume` over the DCP checkpoints of `checkpoint.py`. A
checkpoint holds the model and optimizer (sharded), and in `trainer_state.json` the step, the data
position, the LR scheduler, the world size and the run's total steps (and, with early stopping or
best-checkpoint selection, the validation checks' state). The best check's weights are kept apart,
in `checkpoints/best/step_N`, while a kept checkpoint or the running loop names them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from stages.core.config import RunnerConfig
from stages.core.errors import ConfigError, StageError

from . import checkpoint as ckpt
from . import faults
from ..batches import DataPosition
from ..distributed import log


class Checkpointer:
    """The checkpoints of one training run, in `out/checkpoints`."""

    def __init__(self, out: Path, runner: RunnerConfig):
        self.dir = Path(out) / "checkpoints"
        self.best_dir = self.dir / "best"
        self.runner = runner
        self.state: dict = {}  # the resumed checkpoint's trainer state ({} for a fresh start)

    def due(self, step: int, total_steps: int) -> bool:
        every = self.runner.save_interval
        return (every > 0 and step % every == 0) or step == total_steps

    def save(self, step: int, pos: DataPosition, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             scheduler, world: int, total_steps: int, selection: dict | None = None) -> None:
        """A resumable checkpoint of `step`, the oldest beyond `runner.keep_checkpoints` removed. The
        test hook's two kill points sit around it (runtime/saving/faults.py). `selection`: the validation
        checks' state (validation.BestCheck), resumed with the rest."""
        state = {"step": step, "data_position": pos.to_dict(), "scheduler": scheduler.state_dict(),
                 "world_size": world, "total_steps": total_steps}
        if selection is not None:
            state["selection"] = selection
        ckpt.save_checkpoint(self.dir, step, model, optimizer, state, keep=self.runner.keep_checkpoints,
                             before_complete=lambda: faults.inject("save", step))
        log(f"checkpoint step {step} saved")
        if selection is not None:
            self._drop_unnamed_best(selection.get("best_step"))
        faults.inject("after_save", step)

    def save_best(self, step: int, model: torch.nn.Module) -> None:
        """The weights of the new best validation check, to be exported at the end (`load_best`)."""
        ckpt.save_weights(self.best_dir, step, model)
        log(f"best check's weights of step {step} kept")
        self._drop_unnamed_best(step)

    def load_best(self, step: int, model: torch.nn.Module) -> None:
        path = self.best_dir / ckpt._name(step)
        if not (path / ckpt.COMPLETE).is_file():
            raise StageError(f"the best validation check's weights (step {step}) are not in {self.best_dir}: "
                             "was the run resumed from another run's checkpoint? runner.resume=never starts afresh")
        ckpt.load_weights(path, model)
        self._drop_unnamed_best(step, finished=True)

    def _drop_unnamed_best(self, current: int | None, finished: bool = False) -> None:
        """Frees best weights that neither the loop (`current`) nor a kept checkpoint names: resume may
        fall back to an older checkpoint, whose best must still be there. Once `finished`, only the
        newest checkpoint counts, which names `current` (rank 0 deletes)."""
        if torch.distributed.get_rank() != 0 or not self.best_dir.is_dir():
            return
        named = {current}
        for path in ckpt.list_checkpoints(self.dir)[-1:] if finished else ckpt.list_checkpoints(self.dir):
            try:
                named.add(json.loads((path / "trainer_state.json").read_text()).get("selection", {}).get("best_step"))
            except (OSError, ValueError):  # a damaged checkpoint is never resumed: it names nothing
                continue
        for old in self.best_dir.glob("step_*"):
            if old.name.endswith(".tmp") or int(old.name[len("step_"):]) not in named:
                shutil.rmtree(old, ignore_errors=True)

    def resume(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler,
               world: int) -> tuple[int, DataPosition]:
        """Restores `runner.resume`'s checkpoint into the model, optimizer and scheduler (RNG streams
        too at the same world size); (its step, its data position), or (0, the start) without one."""
        path = self._to_resume()
        if path is None:
            return 0, DataPosition()
        state, rng_ok = ckpt.load_checkpoint(path, model, optimizer)
        self.state = state
        scheduler.load_state_dict(state["scheduler"])
        pos = DataPosition(**state["data_position"])
        log(f"resumed from {path} at step {state['step']} (epoch {pos.epoch}, {pos.consumed} samples into it)"
            + ("" if rng_ok else f"; world size {state['world_size']} -> {world}, RNG streams start fresh"))
        return state["step"], pos

    def _to_resume(self) -> Path | None:
        resume = self.runner.resume
        if resume == "never":
            return None
        if resume == "auto":
            path = ckpt.newest_usable(self.dir, warn=log)
            if path is None and ckpt.list_checkpoints(self.dir):
                log("no usable checkpoint: training starts from the beginning")
            return path
        path = Path(resume)
        if not (path / ckpt.COMPLETE).is_file():
            raise ConfigError(f"runner.resume: '{path}' is not a complete checkpoint (no {ckpt.COMPLETE})")
        problem = ckpt.checkpoint_problem(path)
        if problem is not None:
            raise ConfigError(f"runner.resume: '{path}' can't be used: {problem}")
        return path
