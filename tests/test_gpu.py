"""The GPU road (`pytest -m gpu`; every test skips without CUDA; bench/gpu_check.py runs them on a
GPU machine): the train stage on nccl with one process in bf16 end to end against its fp32 run,
packed == unpacked logits under every CUDA attention kernel this machine has, and batched
generation on CUDA equal to one prompt at a time. References are independent of the code under
test: the fp32 run, each sample's own unpacked forward, unbatched generation."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, base_model, demo_rows, tiny_config_dict, write_config
from stages.core.config import load_config
from stages.planning.attention import available_attn_implementations

CUDA = torch.cuda.is_available()
# SFTFLOW_GPU_TESTS_ON_CPU=1 runs the GPU tests on the CPU (gloo, bf16 asked for explicitly): a check
# of the tests themselves on a machine without a GPU; the kernels then are the CPU's
ON_CPU = not CUDA and os.environ.get("SFTFLOW_GPU_TESTS_ON_CPU") == "1"
DEVICE = "cuda" if CUDA else "cpu"


def needs_cuda(fn):
    return pytest.mark.gpu(pytest.mark.skipif(not (CUDA or ON_CPU), reason="needs CUDA")(fn))


RUN = {"max_epochs": 1, "max_steps": 4, "save_interval": 4, "val_check_interval": 0}
ONE = {"nproc_per_node": 1, "micro_batch_size": 4, "global_batch_size": 8, "optim": {"lr": 1e-3, "warmup": 1}}
# bf16 keeps 8 significant bits: losses near ln(vocab) ~ 6 round to multiples of 2^-5. Summed in fp32
# from bf16 logits over 4 steps they stay within a bf16 step of the fp32 run (tests/test_precision.py
# holds half a step on CPU; GPU kernels may round differently, hence a whole one).
BF16_LOSS_ATOL = 2 ** -5
# logits of the small random models below are ~0.6 at most: bf16 rounds them to ~2e-3, a few
# roundings through two layers stay under 2e-2, while a kernel that leaks across samples moves
# them by ~1e-1 (tests/test_attention.py measures that on CPU)
BF16_LOGIT_TOL = 2e-2
FP32_LOGIT_TOL = 1e-4


def train(tmp: Path, **actor) -> tuple[Path, list[dict]]:
    from stages.pipeline import plan, run_stage
    cfg = load_config(write_config(tmp, tiny_config_dict(tmp, n_train=48, n_val=4, runner=RUN,
                                                         actor={**ONE, **actor})))
    p = plan(cfg)
    run_stage(p, "prepare")
    folder = Path(run_stage(p, "train", on_line=lambda line: None).path)
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return folder, rows


@needs_cuda
def test_one_process_on_nccl_trains_bf16_end_to_end_within_bf16_rounding_of_fp32(tmp_path):
    (tmp_path / "bf16").mkdir()
    (tmp_path / "fp32").mkdir()
    folder, bf16 = train(tmp_path / "bf16", **({} if CUDA else {"precision": "bf16"}))  # auto: bf16 on CUDA
    log = (folder / "train.log").read_text()
    runtime = json.loads((folder / "runtime.json").read_text())
    assert "precision bf16: auto, compute capability" in log and f"device {DEVICE}" in log, log[-2000:]
    assert runtime["device"] == DEVICE and runtime["precision"] == "bf16" and runtime["world_size"] == 1
    assert runtime["packing"] is True  # the kernel kept packed samples apart in the worker's own check
    assert runtime["attn_implementation"] in available_attn_implementations(DEVICE)
    assert f"attention {runtime['attn_implementation']}" in log
    if CUDA:  # the fastest kernel that keeps packed samples apart (stages/planning/attention.py)
        best = [i for i in ("flash_attention_3", "flash_attention_2", "flex_attention")
                if i in available_attn_implementations("cuda")]
        assert runtime["attn_implementation"] == best[0]
    _, fp32 = train(tmp_path / "fp32", precision="fp32")
    assert [r["step"] for r in bf16] == [1, 2, 3, 4]
    for a, b in zip(bf16, fp32):
        assert math.isfinite(a["loss"]) and abs(a["loss"] - b["loss"]) <= BF16_LOSS_ATOL, (bf16, fp32)
    from stages.runtime.worker import PEAK_FLOPS
    if CUDA and any(k in torch.cuda.get_device_name() for k in PEAK_FLOPS):  # a device of known peak reports MFU
        assert 0 < bf16[-1]["mfu"] < 1


def cuda_cases() -> list:
    cases = []
    for impl in available_attn_implementations(DEVICE):
        if impl == "flex_attention" and not CUDA:
            continue  # compiles for a minute on a CPU; tests/test_attention.py holds it there (slow tier)
        for dtype in (torch.float32, torch.bfloat16):
            if impl.startswith("flash") and dtype == torch.float32:
                continue  # flash kernels take half precision only
            cases.append(pytest.param(impl, dtype, id=f"{impl}-{str(dtype)[6:]}"))
    return cases


@needs_cuda
@pytest.mark.parametrize("impl,dtype", cuda_cases())
def test_packed_logits_equal_unpacked_on_cuda_kernels(impl, dtype):
    from test_attention import llama_config, packed_gap, random_model, samples
    model = random_model(llama_config, impl, device=DEVICE, dtype=dtype)
    assert model.config._attn_implementation == impl
    tol = FP32_LOGIT_TOL if dtype == torch.float32 else BF16_LOGIT_TOL
    assert packed_gap(model, samples(211)) < tol


def one_generate_per_prompt(model, tok, prompts, max_new_tokens: int) -> list[str]:
    """The independent reference: a plain `model.generate` per prompt (no batch, no padding), greedy,
    cut at the same stop tokens."""
    from stages.inference.generation import stop_ids
    stops, out = stop_ids(model, tok), []
    for p in prompts:
        enc = tok(tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True), add_special_tokens=False,
                  return_tensors="pt").to(model.device)
        with torch.no_grad():
            row = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=stops,
                                 pad_token_id=tok.pad_token_id)[0, enc["input_ids"].shape[1]:].tolist()
        n = next((k for k, t in enumerate(row) if t in stops), len(row))
        out.append(tok.decode(row[:n], skip_special_tokens=True))
    return out


@needs_cuda
def test_the_stages_generation_on_cuda_against_one_generate_per_prompt(tmp_path):
    """The evaluate stage's decode (batches of 6 over 24 prompts: rows leave, freed slots refill, the
    system prompt shared) against one plain `model.generate` per prompt, on this device: in fp32 (what
    `eval.precision` defaults to) every reply equals the reference; in the device's own precision (bf16
    where native) the share that differs is measured and reported (bench/gpu_check.py prints it;
    docs/evaluation.md has the CPU's), never asserted: bf16 rounding follows the batch."""
    from stages.core.machine.precision import on_device
    from stages.inference.generation import generate, load
    cfg = load_config(write_config(tmp_path, tiny_config_dict(tmp_path, n_train=24, n_val=4)))
    system = {"role": "system", "content": "You are a helpful assistant. Answer in one short sentence."}
    prompts = [[system, *r["messages"][:1]] for r in demo_rows("eval.jsonl", 24)]
    report = {}
    native = on_device("auto", torch.device(DEVICE))
    for precision in dict.fromkeys(["fp32", native if CUDA else "bf16"]):  # on CPU (ON_CPU): bf16 asked for
        model, tok = load(base_model(cfg), device=DEVICE, precision=precision)
        want = one_generate_per_prompt(model, tok, prompts, 16)
        got = [r["text"] for r in generate(model, tok, prompts, max_new_tokens=16, batch_size=6)]
        report[precision] = {"differ": sum(a != b for a, b in zip(got, want)), "total": len(prompts)}
        if precision == "fp32":
            assert got == want
    out = os.environ.get("SFTFLOW_GPU_CHECK_OUT")
    if out:
        Path(out, "generation.json").write_text(json.dumps({"device": DEVICE, **report}))
    print(f"generation vs one model.generate per prompt on {DEVICE}: {report}")


# --------------------------------------------------------------------------- bench/gpu_check.py on CPU


def gpu_check(tmp: Path, *extra: str) -> tuple[int, dict, str]:
    import subprocess
    # a generous budget: the script cuts each part's timeout from it, and a loaded 2-core CI is slow
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--dry-run", "--budget", "1200",
                           "--out", str(tmp), *extra], cwd=ROOT, capture_output=True, text=True, timeout=1500)
    return proc.returncode, json.loads((tmp / "gpu_check.json").read_text()), proc.stdout + proc.stderr


def test_gpu_check_dry_run_runs_the_tests_and_a_bench_into_one_table(tmp_path):
    """The CPU dry path of the device script: the same parts (pytest -m gpu, then the bench through
    its --shape and --methods), here with the bare loops only (no torchrun) and without the demo's
    stages (bench/gpu_demo.py: the demo test's road without Prefect): seconds."""
    code, result, out = gpu_check(tmp_path, "--methods", "bare-packed,bare-packed-ckpt", "--skip-demo")
    assert code == 0, out[-4000:]
    assert [p["part"] for p in result["parts"]] == ["pytest -m gpu", "bench tiny"]
    assert all(p["status"] == "ok" for p in result["parts"]), result["parts"]
    assert result["head"][:2] == ["shape", "method"] and "peak memory" in result["head"] and "MFU" in result["head"]
    names = [r[1] for r in result["rows"]]
    assert names == ["bare loop (packed)", "bare loop (packed, activation checkpointing)"]
    col = result["head"].index("peak memory")
    assert all(r[col].endswith(("MiB", "GiB")) for r in result["rows"])
    # same samples, same seed: recomputing activations changes no loss beyond fp32 rounding
    assert float(result["rows"][1][result["head"].index("max |dloss|")]) < 1e-6
    assert (tmp_path / "gpu_check.md").read_text().count("| tiny |") == 2


# The whole matrix on CPU (`python bench/gpu_check.py --dry-run`, ~1.5 min) is not a test: its worker rows
# run the same torchrun worker the train-stage tests run, and the table code is the one above.


def test_gpu_check_refuses_to_run_as_a_gpu_check_without_cuda(tmp_path):
    if CUDA:
        pytest.skip("this machine has CUDA")
    import subprocess
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "use --dry-run" in proc.stderr


@needs_cuda
@pytest.mark.parametrize("kind", ["nf4", "q4_1"])
def test_qlora_peak_memory_against_the_plan(tmp_path, kind):
    """QLoRA (nf4 or q4_1, LoRA r 16 all-linear) on a SmolLM2-135M-shaped model (4 of its layers, random
    init) through the real worker: the CUDA allocator's peak over 3 steps against the memory plan's total
    at the prepared data's longest micro-batch. Written to $SFTFLOW_GPU_CHECK_OUT/qlora_peak_<kind>.json
    for bench/gpu_check.py's table. On CPU (SFTFLOW_GPU_TESTS_ON_CPU) the same path runs (bf16, FSDP2 on
    one rank, as on one GPU); no peak to compare."""
    import subprocess

    from stages.core.config import config_from_dict
    from stages.pipeline import plan, run_stage
    from stages.planning import memory_plan as mp
    from test_memory_plan import long_rows, smollm2_shaped
    from conftest import write_jsonl
    from stages.runtime.worker import WorkerSpec
    raw = tiny_config_dict(tmp_path, actor={"nproc_per_node": 1, "micro_batch_size": 2, "global_batch_size": 4,
                                            "lora": {"r": 16, "alpha": 32, "quantize": kind},
                                            **({} if CUDA else {"precision": "bf16"})},
                           data={"max_length": 384, "truncation": "keep_start"})
    tok = base_model(load_config(write_config(tmp_path, raw)))
    raw["actor"]["model"] = {"model_type": "causal_lm", "model_path": smollm2_shaped(tmp_path, tok)}
    raw["data"]["train_data_paths"] = [str(write_jsonl(tmp_path / "long.jsonl", long_rows(24)))]
    cfg = config_from_dict(raw)
    p = plan(cfg)
    run_stage(p, "prepare", on_line=lambda _: None)
    (tmp_path / "out").mkdir()
    WorkerSpec(config=cfg, model_path=cfg.actor.model.model_path, out_dir=str(tmp_path / "out"),
               train_dir=str(p.folder("prepare") / "train")).write(tmp_path / "spec.json")
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "dist" / "qlora_peak.py"), str(tmp_path / "spec.json")],
                       env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["base"].startswith("QLoRA: 28 base weights 4-bit"), got["base"]  # 7 linears x 4 layers
    hf = json.loads((Path(cfg.actor.model.model_path) / "config.json").read_text())
    lengths = mp.prepared_lengths(p.folder("prepare") / "train")
    device = mp.visible_device() if CUDA else mp.Device("cpu", "CPU", 0)
    planned = mp.for_config(cfg, hf, device, lengths)
    result = {"planned": planned.total, "measured": got["peak"], "device": got["device"],
              "precision": got["precision"], "attn": got["attn"], "base": got["base"]}
    if os.environ.get("SFTFLOW_GPU_CHECK_OUT"):
        Path(os.environ["SFTFLOW_GPU_CHECK_OUT"], f"qlora_peak_{kind}.json").write_text(json.dumps(result))
    if CUDA:
        assert got["peak"] <= planned.total * mp.MARGIN, result
        assert got["peak"] >= planned.total * 0.5, result
