"""The worker contract, in one process (gloo, world size 1): what `get_train_model_output`
returns is what the step divides by (every accepted form read by one adapter, `as_train_output`),
the worker's state is what its class declares, and the LR schedule matches transformers' after warmup."""

import inspect

import numpy as np
import pytest
import torch
import torch.distributed as dist

from conftest import base_model, tiny_config_dict, write_config
from stages.core.config import ConfigError, load_config
from stages.pipeline import plan, run_stage
from stages.runtime.model_types import WeightsLoadError, build_configured_model
from stages.runtime.schedule import lr_lambda
from stages.runtime.worker import SFTWorker, TrainOutput, WorkerSpec, as_train_output


class DoubleCountWorker(SFTWorker):
    """Claims twice the tokens the batch has: the step must divide by what it claims."""

    def get_train_model_output(self, batch):
        loss_sum, n_tokens = super().get_train_model_output(batch)
        return loss_sum, 2 * n_tokens


class MeanLossWorker(SFTWorker):
    """Returns a mean over the micro-batch's trainable tokens (the other documented form)."""

    def get_train_model_output(self, batch):
        loss_sum, n_tokens = super().get_train_model_output(batch)
        return loss_sum / n_tokens


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


def test_a_mean_loss_is_weighted_by_the_datasets_trainable_counts(one_process, spec):
    base_row, base = _step(SFTWorker, spec)
    row, grads = _step(MeanLossWorker, spec)
    assert row["loss"] == pytest.approx(base_row["loss"], rel=1e-6)
    for name, g in base.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-7)


class OwnLossWorker(SFTWorker):
    """Computes its loss without the base class's output (so without its KL term)."""

    def get_train_model_output(self, batch):
        return self._token_loss_sum(batch)


def test_kl_to_base_with_an_output_that_adds_no_kl_stops_with_one_line(one_process, tmp_path):
    actor = {"nproc_per_node": 1, "lora": {"r": 4, "alpha": 8}, "kl_to_base": 0.5}
    cfg = load_config(write_config(tmp_path, tiny_config_dict(tmp_path, actor=actor)))
    p = plan(cfg)
    run_stage(p, "prepare")
    spec = WorkerSpec(config=cfg, model_path=base_model(cfg), out_dir=str(tmp_path / "out"),
                      train_dir=str(p.folder("prepare") / "train"), val_dir=None)
    row, _ = _step(SFTWorker, spec)  # the base class's output adds it
    assert row["kl"] == 0.0  # fresh adapters (B = 0): the tuned model is the base model
    with pytest.raises(ConfigError, match="OwnLossWorker.get_train_model_output adds no KL term"):
        _step(OwnLossWorker, spec)


def test_for_eval_wraps_a_loaded_model_without_a_process_group(spec):
    model = torch.nn.Linear(2, 2)
    w = SFTWorker.for_eval(spec, model, torch.device("cpu"), rank=0, world=1)
    assert w.model is model and not w.fsdp and w.precision == "fp32" and w.tokenizer is not None
    assert len(w.build_dataset(spec.train_dir)) == len(w.build_dataloader(spec.train_dir)) > 0
    assert not dist.is_initialized()
    assert set(vars(w)) <= declared_attributes(SFTWorker)


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


# --------------------------------------------------------------------------- get_train_model_output's forms


LOSS = torch.tensor(6.0, requires_grad=True)  # a loss sum over 3 tokens
MEAN = torch.tensor(2.0, requires_grad=True)  # a mean loss; the dataset counts 4 trainable tokens
ACCEPTED = {
    "TrainOutput": (TrainOutput(LOSS, 3), LOSS, 3.0),
    "(loss_sum, int)": ((LOSS, 3), LOSS, 3.0),
    "[loss_sum, int]": ([LOSS, 3], LOSS, 3.0),
    "(loss_sum, float)": ((LOSS, 3.0), LOSS, 3.0),
    "(loss_sum, integer tensor)": ((LOSS, torch.tensor(3)), LOSS, 3.0),
    "a mean tensor": (MEAN, MEAN * 4, 4.0),
    "a list of mean tensors": ([MEAN, MEAN / 2], MEAN * 1.5 * 4, 4.0),
    "a pair of floating tensors (summed)": ((MEAN, MEAN / 2), MEAN * 1.5 * 4, 4.0),
    "a 1-tuple": ((MEAN,), MEAN * 4, 4.0),
}


@pytest.mark.parametrize("form", list(ACCEPTED))
def test_every_accepted_form_maps_to_a_train_output(form):
    out, loss_sum, n_tokens = ACCEPTED[form]
    got = as_train_output(out, 4.0, "MyWorker.get_train_model_output")
    assert isinstance(got, TrainOutput) and type(got.n_tokens) is float and got.n_tokens == n_tokens
    assert torch.equal(got.loss_sum, loss_sum) and got.loss_sum.requires_grad
    if loss_sum is LOSS:  # a loss sum passes through untouched: the same tensor, the same graph
        assert got.loss_sum is LOSS


@pytest.mark.parametrize("out", [{"loss": LOSS}, 3.0, None, (), (1.0, 2.0), "loss"],
                         ids=["dict", "float", "None", "empty tuple", "tuple of numbers", "str"])
def test_an_unsupported_form_is_a_type_error_naming_the_method(out):
    with pytest.raises(TypeError, match=r"^MyWorker\.get_train_model_output returned \w+; expected a TrainOutput, "
                                        r"\(loss_sum, n_tokens\), a tensor"):
        as_train_output(out, 4.0, "MyWorker.get_train_model_output")


def test_a_train_output_unpacks_and_indexes_as_the_tuple_it_replaces():
    loss_sum, n_tokens = TrainOutput(LOSS, 3)
    assert loss_sum is LOSS and n_tokens == 3
    assert TrainOutput(LOSS, 3)[0] is LOSS and TrainOutput(LOSS, 3)[1] == 3


class DictOutputWorker(SFTWorker):
    def get_train_model_output(self, batch):
        return {"loss": super().get_train_model_output(batch).loss_sum}


def test_the_loop_names_the_subclass_whose_output_it_cant_read(one_process, spec):
    with pytest.raises(TypeError, match=r"DictOutputWorker\.get_train_model_output returned dict"):
        _step(DictOutputWorker, spec)


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
    from transformers import (get_constant_schedule_with_warmup, get_cosine_with_min_lr_schedule_with_warmup,
                              get_linear_schedule_with_warmup)
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
