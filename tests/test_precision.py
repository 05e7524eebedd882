"""`actor.precision: bf16` on CPU (gloo), against the fp32 run of the same samples: losses within
bf16 rounding; master weights, reduced gradients and AdamW state fp32 on the real objects, compute
in bf16, the loss summed in fp32; a bf16 checkpoint holds fp32 weights and resumes bit-exact; the
export is in the dtype docs/config.md states; LoRA too. In one process (gloo, world size 1, where
FSDP2 still wraps, casts and reduces), plus one torchrun case for the collectives over two ranks."""

import json
import os
import re
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open

from conftest import ROOT, base_model, tiny_config_dict, write_config
from stages.core.config import load_config
from stages.pipeline import plan, run_stage
from stages.runtime.saving import faults
from stages.runtime.saving.checkpoint import read_metadata
from stages.launch.launcher import worker_env
from stages.runtime.worker import SFTWorker, WorkerSpec

# 4 steps of 8 samples in 2 micro-batches (accumulation happens), a checkpoint every 2 steps
RUN = {"max_epochs": 1, "max_steps": 4, "save_interval": 2, "val_check_interval": 0, "keep_checkpoints": 5}
ONE = {"nproc_per_node": 1, "micro_batch_size": 4, "global_batch_size": 8, "optim": {"lr": 1e-3, "warmup": 1}}
LORA = {"lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "up_proj"]}}
# bf16 keeps 8 significant bits: a number in [4, 8), where these losses are (ln 556 = 6.3 at the start),
# is rounded to a multiple of 2^-5 = 0.031. The loss is summed in fp32 from bf16 logits, so over a few
# steps it may differ from fp32 by bf16 rounding, not more: within half a bf16 step at its magnitude.
# (Seen: 1e-4 at step 1 growing to 1.2e-3 at step 4; LoRA 3e-4.)
BF16_LOSS_ATOL = 2 ** -6
# A gradient goes through some 30 bf16 matmuls forward and as many backward, each rounding to 2^-8
# relative; independent errors add up like a random walk, sqrt(60) x 2^-8 = 3% of its norm: allow
# 8 x 2^-8 = 3.1%. (Seen: 7.6e-3.)
BF16_GRAD_RTOL = 8 * 2 ** -8


@contextmanager
def gloo_world_of_one():
    """The environment torchrun gives a single worker, on a free port; the process group (if the
    worker left one) destroyed and the environment restored after."""
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0", "RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_RANK": "0"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class Probe(SFTWorker):
    """SFTWorker recording what training really touches: (input, weight, output) dtypes of every
    Linear's forward, the dtype of each micro-batch's loss sum, and before/after each optimizer step
    the parameters (the FSDP2 shards: master weights), their gradients and the AdamW state."""

    def setup(self) -> None:
        super().setup()
        self.seen: dict[str, set] = {k: set() for k in ("compute", "loss_sum", "master", "trained_master",
                                                       "trained_type", "grads", "optim")}
        for m in self.model.modules():
            if isinstance(m, torch.nn.Linear):
                m.register_forward_hook(self._record_compute)

    def _record_compute(self, module, args, out) -> None:
        self.seen["compute"].add((args[0].dtype, module.weight.dtype, out.dtype))

    def get_train_model_output(self, batch):
        out = super().get_train_model_output(batch)
        self.seen["loss_sum"].add(out.loss_sum.dtype)
        return out

    def optimizer_step(self):
        trained = [p for p in self.model.parameters() if p.requires_grad]
        self.seen["master"] |= {p.dtype for p in self.model.parameters()}
        self.seen["trained_master"] |= {p.dtype for p in trained}
        self.seen["trained_type"] |= {type(p).__name__ for p in trained}
        self.seen["grads"] |= {p.grad.dtype for p in trained}
        out = super().optimizer_step()
        self.seen["optim"] |= {(k, v.dtype) for s in self.optimizer.state.values() for k, v in s.items() if k != "step"}
        return out


def specs_over_prepared_data(tmp: Path):
    """The tiny demo data prepared in `tmp`; and `spec(name, **actor)`, a worker spec over it (one
    process unless `actor` says otherwise) writing to `tmp/name`."""
    cfg = load_config(write_config(tmp, tiny_config_dict(tmp)))
    p = plan(cfg)
    run_stage(p, "prepare")
    model_path, train_dir = base_model(cfg), str(p.folder("prepare") / "train")

    def spec(name: str, **actor) -> WorkerSpec:
        raw = tiny_config_dict(tmp, runner=RUN, actor={**ONE, **actor})
        return WorkerSpec(config=load_config(write_config(tmp, raw, f"{name}.yaml")), model_path=model_path,
                          out_dir=str(tmp / name), train_dir=train_dir, val_dir=None)
    return spec


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    return specs_over_prepared_data(tmp_path_factory.mktemp("precision"))


def fit(spec: WorkerSpec, cls=Probe):
    """The worker's whole `fit` (train, checkpoint, export) in this process, as torchrun's only rank."""
    w = cls(spec)
    w.out.mkdir(parents=True, exist_ok=True)  # the train stage's folder, made before torchrun starts
    with gloo_world_of_one():
        w.fit()
    return w


def losses(out_dir) -> list[float]:
    return [json.loads(line)["loss"] for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]


def tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.fixture(scope="module")
def fp32_run(prepared):
    return fit(prepared("fp32", precision="fp32"))


@pytest.fixture(scope="module")
def bf16_run(prepared):
    return fit(prepared("bf16", precision="bf16"))


def assert_fp32_training_bf16_compute(w: Probe) -> None:
    assert w.precision == "bf16" and w.fsdp  # one process too: FSDP2 is what casts
    seen = w.seen
    assert seen["compute"] == {(torch.bfloat16, torch.bfloat16, torch.bfloat16)}, seen["compute"]
    assert seen["loss_sum"] == {torch.float32}  # bf16 logits (lm_head above), upcast before the cross-entropy
    assert seen["trained_master"] == seen["master"] == {torch.float32}
    assert seen["trained_type"] == {"DTensor"}  # FSDP2's shards: what the optimizer steps
    assert seen["grads"] == {torch.float32}  # reduced in fp32 (reduce_dtype), kept on the fp32 shards
    assert seen["optim"] == {("exp_avg", torch.float32), ("exp_avg_sq", torch.float32)}


def test_bf16_losses_stay_within_bf16_rounding_of_the_fp32_run(fp32_run, bf16_run):
    fp32, bf16 = losses(fp32_run.out), losses(bf16_run.out)
    assert len(fp32) == len(bf16) == 4
    assert bf16 == pytest.approx(fp32, abs=BF16_LOSS_ATOL)
    assert bf16 != fp32  # it really ran in another precision
    assert fp32[-1] < fp32[0] and bf16[-1] < bf16[0]


def test_bf16_computes_in_bf16_and_keeps_weights_gradients_and_optimizer_state_in_fp32(bf16_run, fp32_run):
    assert_fp32_training_bf16_compute(bf16_run)
    # the reference: one fp32 process is a plain model, fp32 everywhere
    assert not fp32_run.fsdp and fp32_run.seen["compute"] == {(torch.float32,) * 3}


def test_a_bf16_checkpoint_holds_fp32_weights_and_resumes_bit_exact(prepared, bf16_run, monkeypatch, capsys):
    saved = read_metadata(Path(bf16_run.out) / "checkpoints" / "step_00000002").state_dict_metadata
    model = {k: v.properties.dtype for k, v in saved.items() if k.startswith("model.")}
    optim = {k.rsplit(".", 1)[1]: v.properties.dtype for k, v in saved.items()
             if k.endswith(("exp_avg", "exp_avg_sq"))}
    assert len(model) > 10 and set(model.values()) == {torch.float32}
    assert set(optim) == {"exp_avg", "exp_avg_sq"} and set(optim.values()) == {torch.float32}

    class Interrupted(Exception):
        pass

    def stop_after_step_2_is_saved(point: str, step: int) -> None:
        if (point, step) == ("after_save", 2):
            raise Interrupted
    spec = prepared("bf16-resumed", precision="bf16")
    monkeypatch.setattr(faults, "inject", stop_after_step_2_is_saved)  # the SFTFLOW_FAULT hook's points
    with pytest.raises(Interrupted):
        fit(spec)
    monkeypatch.undo()
    resumed = fit(spec)
    assert "at step 2 (epoch 0, 16 samples into it)" in capsys.readouterr().out
    assert losses(resumed.out) == losses(bf16_run.out)  # exactly
    got, want = (tensors(Path(resumed.out) / "model" / "model.safetensors"),
                 tensors(Path(bf16_run.out) / "model" / "model.safetensors"))
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k


def exported_dtype() -> str:
    """The export dtype docs/config.md states in the `actor.precision` row."""
    row = next(line for line in (ROOT / "docs" / "config.md").read_text().splitlines()
               if line.startswith("| `actor.precision`"))
    found = re.search(r"exported in (\w+)", row)
    assert found, "docs/config.md: the actor.precision row says nothing about the export's dtype"
    return found.group(1)


def assert_exported_as_docs_say(out_dir) -> None:
    want = exported_dtype()
    folder = Path(out_dir) / "model"
    config = json.loads((folder / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == want
    weights = tensors(folder / "model.safetensors")
    assert weights and {str(v.dtype).removeprefix("torch.") for v in weights.values()} == {want}


def test_the_bf16_export_has_the_dtype_docs_config_states(bf16_run):
    assert_exported_as_docs_say(bf16_run.out)


def test_lora_in_bf16_trains_fp32_adapters_like_fp32_lora(prepared):
    fp32 = fit(prepared("lora-fp32", precision="fp32", **LORA))
    bf16 = fit(prepared("lora-bf16", precision="bf16", **LORA))
    assert losses(bf16.out) == pytest.approx(losses(fp32.out), abs=BF16_LOSS_ATOL)
    assert losses(bf16.out) != losses(fp32.out)
    assert_fp32_training_bf16_compute(bf16)
    trained = {n for n, p in bf16.model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n for n in trained)
    assert not (Path(bf16.out) / "model").exists()  # the adapter alone (the train stage adds its base reference)
    adapters = tensors(Path(bf16.out) / "adapter" / "adapter_model.safetensors")
    assert adapters and {v.dtype for v in adapters.values()} == {getattr(torch, exported_dtype())}


TWO = {"nproc_per_node": 2, "micro_batch_size": 4, "global_batch_size": 16}  # 2 micro-batches per rank


def torchrun_steps(tmp: Path, specs: dict[str, WorkerSpec]) -> dict[str, dict]:
    """tests/dist/step_check.py over 2 processes, each spec in turn in one launch; its results by name."""
    paths = {name: spec.write(tmp / f"{name}.json") for name, spec in specs.items()}
    cmd = [sys.executable, "-m", "stages.launch.local_torchrun", "--nproc_per_node=2",
           str(ROOT / "tests" / "dist" / "step_check.py"), str(tmp / "steps.pt"), *map(str, paths.values())]
    proc = subprocess.run(cmd, env=worker_env(2), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = torch.load(tmp / "steps.pt")
    return {name: results[str(path)] for name, path in paths.items()}


def relative_error(got: dict, want: dict) -> float:
    """||got - want|| / ||want|| over all gradients together."""
    assert got.keys() == want.keys()
    diff = sum(((got[k] - want[k]) ** 2).sum() for k in want)
    return float((diff / sum((want[k] ** 2).sum() for k in want)).sqrt())


@pytest.mark.slow
def test_bf16_over_two_gloo_ranks_gathers_in_bf16_reduces_in_fp32_and_matches_fp32(prepared, tmp_path):
    """FSDP2's collectives on gloo under bf16: weights all-gathered in bf16, gradients reduce-scattered
    in fp32, both supported by gloo. The reduced gradient is fp32 on the shards, and the whole
    gradient is within bf16 rounding of the fp32 run's on the same batch."""
    runs = torchrun_steps(tmp_path, {p: prepared(f"two-{p}", precision=p, **TWO) for p in ("fp32", "bf16")})
    fp32, bf16 = runs["fp32"], runs["bf16"]
    assert bf16["precision"] == "bf16" and bf16["stats"]["micro_batches"] == 2
    assert bf16["collectives"] == [("all_gather_single", "bfloat16"), ("reduce_scatter_single", "float32")]
    assert fp32["collectives"] == [("all_gather_single", "float32"), ("reduce_scatter_single", "float32")]
    assert bf16["grad_dtypes"] == fp32["grad_dtypes"] == ["torch.float32"]
    assert bf16["stats"]["loss"] == pytest.approx(fp32["stats"]["loss"], abs=BF16_LOSS_ATOL)
    error = relative_error(bf16["grads"], fp32["grads"])
    print(f"bf16 vs fp32 gradient: relative error {error:.2e}")
    assert 0 < error < BF16_GRAD_RTOL
