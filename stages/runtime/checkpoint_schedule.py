"""When a run saves and where it resumes (torchtitan's `CheckpointManager`): `runner.save_interval`,
`runner.keep_checkpoints` and `runner.resume` over the DCP checkpoints of `checkpoint.py`. A
checkpoint holds the model and optimizer (sharded), and in `trainer_state.json` the step, the data
position, the LR scheduler, the world size and the run's total steps."""

from __future__ import annotations

from pathlib import Path

import torch

from stages.core.config import RunnerConfig
from stages.core.errors import ConfigError

from . import checkpoint as ckpt
from . import faults
from .batches import DataPosition
from .distributed import log


class Checkpointer:
    """The checkpoints of one training run, in `out/checkpoints`."""

    def __init__(self, out: Path, runner: RunnerConfig):
        self.dir = Path(out) / "checkpoints"
        self.runner = runner

    def due(self, step: int, total_steps: int) -> bool:
        every = self.runner.save_interval
        return (every > 0 and step % every == 0) or step == total_steps

    def save(self, step: int, pos: DataPosition, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             scheduler, world: int, total_steps: int) -> None:
        """A resumable checkpoint of `step`, the oldest beyond `runner.keep_checkpoints` removed. The
        test hook's two kill points sit around it (runtime/faults.py)."""
        state = {"step": step, "data_position": pos.to_dict(), "scheduler": scheduler.state_dict(),
                 "world_size": world, "total_steps": total_steps}
        ckpt.save_checkpoint(self.dir, step, model, optimizer, state, keep=self.runner.keep_checkpoints,
                             before_complete=lambda: faults.inject("save", step))
        log(f"checkpoint step {step} saved")
        faults.inject("after_save", step)

    def resume(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler,
               world: int) -> tuple[int, DataPosition]:
        """Restores `runner.resume`'s checkpoint into the model, optimizer and scheduler (RNG streams
        too at the same world size); (its step, its data position), or (0, the start) without one."""
        path = self._to_resume()
        if path is None:
            return 0, DataPosition()
        state, rng_ok = ckpt.load_checkpoint(path, model, optimizer)
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
