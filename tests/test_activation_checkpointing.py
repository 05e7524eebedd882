"""`actor.activation_checkpointing: true` against the same run without it: the gradients of a
global batch are equal (allclose), in one process and under FSDP2 over two, full fine-tuning and
LoRA, while the blocks really recompute (their MLPs run twice per micro-batch instead of once).
Each gradient is that of the second step (after one optimizer step LoRA's B matrices are no longer
zero, so A has gradients too)."""

import pytest
import torch

from stages.core.errors import ConfigError
from stages.runtime.batches import DataPosition
from stages.runtime.worker import SFTWorker
from test_precision import LORA, TWO, gloo_world_of_one, specs_over_prepared_data, torchrun_steps

# Recomputing repeats the same fp32 operations on the same inputs; at most the order in which the
# backward adds partial gradients may change, by a few fp32 ulps (rtol 1e-5 is ~80 ulps).
ATOL, RTOL = 1e-7, 1e-5


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    return specs_over_prepared_data(tmp_path_factory.mktemp("ac"))


def second_step_gradients(spec) -> dict:
    """In one process (gloo, world size 1): what tests/dist/step_check.py saves per spec."""
    w = SFTWorker(spec)
    with gloo_world_of_one():
        w.setup()
        pos = DataPosition()
        first = w.sampler.global_batch(pos)
        w.forward_backward(first)
        w.optimizer_step()
        mlps = [m for name, m in w.model.named_modules() if name.endswith(".mlp")]  # one per block
        calls = [0]

        def count(*_) -> None:
            calls[0] += 1
        for m in mlps:
            m.register_forward_pre_hook(count)
        stats = w.forward_backward(w.sampler.global_batch(w.sampler.advance(pos, len(first))))
        grads = {n: p.grad.detach().clone() for n, p in w.model.named_parameters() if p.grad is not None}
    return {"grads": grads, "stats": stats, "mlp_calls": calls[0], "blocks": len(mlps)}


def assert_same_gradients(with_ac: dict, without: dict, lora: bool) -> None:
    trained = without["grads"]
    assert with_ac["grads"].keys() == trained.keys() and trained
    assert all(("lora_" in n) == lora for n in trained)  # LoRA: the adapters only, A and B
    assert all(g.abs().max() > 0 for g in trained.values())
    for name, g in with_ac["grads"].items():
        torch.testing.assert_close(g, trained[name], atol=ATOL, rtol=RTOL, msg=name)
    assert with_ac["stats"]["loss"] == pytest.approx(without["stats"]["loss"], abs=1e-6)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_one_process_gradients_with_activation_checkpointing_equal_those_without(prepared, lora):
    actor = {"precision": "fp32", **(LORA if lora else {})}
    without = second_step_gradients(prepared(f"ac-off-{lora}", **actor))
    with_ac = second_step_gradients(prepared(f"ac-on-{lora}", activation_checkpointing=True, **actor))
    micro = without["stats"]["micro_batches"]
    assert micro == 2 and without["blocks"] == 4 and without["mlp_calls"] == without["blocks"] * micro
    assert with_ac["mlp_calls"] == 2 * without["mlp_calls"]  # every block recomputed in backward
    assert_same_gradients(with_ac, without, lora)


@pytest.mark.slow
def test_fsdp2_gradients_with_activation_checkpointing_equal_those_without(prepared, tmp_path):
    """FSDP2 over 2 processes (gloo, fp32), full and LoRA, in one torchrun launch; full fine-tuning
    also with each block's weights freed after its forward (GPU's default), so that recomputing
    gathers them again inside backward."""
    specs = {f"{kind}-{ac}": prepared(f"two-ac-{kind}-{ac}", precision="fp32", activation_checkpointing=ac, **TWO,
                                      **(LORA if kind == "lora" else {}))
             for kind in ("full", "lora") for ac in (False, True)}
    specs["full-True-freed"] = prepared("two-ac-full-freed", precision="fp32", activation_checkpointing=True,
                                        reshard_after_forward=True, **TWO)
    runs = torchrun_steps(tmp_path, specs)
    for kind, ac in (("full", "True"), ("lora", "True"), ("full", "True-freed")):
        without, with_ac = runs[f"{kind}-False"], runs[f"{kind}-{ac}"]
        assert without["stats"]["micro_batches"] == 2 and without["mlp_calls"] > 0
        assert with_ac["mlp_calls"] == 2 * without["mlp_calls"], ac
        assert_same_gradients(with_ac, without, kind == "lora")


def test_a_model_that_cannot_recompute_stops_with_one_line_naming_the_key(prepared):
    from custom_model import MLPWorker  # a plain torch model, registered on import
    spec = prepared("ac-mlp", activation_checkpointing=True, model={"model_type": "tiny_mlp"})
    with gloo_world_of_one(), pytest.raises(ConfigError) as stopped:
        MLPWorker(spec).setup()
    assert str(stopped.value).startswith("actor.activation_checkpointing needs a model with ")
    assert "\n" not in str(stopped.value)
