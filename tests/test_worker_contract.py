"""The worker contract, in one process (gloo, world size 1): one name per hook and one return type
per hook, checked before any process group starts (`check_worker_config`, which planning calls); a
`TrainOutput`'s `n_tokens` is what the step divides by; model types named by import path without a
custom worker; `fit` closes the metrics file and the process group however it ends; the worker's
state is what its class declares; the LR schedule matches transformers' after warmup."""

import dataclasses
import inspect
import json
import os
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from conftest import base_model, tiny_config_dict, write_config
from stages.core.config import ConfigError, load_config
from stages.pipeline import plan, run_stage
from stages.runtime.contract import WorkerContractError, add_eval_output, train_output
from stages.runtime.model_types import WeightsLoadError, build_configured_model
from stages.runtime.schedule import lr_lambda
from stages.runtime.worker import SFTWorker, TrainOutput, WorkerSpec, check_worker_config


class DoubleCountWorker(SFTWorker):
    """Claims twice the tokens the batch has: the step must divide by what it claims."""

    def get_train_model_output(self, batch):
        out = super().get_train_model_output(batch)
        return dataclasses.replace(out, n_tokens=2 * out.n_tokens)


class MeanLossWorker(SFTWorker):
    """Returns a mean loss, a form the contract no longer reads (it was silently rescaled)."""

    def get_train_model_output(self, batch):
        out = super().get_train_model_output(batch)
        return out.loss_sum / out.n_tokens


@pytest.fixture
def one_process(monkeypatch):
    # MASTER_PORT 0: rank 0's store binds a port the kernel picks; with one process nobody else needs it
    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0", "RANK": "0", "WORLD_SIZE": "1",
                 "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(k, v)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def spec(tmp_path) -> WorkerSpec:
    cfg = load_config(write_config(tmp_path, tiny_config_dict(tmp_path, actor={"nproc_per_node": 1, "packing": False})))
    p = plan(cfg)
    run_stage(p, "prepare")
    return WorkerSpec(config=cfg, model_path=base_model(cfg), out_dir=str(tmp_path / "out"),
                      train_dir=str(p.folder("prepare") / "train"), val_dir=None)


def _step(cls, spec) -> tuple[dict, dict]:
    w = cls(spec)
    w.setup()
    row = w.forward_backward(np.arange(spec.config.actor.global_batch_size))
    grads = {n: p.grad.detach().clone() for n, p in w.model.named_parameters() if p.grad is not None}
    dist.destroy_process_group()
    return row, grads


def test_the_step_divides_by_the_tokens_the_outputs_count(one_process, spec):
    base_row, base = _step(SFTWorker, spec)
    row, grads = _step(DoubleCountWorker, spec)
    assert row["trainable_tokens"] == 2 * base_row["trainable_tokens"]
    assert row["loss"] == pytest.approx(base_row["loss"] / 2)
    for name, g in base.items():
        torch.testing.assert_close(grads[name], g / 2, rtol=1e-5, atol=1e-8)


def test_an_output_other_than_a_train_output_stops_naming_the_hook_and_what_it_returned(one_process, spec):
    with pytest.raises(WorkerContractError, match=r"^MeanLossWorker\.get_train_model_output returned Tensor; it "
                                                  r"must return stages\.runtime\.worker\.TrainOutput\(loss_sum, "
                                                  r"n_tokens\)"):
        _step(MeanLossWorker, spec)


class OwnLossWorker(SFTWorker):
    """Computes its loss without the base class's output (so without its KL term)."""

    def get_train_model_output(self, batch):
        return TrainOutput(*self._token_loss_sum(batch))


def test_kl_to_base_with_an_output_that_adds_no_kl_stops_with_one_line(one_process, tmp_path):
    actor = {"nproc_per_node": 1, "lora": {"r": 4, "alpha": 8}, "kl_to_base": 0.5}
    cfg = load_config(write_config(tmp_path, tiny_config_dict(tmp_path, actor=actor)))
    p = plan(cfg)
    run_stage(p, "prepare")
    spec = WorkerSpec(config=cfg, model_path=base_model(cfg), out_dir=str(tmp_path / "out"),
                      train_dir=str(p.folder("prepare") / "train"), val_dir=None)
    row, _ = _step(SFTWorker, spec)  # the base class's output adds it
    assert row["kl"] == 0.0  # fresh adapters (B = 0): the tuned model is the base model
    with pytest.raises(ConfigError, match="OwnLossWorker.get_train_model_output adds no KL term") as stopped:
        _step(OwnLossWorker, spec)
    assert "\n" not in str(stopped.value)


def test_for_eval_wraps_a_loaded_model_without_a_process_group(spec):
    model = torch.nn.Linear(2, 2)
    w = SFTWorker.for_eval(spec, model, torch.device("cpu"), rank=0, world=1)
    assert w.model is model and not w.fsdp and w.precision == "fp32" and w.tokenizer is not None
    assert len(w.build_dataloader(spec.train_dir)) > 0 and not hasattr(w, "build_dataset")
    assert not dist.is_initialized()
    assert set(vars(w)) <= declared_attributes(SFTWorker)


# --------------------------------------------------------------------------- the contract, before anything runs


WORKERS = {
    "OldName": ("def build_dataset(self, data_paths, eval_dataset=False):\n    return None",
                "actor.worker: OldName.build_dataset: the hook is named build_dataloader: rename the method"),
    # the old side channels pass this check, which reads no code: they fail where they are used
    # (test_the_old_side_channels_fail_where_they_are_used)
    "SideKL": ("def get_train_model_output(self, batch):\n    out = super().get_train_model_output(batch)\n"
               "    self.last_kl = out.loss_sum.detach()\n    return out", None),
    "SideCE": ("def forward_backward(self, batch_idx):\n    stats = super().forward_backward(batch_idx)\n"
               "    print(self.last_ce)\n    return stats", None),
    "TupleDeclared": ("def get_train_model_output(self, batch) -> tuple:\n    return (1, 2)",
                      "actor.worker: TupleDeclared.get_train_model_output is declared to return tuple; it must "
                      "return TrainOutput"),
    "Fine": ("def get_train_model_output(self, batch) -> TrainOutput:\n"
             "    return super().get_train_model_output(batch)", None),
}


@pytest.fixture
def workers_module(tmp_path, monkeypatch) -> str:
    """A module `contract_workers` on sys.path holding one SFTWorker subclass per WORKERS entry."""
    body = "".join(f"\n\nclass {name}(SFTWorker):\n{textwrap.indent(code, '    ')}\n"
                   for name, (code, _) in WORKERS.items())
    folder = tmp_path / "code"
    folder.mkdir()
    (folder / "contract_workers.py").write_text(
        "from stages.runtime.worker import SFTWorker, TrainOutput\n" + body)
    monkeypatch.syspath_prepend(str(folder))
    yield "contract_workers"
    import sys
    sys.modules.pop("contract_workers", None)


@pytest.mark.parametrize("name", list(WORKERS))
def test_a_worker_class_is_checked_against_the_contract_before_any_process_group(tmp_path, workers_module, name):
    cfg = load_config(write_config(tmp_path, tiny_config_dict(tmp_path, actor={"worker": f"{workers_module}:{name}"})))
    expected = WORKERS[name][1]
    if expected is None:
        assert check_worker_config(cfg).__name__ == name
        return
    with pytest.raises(WorkerContractError) as stopped:
        check_worker_config(cfg)
    assert str(stopped.value) == expected
    assert not dist.is_initialized()
    with pytest.raises(WorkerContractError, match="^" + expected.replace("(", r"\(").replace(")", r"\)")
                       .replace(".", r"\.")):
        plan(cfg)  # planning calls it (stages/pipeline/checks.py check_code)


def test_the_old_side_channels_fail_where_they_are_used():
    """Reading `self.last_ce` is Python's own error naming it (the base class never had it set since);
    setting `self.last_kl` instead of returning `kl_sum` is stopped at the first step when the config asks
    for the term (test_kl_to_base_with_an_output_that_adds_no_kl_stops_with_one_line)."""
    class ReadsCE(SFTWorker):
        def ce(self):
            return self.last_ce
    with pytest.raises(AttributeError, match="'ReadsCE' object has no attribute 'last_ce'"):
        ReadsCE.__new__(ReadsCE).ce()
    assert not any(hasattr(SFTWorker, name) for name in ("last_kl", "last_ce", "build_dataset"))


@pytest.mark.parametrize("out", [(torch.tensor(6.0, requires_grad=True), 3), torch.tensor(2.0), [torch.tensor(1.0)],
                                 {"loss": torch.tensor(1.0)}, 3.0, None],
                         ids=["tuple", "tensor", "list", "dict", "float", "None"])
def test_only_a_train_output_is_read(out):
    with pytest.raises(WorkerContractError, match=rf"^MyWorker\.get_train_model_output returned "
                                                  rf"{type(out).__name__}; it must return"):
        train_output(out, "MyWorker.get_train_model_output")


def test_a_train_output_needs_a_tensor_loss_and_a_count():
    loss = torch.tensor(6.0, requires_grad=True)
    for n in (3, 3.0, torch.tensor(3)):
        assert train_output(TrainOutput(loss, n), "W.h").loss_sum is loss  # passes through untouched
    with pytest.raises(WorkerContractError, match="loss_sum is float, not a tensor"):
        train_output(TrainOutput(6.0, 3), "W.h")
    with pytest.raises(WorkerContractError, match="n_tokens is Tensor, not a count"):
        train_output(TrainOutput(loss, torch.tensor(3.0)), "W.h")


def test_an_eval_output_is_a_dict_of_summable_numbers():
    sums: dict = {}
    add_eval_output(sums, {"loss_sum": torch.tensor(2.5), "n_tokens": 5}, "W.get_eval_model_output")
    add_eval_output(sums, {"loss_sum": 1.5, "n_tokens": 3, "correct": 1}, "W.get_eval_model_output")
    assert sums == {"loss_sum": 4.0, "n_tokens": 8.0, "correct": 1.0}
    with pytest.raises(WorkerContractError, match=r"^W\.get_eval_model_output returned tuple; it must return a dict"):
        add_eval_output(sums, (1.0, 2), "W.get_eval_model_output")


# --------------------------------------------------------------------------- model types by configuration alone


def test_a_model_type_named_by_import_path_needs_no_custom_worker(tmp_path):
    import custom_model
    cfg = load_config(write_config(tmp_path, tiny_config_dict(tmp_path, actor={
        "model": {"model_type": "custom_model:build_tiny_mlp"}})))
    assert cfg.actor.worker is None and check_worker_config(cfg) is SFTWorker
    model = build_configured_model(cfg, None, seed=0)
    want = custom_model.build_tiny_mlp({}, None)
    assert model.state_dict().keys() == want.state_dict().keys()
    assert all(torch.equal(v, want.state_dict()[k]) for k, v in model.state_dict().items())

    missing = load_config(write_config(tmp_path, tiny_config_dict(tmp_path, actor={
        "model": {"model_type": "custom_model:no_such_builder"}}), "missing.yaml"))
    with pytest.raises(ConfigError, match=r"^actor\.model\.model_type='custom_model:no_such_builder': cannot import"):
        check_worker_config(missing)
    not_callable = load_config(write_config(tmp_path, tiny_config_dict(tmp_path, actor={
        "model": {"model_type": "custom_model:N_CLASSES"}}), "constant.yaml"))
    with pytest.raises(ConfigError, match=r"^actor\.model\.model_type='custom_model:N_CLASSES' is not callable"):
        check_worker_config(not_callable)
    with pytest.raises(ConfigError, match="actor.model.model_type"):
        load_config(write_config(tmp_path, tiny_config_dict(tmp_path, actor={"model": {"model_type": "pkg:"}}),
                                 "bad.yaml"))


def test_editing_an_import_path_model_types_builder_retrains(tmp_path, monkeypatch):
    """The builder's source is a fact of every stage that builds the model (as `actor.worker`'s is):
    an edit re-runs training and scoring, not prepare."""
    pkg = tmp_path / "code"
    pkg.mkdir()
    builder = pkg / "my_builder.py"
    builder.write_text("from custom_model import build_tiny_mlp as build\n")
    monkeypatch.syspath_prepend(str(pkg))
    path = write_config(tmp_path, tiny_config_dict(tmp_path, actor={"model": {"model_type": "my_builder:build"}}))
    before = plan(load_config(path)).fingerprints
    builder.write_text("from custom_model import build_tiny_mlp as build  # a tweak\n")
    after = plan(load_config(path)).fingerprints
    changed = {s for s in before if before[s] != after[s]}
    assert "train" in changed and "evaluate" in changed and "prepare" not in changed


# --------------------------------------------------------------------------- fit always closes


class FailsOnSecondStep(SFTWorker):
    """The second optimizer step's first micro-batch raises (after one full step was reported)."""

    def forward_backward(self, batch_idx):
        if getattr(self, "_steps", 0) == 1:
            raise RuntimeError("boom in step 2")
        self._steps = 1
        return super().forward_backward(batch_idx)


def _open_files() -> set[str]:
    return {os.path.realpath(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")}


def test_fit_closes_the_metrics_file_and_the_process_group_when_a_step_raises(one_process, spec, monkeypatch):
    import stages.runtime.worker as worker_module
    reporters = []  # held here, so that only an explicit close (not the garbage collector) closes the file

    class Held(worker_module.Reporter):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            reporters.append(self)

    monkeypatch.setattr(worker_module, "Reporter", Held)
    w = FailsOnSecondStep(spec)
    w.out.mkdir(parents=True, exist_ok=True)
    with pytest.raises(RuntimeError, match="boom in step 2"):
        w.fit()
    assert len(reporters) == 1
    assert not dist.is_initialized()  # the process group is gone
    metrics = w.out / "metrics.jsonl"
    assert str(metrics.resolve()) not in _open_files()  # the file is closed...
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1]  # ...and holds the step reported before the failure
    assert not (w.out / "model").exists()


def test_fit_closes_the_process_group_when_setup_fails(one_process, spec):
    class NoData(SFTWorker):
        def build_dataloader(self, data_paths, eval_dataset=False):
            return []

    with pytest.raises(Exception, match="no training samples"):
        NoData(spec).fit()
    assert not dist.is_initialized()
    assert not (Path(spec.out_dir) / "metrics.jsonl").exists()


# --------------------------------------------------------------------------- explicit state


def declared_attributes(cls) -> set[str]:
    return {name for c in cls.__mro__ for name in inspect.get_annotations(c)}


def test_setup_sets_exactly_the_attributes_the_class_declares(one_process, spec):
    w = SFTWorker(spec)
    w.setup()
    assert set(vars(w)) == declared_attributes(SFTWorker)
    assert (w.fsdp, w.keep_gathered) == (False, False)  # one fp32 process: nothing to shard
    assert w.sample_trainable_tokens.tolist() == w.train_ds.trainable.tolist()
    assert w.sample_lengths.tolist() == w.train_ds.lengths.tolist()


# --------------------------------------------------------------------------- the one model builder


def test_build_configured_model_loads_weights_and_adapters_and_names_a_misfit(tmp_path):
    import custom_model  # noqa: F401  -- registers tiny_mlp
    cfg = load_config(write_config(tmp_path, tiny_config_dict(tmp_path, actor={
        "model": {"model_type": "tiny_mlp"}, "lora": {"r": 2, "alpha": 4, "target_modules": ["0"]}})))
    plain = build_configured_model(cfg, None)
    trained = {k: v + 1 for k, v in plain.state_dict().items()}
    loaded = build_configured_model(cfg, None, weights=lambda m: trained, where="here")
    assert all(torch.equal(v, trained[k]) for k, v in loaded.state_dict().items())
    with pytest.raises(WeightsLoadError, match="the weights in here do not fit"):
        build_configured_model(cfg, None, weights={"0.weight": trained["0.weight"]}, where="here")

    with_lora = build_configured_model(cfg, None, lora=True, float32=True, device="cpu")
    adapters = {k: torch.ones_like(v) for k, v in with_lora.named_parameters() if v.requires_grad}
    assert adapters and all("lora_" in k for k in adapters)
    loaded = build_configured_model(cfg, None, lora=True, weights=adapters, where="there")
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in adapters.items())
    with pytest.raises(WeightsLoadError, match="the adapters in there do not fit this LoRA model"):
        build_configured_model(cfg, None, lora=True, weights={}, where="there")


@pytest.mark.parametrize("scheduler", ["cosine", "linear", "constant"])
def test_lr_schedule_matches_transformers_after_warmup(scheduler):
    from transformers.optimization import (get_constant_schedule_with_warmup,  # 4.x exports the cosine one here only
                                           get_cosine_with_min_lr_schedule_with_warmup, get_linear_schedule_with_warmup)
    total, warm = 40, 5
    min_ratio = 0.0 if scheduler == "linear" else 0.1
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    reference = {"cosine": lambda: get_cosine_with_min_lr_schedule_with_warmup(opt, warm, total, min_lr_rate=min_ratio),
                 "linear": lambda: get_linear_schedule_with_warmup(opt, warm, total),
                 "constant": lambda: get_constant_schedule_with_warmup(opt, warm)}[scheduler]()
    ref = reference.lr_lambdas[0]
    ours = lr_lambda(total, warm, scheduler, min_ratio)
    for step in range(warm, total + 1):
        assert ours(step) == pytest.approx(ref(step), abs=1e-12), step
    # warmup: never 0 (transformers' first step is lr 0 and trains nothing), rising to the peak
    assert ref(0) == 0 and 0 < ours(0) < ours(warm - 1) < ours(warm) == pytest.approx(1.0)
