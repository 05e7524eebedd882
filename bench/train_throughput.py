"""Training throughput: sftflow's worker against a bare PyTorch loop, packed and padded.

    .venv/bin/python bench/train_throughput.py               # defaults: ~1.5 minutes on 2 CPU cores
    .venv/bin/python bench/train_throughput.py --repeat 2    # steadier numbers on a busy machine
    .venv/bin/python bench/train_throughput.py --nproc 2 --global-batch 32 --micro-batch 4
    .venv/bin/python bench/train_throughput.py --model smollm2 [--lora 16] --steps 4 --global-batch 8 --micro-batch 4
    .venv/bin/python bench/train_throughput.py --model smollm2 --data quickstart --lora 16 --nproc 1,2 \
        --global-batch 16 --micro-batch 4 --artifacts artifacts --no-worker-padded
                                             # the quickstart's topology question: its own rows (identity
                                             # conversations + the replay stage's answers), LoRA r=16, the
                                             # worker on 1 and on 2 processes, against the bare loop and TRL
                                             # the real model (SmolLM2-135M-Instruct, as the second quickstart
                                             # fetches it); --lora R: LoRA on every side, else full fine-tuning
    .venv/bin/python bench/train_throughput.py --shape smollm2-135m --activation-checkpointing \
        --methods worker-packed,bare-packed
                                             # a model of that shape built from its transformers config, random
                                             # init (smollm2-135m: Llama dims of SmolLM2-135M; 0.5b: Qwen2-0.5B's;
                                             # tiny: seconds), the builtin tokenizer's ids (all < its vocab);
                                             # with and without activation checkpointing
    .venv/bin/python bench/gpu_check.py      # the whole GPU check (tests + this bench, both shapes), see there

The same model (the builtin tiny Qwen2) is trained on the same global batches (same sample
indices per step, from `GlobalBatchSampler` with the same seed) in up to six ways:

  * sftflow worker (packed)  `SFTWorker` under torchrun with `actor.packing: true`: FSDP2,
                             token-balanced ranks, gradient accumulation, clipping, LR schedule.
  * sftflow worker (padded)  the same with `actor.packing: false` (skip with --no-worker-padded).
  * ..., reshard_after_forward   with --nproc > 1: the packed worker with FSDP2 freeing each
                             layer's gathered weights after forward (GPU's default) instead of
                             keeping them through the step (CPU's default).
  * bare loop (packed)       the ceiling: a plain `AutoModelForCausalLM`, no FSDP, micro-batches
                             concatenated by `collate_packed`, summed cross-entropy / trainable
                             tokens of the step, AdamW.
  * bare loop (padded)       the same with `collate_padded` (right padding + attention_mask).
  * TRL SFTTrainer (padded)  the peer users would otherwise pick, when `trl` is installed: the
                             same tokenized rows and masks in the same micro-batches, the same
                             optimizer, schedule and clipping, TRL's own collator and loop.

On CUDA (detected) every method runs on the GPU in bf16 (the worker as `actor.precision: auto`
picks it, the bare loops under `torch.autocast(bf16)` over fp32 weights: the same mixed precision)
with the attention kernel `actor.attn_implementation: auto` resolves (`--attn` overrides; CPU: the
model's default), and the table adds MFU (6 x parameters x tokens/s over the GPU's dense bf16 peak,
`PEAK_FLOPS` of stages/runtime/worker.py). Every method runs in a process of its own, so its peak
memory is its own: `torch.cuda.max_memory_allocated` on a GPU, else the peak RSS
(`getrusage(RUSAGE_SELF).ru_maxrss`, the largest over the ranks; it includes the ~0.5 GB that Python,
torch and transformers take before the model is built).

Throughput is real (non-pad) tokens per second: the tokens of the timed steps divided by the
wall time of their data fetch + collate + forward + backward + optimizer step, after
`--warmup` untimed steps. Both sides run the same number of CPU threads (torchrun ranks x
OMP_NUM_THREADS from `stages.launch.launcher.worker_env`). The per-step losses of every
method are compared with the bare packed loop's as a check that all do the same math.

Data: synthetic, length-skewed chat rows (most replies a few dozen tokens, ~10% of them 10-30x
longer), prepared by sftflow's own prepare stage in a temporary folder; nothing is downloaded.
`--data` trains on rows of your own instead (messages JSONL files, cycled to cover the steps);
`--data quickstart` on the SmolLM2 quickstart's: its identity conversations and the replay stage's
answers (run `sftflow stage replay -c configs/examples/smollm2-identity.yaml` first).
On a shared machine another process can slow one method and not the next (a single round has
swung sftflow's ratio from 0.5x to 0.9x on 2 busy cores): `--repeat 2` interleaves the methods
and keeps each one's fastest round, for about twice the time.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a file (also under torchrun): `stages` lives at the repo root
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from stages.runtime.loss import IGNORE_INDEX  # noqa: E402
from stages.runtime.batches import DataPosition, GlobalBatchSampler, collate_packed, collate_padded  # noqa: E402
from stages.core.machine.topology import auto_nproc  # noqa: E402

BARE = "bare loop (packed)"
CUDA = torch.cuda.is_available()

# Shapes built from a transformers config with random init (--shape): the dimensions of real models,
# so FLOPs, memory and kernel shapes are theirs; the weights don't matter to throughput.
SHAPES = {
    "tiny": ("llama", {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                       "num_key_value_heads": 2, "vocab_size": 2048, "max_position_embeddings": 4096}),
    "smollm2-135m": ("llama", {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                               "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
                               "max_position_embeddings": 8192, "rope_theta": 100000.0, "rms_norm_eps": 1e-5,
                               "tie_word_embeddings": True}),
    "0.5b": ("qwen2", {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                       "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
                       "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                       "tie_word_embeddings": True}),
}


# --------------------------------------------------------------------------- synthetic data


def synthetic_rows(n: int, seed: int, scale: int = 1) -> list[dict]:
    """Chat rows over a Zipf-distributed pseudo-word vocabulary, so the BPE tokenizer the builtin
    model trains on this corpus learns real merges and a word costs about one token."""
    rng = np.random.default_rng(seed)
    syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
    vocab = sorted({"".join(rng.choice(syllables, rng.integers(1, 4))) for _ in range(600)})
    weights = 1.0 / np.arange(1, len(vocab) + 1)
    weights /= weights.sum()

    def text(n_words: int) -> str:
        words = rng.choice(vocab, n_words, p=weights)
        return " ".join(w + ("." if k % 10 == 9 else "") for k, w in enumerate(words))

    rows = []
    for _ in range(n):
        reply = int(np.clip(rng.lognormal(np.log(12), 0.5), 3, 40))
        if rng.random() < 0.1:  # the long tail that padding pays for
            reply = int(reply * rng.uniform(10, 30))
        reply = min(reply, 380) * scale  # the builtin model has 512 positions; shapes have thousands
        rows.append({"messages": [{"role": "user", "content": text(int(rng.integers(4, 16)))},
                                  {"role": "assistant", "content": text(reply)}]})
    return rows


def own_rows(args, n: int) -> tuple[list[dict], int | None]:
    """(`--data`'s rows cycled to n, the max_length they were written for: the quickstart's, else None)."""
    max_length = None
    if args.data == "quickstart":
        import yaml
        from stages.core.config import load_config
        from stages.pipeline import plan, replay_file
        config = ROOT / "configs" / "examples" / "smollm2-identity.yaml"
        overrides = [f"artifacts_dir={args.artifacts}"] if args.artifacts else []
        replayed = replay_file(plan(load_config(config, overrides)))
        if replayed is None:
            raise SystemExit("--data quickstart: the replay stage has not run in that artifacts folder; run "
                             f"`sftflow stage replay -c {config.relative_to(ROOT)}` (and pass --artifacts) first")
        paths = [str(ROOT / "data" / "smollm2-identity" / "train.jsonl"), replayed]
        max_length = yaml.safe_load(config.read_text())["data"]["max_length"]
    else:
        paths = [p for p in args.data.split(",") if p]
    rows = [json.loads(line) for path in paths for line in Path(path).read_text().splitlines() if line.strip()]
    if not rows:
        raise SystemExit(f"--data: no rows in {paths}")
    rng = np.random.default_rng(args.seed)
    order = np.concatenate([rng.permutation(len(rows)) for _ in range(-(-n // len(rows)))])[:n]
    return [rows[i] for i in order], max_length


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def prepare(tmp: Path, args) -> tuple:
    """A config, the builtin model's path and the prepared train shards, all under `tmp`."""
    from stages.core.config import config_from_dict
    from stages.models.base import resolve_model
    from stages.pipeline import plan, run_stage

    n_rows = int((args.warmup + args.steps) * args.global_batch * 1.05) + 1  # one epoch covers every step
    rows, max_length = (own_rows(args, n_rows) if args.data
                        else (synthetic_rows(n_rows, args.seed, args.seq_scale), None))
    model = {}
    if args.model == "smollm2":  # the quickstart's model and source, fetched and converted once (see --artifacts)
        import yaml
        quick = yaml.safe_load((ROOT / "configs" / "examples" / "smollm2-identity.yaml").read_text())["actor"]["model"]
        model = {"model_path": quick["model_path"], "model_sha256": quick["model_sha256"]}
    elif args.model:
        model = {"model_path": args.model}
    cfg = config_from_dict({
        "artifacts_dir": str(args.artifacts or tmp / "artifacts"),
        "runner": {"max_epochs": 1, "max_steps": args.warmup + args.steps, "val_check_interval": 0,
                   "save_interval": 0, "seed": args.seed, "resume": "never"},
        "actor": {"nproc_per_node": args.nprocs[0], "micro_batch_size": args.micro_batch,
                  "global_batch_size": args.global_batch, "packing": True, "model": model,
                  "lora": {"r": args.lora, "alpha": 2 * args.lora} if args.lora else {}},
        "data": {"train_data_paths": [write_jsonl(tmp / "train.jsonl", rows)],
                 "val_data_paths": [write_jsonl(tmp / "val.jsonl", synthetic_rows(8, args.seed + 1))],
                 # 512 = the builtin model's max_position_embeddings; a real tokenizer spends more tokens per word
                 "format": "messages",
                 "max_length": max_length or (2048 if args.model else 512 * args.seq_scale)},
    })
    p = plan(cfg)
    run_stage(p, "prepare")
    model_path = resolve_model(cfg, p.fingerprints["models"])
    if args.shape:  # the builtin's tokenizer (its ids are all below the shape's vocabulary) on a model of that shape
        model_path = shaped_model(model_path, args.shape, tmp / f"shape-{args.shape}", args.seed)
    return cfg, model_path, p.folder("prepare") / "train"


def shaped_model(tokenizer_path: str, shape: str, dest: Path, seed: int) -> str:
    """A Hugging Face folder: a randomly initialized model of `shape` (SHAPES) and the tokenizer of
    `tokenizer_path`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, Qwen2Config

    kind, dims = SHAPES[shape]
    tok = AutoTokenizer.from_pretrained(tokenizer_path)
    if len(tok) > dims["vocab_size"]:
        raise SystemExit(f"--shape {shape}: the tokenizer has {len(tok)} tokens, more than the shape's vocabulary")
    config = (LlamaConfig if kind == "llama" else Qwen2Config)(
        **dims, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(dest, safe_serialization=True)
    tok.save_pretrained(dest)
    return str(dest)


def peak_memory(device: torch.device) -> int:
    """Bytes: the CUDA caching allocator's peak on a GPU, else this process's peak RSS (Linux: KiB)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_flops() -> float | None:
    from stages.runtime.worker import PEAK_FLOPS
    name = torch.cuda.get_device_name() if CUDA else ""
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)


# --------------------------------------------------------------------------- sftflow worker (torchrun)


def run_worker(cfg, model_path: str, shards: Path, tmp: Path, args, packing: bool, env: dict,
               reshard_after_forward: bool | None = None, ckpt: bool = False, nproc: int = 1) -> dict:
    cfg = cfg.model_copy(deep=True)
    cfg.actor.nproc_per_node = nproc
    cfg.actor.packing = packing
    cfg.actor.reshard_after_forward = reshard_after_forward
    cfg.actor.activation_checkpointing = ckpt
    cfg.actor.attn_implementation = args.attn
    name = (("packed" if packing else "padded") + ("-freed" if reshard_after_forward else "")
            + ("-ckpt" if ckpt else "") + f"-{nproc}")
    job = {"warmup": args.warmup, "steps": args.steps,
           "spec": {"config": cfg.model_dump(mode="json"), "model_path": model_path,
                    "out_dir": str(tmp / f"worker-{name}"), "train_dir": str(shards), "val_dir": None}}
    job_path, out_path = tmp / f"job-{name}.json", tmp / f"result-{name}.json"
    job_path.write_text(json.dumps(job))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(Path(__file__).resolve()), "--worker-mode", str(job_path), str(out_path)]
    return run_child(cmd, env, out_path, f"worker ({name})")


def run_child(cmd: list[str], env: dict, out_path: Path, name: str) -> dict:
    """One method in processes of its own (its peak memory is its own); its result JSON."""
    from stages.launch.launcher import kill_group

    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=600)
    except BaseException:  # timeout or Ctrl-C: torchrun's workers live in sessions of their own
        kill_group(proc)
        raise
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed with exit code {proc.returncode}:\n{output[-4000:]}")
    return json.loads(out_path.read_text())


def worker_mode(job_path: str, out_path: str) -> None:
    """One torchrun rank: the worker's own setup and step methods, timed the way the bare loops are."""
    import torch.distributed as dist
    from stages.runtime.worker import SFTWorker

    job = json.loads(Path(job_path).read_text())
    worker = SFTWorker(job["spec"])
    worker.setup()
    pos, tokens, seconds, losses = DataPosition(), 0, 0.0, []
    cuda = worker.device.type == "cuda"
    for step in range(job["warmup"] + job["steps"]):
        batch_idx = worker.sampler.global_batch(pos)
        t0 = time.perf_counter()
        row = worker.forward_backward(batch_idx)
        worker.optimizer_step()
        if cuda:  # the step's kernels done, not only queued
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        pos = worker.sampler.advance(pos, len(batch_idx))
        losses.append(row["loss"])
        if step >= job["warmup"]:
            tokens, seconds = tokens + row["tokens"], seconds + dt
    peak = torch.tensor([float(peak_memory(worker.device))], device=worker.device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if worker.rank == 0:
        Path(out_path).write_text(json.dumps({
            "tokens": tokens, "seconds": seconds, "losses": losses, "packing": worker.packing,
            "threads": torch.get_num_threads() * worker.world, "world": worker.world, "peak_bytes": int(peak.item()),
            "n_params": worker.n_params, "precision": worker.precision, "attn": worker.attn_implementation,
            "device": worker.device.type}))
    dist.destroy_process_group()


# --------------------------------------------------------------------------- bare PyTorch loop


def reference_model(cfg, model_path: str, total_steps: int, device: torch.device | None = None,
                    attn_implementation: str | None = None, ckpt: bool = False):
    """(model, trainable params, AdamW, LR schedule) as a plain PyTorch user builds them (peft's own
    wrapping for LoRA), seeded like the worker: the bare loops and TRL start from the same state."""
    from transformers import AutoModelForCausalLM
    from stages.runtime.schedule import lr_lambda

    torch.manual_seed(cfg.runner.seed)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32,
                                                 attn_implementation=attn_implementation)
    if device is not None:
        model.to(device)
    if ckpt:  # transformers 5.24 renamed gradient_checkpointing_enable (the old name warns)
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg.actor.lora.r > 0:
        from peft import LoraConfig, get_peft_model
        lo = cfg.actor.lora
        model = get_peft_model(model, LoraConfig(r=lo.r, lora_alpha=lo.alpha, target_modules=lo.target_modules,
                                                 task_type="CAUSAL_LM"))
    o = cfg.actor.optim
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=o.lr, betas=o.betas, weight_decay=o.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer,
                                                  lr_lambda(total_steps, o.warmup, o.scheduler, o.min_lr_ratio))
    return model, trainable, optimizer, scheduler


def run_bare(cfg, model_path: str, ds, pad_id: int, args, packed: bool, ckpt: bool = False) -> dict:
    """The ceiling: no FSDP, no collectives, no hooks. Same micro-batches (the sampler's
    longest-first order, world size 1), same loss normalization, clipping and LR schedule as
    the worker, so the losses must match it step for step."""
    from stages.planning.attention import resolve_attn_implementation

    total = args.warmup + args.steps
    device = torch.device("cuda" if CUDA else "cpu")
    attn = resolve_attn_implementation(args.attn, device.type, packed, "bf16" if CUDA else "fp32")
    model, trainable, optimizer, scheduler = reference_model(cfg, model_path, total, device, attn, ckpt)
    model.train()
    # bf16 compute over fp32 weights, gradients and AdamW state on a GPU, as the worker's FSDP2 policy
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=CUDA)
    o = cfg.actor.optim
    # the worker's micro-batch grouping: interleaved when packed, contiguous (least padding) when padded
    sampler = GlobalBatchSampler(ds.lengths, args.global_batch, args.micro_batch, 1, cfg.runner.seed, interleave=packed)
    pos, tokens, seconds, losses = DataPosition(), 0, 0.0, []
    for step in range(total):
        batch_idx = sampler.global_batch(pos)
        t0 = time.perf_counter()
        n_trainable = max(float(ds.trainable[batch_idx].sum()), 1.0)
        loss_sum = 0.0
        for idx in sampler.rank_micro_batches(batch_idx, 0):
            samples = [ds[int(i)] for i in idx]
            batch = collate_packed(samples) if packed else collate_padded(samples, pad_id)
            batch = {k: v.to(device) for k, v in batch.items()}
            labels = batch.pop("labels")[:, 1:]
            with autocast:
                logits = model(**batch, use_cache=False).logits
            ls = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.size(-1)), labels.reshape(-1),
                                 ignore_index=IGNORE_INDEX, reduction="sum")
            (ls / n_trainable).backward()
            loss_sum += ls.item()
        torch.nn.utils.clip_grad_norm_(trainable, o.clip_grad if o.clip_grad > 0 else float("inf"))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if CUDA:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        pos = sampler.advance(pos, len(batch_idx))
        losses.append(loss_sum / n_trainable)
        if step >= args.warmup:
            tokens, seconds = tokens + int(ds.lengths[batch_idx].sum()), seconds + dt
    return {"tokens": tokens, "seconds": seconds, "losses": losses, "threads": torch.get_num_threads(), "world": 1,
            "peak_bytes": peak_memory(device), "n_params": sum(p.numel() for p in model.parameters()),
            "precision": "bf16" if CUDA else "fp32", "attn": model.config._attn_implementation, "device": device.type}


def run_bare_child(cfg, model_path: str, shards: Path, pad_id: int, tmp: Path, args, kind: str, packed: bool,
                   ckpt: bool, threads: int) -> dict:
    """`run_bare` / `run_trl` in a process of its own (`--bare-mode`)."""
    name = f"{kind}-{'packed' if packed else 'padded'}{'-ckpt' if ckpt else ''}"
    job = {"config": cfg.model_dump(mode="json"), "model_path": model_path, "shards": str(shards), "pad_id": pad_id,
           "kind": kind, "packed": packed, "ckpt": ckpt, "threads": threads,
           "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    job_path, out_path = tmp / f"job-{name}.json", tmp / f"result-{name}.json"
    job_path.write_text(json.dumps(job))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--bare-mode", str(job_path), str(out_path)]
    return run_child(cmd, dict(os.environ), out_path, name)


def bare_mode(job_path: str, out_path: str) -> None:
    from stages.core.config import SFTConfig
    from stages.runtime.batches import SFTDataset

    job = json.loads(Path(job_path).read_text())
    torch.set_num_threads(job["threads"])
    cfg, args, ds = (SFTConfig.model_validate(job["config"]), argparse.Namespace(**job["args"]),
                     SFTDataset(job["shards"]))
    if job["kind"] == "trl":
        r = run_trl(cfg, job["model_path"], ds, job["pad_id"], args)
    else:
        r = run_bare(cfg, job["model_path"], ds, job["pad_id"], args, job["packed"], job["ckpt"])
    Path(out_path).write_text(json.dumps(r))


def run_trl(cfg, model_path: str, ds, pad_id: int, args) -> dict:
    """TRL's SFTTrainer, what users would otherwise pick: the same rows, already tokenized with the
    same masks (`completion_mask`), fed in the same micro-batches (a sequential sampler over the
    rows in the bare padded loop's order), with the same AdamW, LR schedule and clipping (handed to
    the trainer), padded by TRL's own collator. Steps are timed by a callback."""
    from datasets import Dataset
    from torch.utils.data import SequentialSampler
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    total = args.warmup + args.steps
    sampler = GlobalBatchSampler(ds.lengths, args.global_batch, args.micro_batch, 1, cfg.runner.seed, interleave=False)
    pos, order, step_tokens = DataPosition(), [], []
    for _ in range(total):
        batch_idx = sampler.global_batch(pos)
        pos = sampler.advance(pos, len(batch_idx))
        micro = sampler.rank_micro_batches(batch_idx, 0)
        if len(micro) != args.global_batch // args.micro_batch or any(len(m) != args.micro_batch for m in micro):
            raise SystemExit("TRL: the global batch does not split into equal micro-batches; pick sizes that divide")
        order += [int(i) for m in micro for i in m]
        step_tokens.append(int(ds.lengths[batch_idx].sum()))
    rows = Dataset.from_list([{"input_ids": ds[i]["input_ids"].tolist(), "completion_mask": ds[i]["loss_mask"].tolist()}
                              for i in order])

    class InOrder(SFTTrainer):
        def _get_train_sampler(self, *a, **k):
            return SequentialSampler(self.train_dataset)

    class Clock(TrainerCallback):
        def __init__(self):
            self.seconds, self.t0 = [], 0.0

        def on_step_begin(self, *a, **k):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            self.seconds.append(time.perf_counter() - self.t0)

    model, _, optimizer, scheduler = reference_model(cfg, model_path, total)  # as the bare loop's
    o = cfg.actor.optim
    clock = Clock()
    with tempfile.TemporaryDirectory(prefix="sftflow-bench-trl-") as out:
        trainer = InOrder(
            model=model, train_dataset=rows, optimizers=(optimizer, scheduler), callbacks=[clock],
            args=SFTConfig(output_dir=out, per_device_train_batch_size=args.micro_batch,
                           gradient_accumulation_steps=args.global_batch // args.micro_batch, max_steps=total,
                           max_grad_norm=o.clip_grad if o.clip_grad > 0 else 1e9, logging_steps=1, report_to=[],
                           save_strategy="no", dataloader_num_workers=0, use_cpu=not torch.cuda.is_available(),
                           completion_only_loss=True, packing=False, padding_free=False, max_length=None,
                           remove_unused_columns=False,
                           seed=cfg.runner.seed, disable_tqdm=True))
        trainer.data_collator.pad_token_id = pad_id
        trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    timed = clock.seconds[args.warmup:]
    return {"tokens": sum(step_tokens[args.warmup:]), "seconds": sum(timed), "losses": losses,
            "threads": torch.get_num_threads(), "world": 1, "peak_bytes": peak_memory(model.device),
            "n_params": sum(p.numel() for p in model.parameters()), "precision": "fp32", "attn": "default",
            "device": model.device.type}


def pad_waste(ds, args, seed: int, sort: bool) -> float:
    """Share of padded micro-batch slots that are padding over the timed steps: micro-batches
    as the sampler cuts them (longest first), or cut in sampling order (a naive loader)."""
    sampler = GlobalBatchSampler(ds.lengths, args.global_batch, args.micro_batch, 1, seed)
    pos, real, slots = DataPosition(), 0, 0
    for step in range(args.warmup + args.steps):
        batch_idx = sampler.global_batch(pos)
        pos = sampler.advance(pos, len(batch_idx))
        if step < args.warmup:
            continue
        micro = (sampler.rank_micro_batches(batch_idx, 0) if sort else
                 [batch_idx[i:i + args.micro_batch] for i in range(0, len(batch_idx), args.micro_batch)])
        for idx in micro:
            real += int(ds.lengths[idx].sum())
            slots += len(idx) * int(ds.lengths[idx].max())
    return 1 - real / slots


# --------------------------------------------------------------------------- report


def tokens_per_s(r: dict) -> float:
    return r["tokens"] / r["seconds"]


def memory(r: dict) -> str:
    b = r.get("peak_bytes")
    return "n/a" if not b else f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.0f} MiB"


def mfu(r: dict, flops: float | None) -> str:
    """6 x parameters x tokens/s (forward + backward of every weight, attention left out) over the
    peak of the GPUs the method used; CPUs have no such table."""
    if not flops or r.get("device") != "cuda":
        return "n/a"
    return f"{6 * r['n_params'] * tokens_per_s(r) / (flops * r['world']):.1%}"


def table_rows(results: dict[str, dict]) -> tuple[tuple, list[tuple]]:
    """(header, rows) of the report; also what bench/gpu_check.py collects."""
    ceiling = tokens_per_s(results[BARE]) if BARE in results else None
    flops = peak_flops()
    rows = []
    for name, r in results.items():
        ref = results.get(BARE, r)["losses"]
        dloss = max(abs(a - b) for a, b in zip(r["losses"], ref))
        rows.append((name, str(r["world"]), str(r["threads"]) if r.get("device") != "cuda" else "GPU",
                     f"{tokens_per_s(r):,.0f}", f"{tokens_per_s(r) / ceiling:.2f}x" if ceiling else "n/a",
                     memory(r), mfu(r, flops), f"{r['losses'][-1]:.4f}", f"{dloss:.1e}"))
    head = ("method", "procs", "threads", "tokens/s", "vs bare packed", "peak memory", "MFU", "final loss",
            "max |dloss|")
    return head, rows


def report(results: dict[str, dict], waste_sorted: float, waste_naive: float) -> None:
    head, rows = table_rows(results)
    title = "trained tokens/s (real tokens, timed steps only)"
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # rich is a CLI dependency, not the bench's: without it the Markdown below is the table
        Console = None
    if Console is not None:
        table = Table(title=title)
        for k, h in enumerate(head):
            table.add_column(h, justify="left" if k == 0 else "right")
        for r in rows:
            table.add_row(*r)
        console = Console()
        console.print(table)

    lines = []
    workers = {name: r for name, r in results.items() if name.startswith("sftflow worker (packed)")
               and "reshard" not in name and "checkpointing" not in name}
    worker = next(iter(workers.values()), None)
    trl = results.get(METHODS["trl"][0])
    for name, r in workers.items():
        if BARE in results:
            ratio = tokens_per_s(r) / tokens_per_s(results[BARE])
            goal = 0.95 if r["world"] == 1 else 1.0  # the performance issue's: one process, FSDP2 over several
            lines.append(f"{name} / bare packed loop: {ratio:.2f}x (goal >= {goal:.2f}x: "
                         f"{'met' if ratio >= goal else 'NOT met'})")
        if trl:
            ratio = tokens_per_s(r) / tokens_per_s(trl)
            lines.append(f"{name} / TRL SFTTrainer: {ratio:.2f}x "
                         f"(goal >= 1.50x: {'met' if ratio >= 1.5 else 'NOT met'})")
    if len(workers) > 1:
        from stages.core.machine.topology import auto_nproc
        n, why = auto_nproc()
        best = max(workers, key=lambda k: tokens_per_s(workers[k]))
        lines.append(f"actor.nproc_per_node: auto picks {n} process(es) here ({why}); fastest measured: {best}")
    if BARE in results and "bare loop (padded)" in results:
        lines.append("packing gain, bare loop: "
                     f"{tokens_per_s(results[BARE]) / tokens_per_s(results['bare loop (padded)']):.2f}x "
                     "packed vs padded")
    if worker and "sftflow worker (padded)" in results:
        lines.append("packing gain, sftflow worker: "
                     f"{tokens_per_s(worker) / tokens_per_s(results['sftflow worker (padded)']):.2f}x")
    for base in ("sftflow worker (packed)", BARE):
        ck = results.get(f"{base[:-1]}, activation checkpointing)")
        if base in results and ck and ck.get("peak_bytes") and results[base].get("peak_bytes"):
            lines.append(f"activation checkpointing, {base}: peak memory {memory(results[base])} -> {memory(ck)}, "
                         f"tokens/s x{tokens_per_s(ck) / tokens_per_s(results[base]):.2f}")
    lines.append(f"padding waste: {waste_sorted:.0%} of padded micro-batch tokens are pad "
                 f"({waste_naive:.0%} if micro-batches were cut in sampling order instead of longest-first)")
    attn = sorted({f"{r.get('precision', '?')}/{r.get('attn', '?')}" for r in results.values()})
    lines.append(f"device {'cuda: ' + torch.cuda.get_device_name() if CUDA else 'cpu'}; "
                 f"precision/attention: {', '.join(attn)}")
    if Console is not None:
        for line in lines:
            console.print(line)
    else:
        print(title)

    print("\nMarkdown:\n")
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    print()
    for line in lines:
        print(f"- {line}")


# --------------------------------------------------------------------------- main


METHODS = {  # --methods key -> (report name, runner kind, packed, activation checkpointing)
    "worker-packed": ("sftflow worker (packed)", "worker", True, False),
    "bare-packed": (BARE, "bare", True, False),
    "bare-padded": ("bare loop (padded)", "bare", False, False),
    "worker-packed-freed": ("sftflow worker (packed), reshard_after_forward", "worker", True, False),
    "worker-padded": ("sftflow worker (padded)", "worker", False, False),
    "worker-packed-ckpt": ("sftflow worker (packed, activation checkpointing)", "worker", True, True),
    "bare-packed-ckpt": ("bare loop (packed, activation checkpointing)", "bare", True, True),
    "trl": ("TRL SFTTrainer (padded)", "trl", False, False),
}


def chosen_methods(args) -> list[str]:
    """--methods, or the defaults: everything but the optional rows their flags leave out."""
    if args.methods:
        keys = [k.strip() for k in args.methods.split(",") if k.strip()]
        unknown = [k for k in keys if k not in METHODS]
        if unknown:
            raise SystemExit(f"--methods: unknown {unknown}; known: {', '.join(METHODS)}")
        return keys
    keys = ["worker-packed", "bare-packed", "bare-padded"]
    if max(args.nprocs) > 1:  # FSDP2's other setting: weights freed after each forward, gathered again for backward
        keys.append("worker-packed-freed")
    if not args.no_worker_padded:
        keys.append("worker-padded")
    if args.activation_checkpointing:
        keys += ["worker-packed-ckpt", "bare-packed-ckpt"]
    try:
        import trl  # noqa: F401 - the peer, when installed (not a dependency of sftflow)
        keys.append("trl")
    except ImportError:
        print("TRL is not installed: `.venv/bin/pip install trl` adds TRL's SFTTrainer to the comparison")
    return keys


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20, help="timed optimizer steps per method")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--micro-batch", type=int, default=4, help="samples per micro-batch per rank")
    ap.add_argument("--nproc", default="auto", help="torchrun ranks for the sftflow worker: N, a list (1,2: the worker "
                                                    "once per count) or auto (what actor.nproc_per_node: auto picks)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=1, help="interleaved rounds; each method reports its fastest")
    ap.add_argument("--no-worker-padded", action="store_true", help="skip the sftflow worker with packing off")
    ap.add_argument("--activation-checkpointing", action="store_true",
                    help="add the packed worker and bare loop with activation checkpointing (peak memory vs speed)")
    ap.add_argument("--methods", default=None, help=f"comma-separated subset, in this order: {', '.join(METHODS)}")
    ap.add_argument("--model", default=None,
                    help="smollm2 (the real-model quickstart's), or any actor.model.model_path; "
                         "default: the builtin tiny model")
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None,
                    help="a randomly initialized model of that shape instead (the builtin tokenizer)")
    ap.add_argument("--seq-scale", type=int, default=1, help="replies this many times longer (shapes: realistic "
                                                             "packed lengths on a GPU)")
    ap.add_argument("--data", default=None, help="messages JSONL files (comma-separated) instead of synthetic rows; "
                                                 "quickstart: the SmolLM2 quickstart's rows (see above)")
    ap.add_argument("--attn", default="auto", help="actor.attn_implementation for every method (default auto)")
    ap.add_argument("--lora", type=int, default=0, help="LoRA rank (alpha = 2 x rank) for every method; 0: full")
    ap.add_argument("--artifacts", type=Path, default=None, help="artifacts folder to keep the fetched/converted "
                                                                 "model between runs (default: a temporary one)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results (and the table) to this file")
    ap.add_argument("--worker-mode", nargs=2, metavar=("JOB_JSON", "OUT_JSON"), help=argparse.SUPPRESS)
    ap.add_argument("--bare-mode", nargs=2, metavar=("JOB_JSON", "OUT_JSON"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.model and args.shape:
        ap.error("--model and --shape exclude each other")
    try:
        args.nprocs = [auto_nproc()[0] if n.strip() == "auto" else int(n) for n in args.nproc.split(",") if n.strip()]
    except ValueError:
        ap.error(f"--nproc {args.nproc!r}: a number, a comma-separated list or auto")
    if not args.nprocs or min(args.nprocs) < 1:
        ap.error(f"--nproc {args.nproc!r}: counts must be >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker_mode:
        worker_mode(*args.worker_mode)
        return
    if args.bare_mode:
        bare_mode(*args.bare_mode)
        return

    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging
    from stages.runtime.batches import SFTDataset
    from stages.launch.launcher import worker_env

    hf_logging.disable_progress_bar()  # model save/load bars would interleave with the report
    t_start = time.perf_counter()
    keys = chosen_methods(args)
    with tempfile.TemporaryDirectory(prefix="sftflow-bench-") as tmp_name:
        tmp = Path(tmp_name)
        cfg, model_path, shards = prepare(tmp, args)
        ds = SFTDataset(shards)
        lengths = ds.lengths
        print(f"data: {len(ds)} samples, tokens per sample mean {lengths.mean():.0f} / median {np.median(lengths):.0f} "
              f"/ p90 {np.percentile(lengths, 90):.0f} / max {lengths.max()}; global batch {args.global_batch}, "
              f"micro-batch {args.micro_batch}, {args.warmup} warmup + {args.steps} timed steps")

        envs = {n: worker_env(n) for n in args.nprocs}
        # The worker gets nproc ranks x OMP_NUM_THREADS; the bare loops get the same total.
        threads = args.nprocs[0] * int(envs[args.nprocs[0]]["OMP_NUM_THREADS"])
        print("threads: " + ", ".join(f"worker {n} rank(s) x OMP_NUM_THREADS={e['OMP_NUM_THREADS']}"
                                      for n, e in envs.items())
              + f"; bare loops torch.set_num_threads({threads}); {os.cpu_count()} CPUs"
              + (f"; GPU {torch.cuda.get_device_name()}" if CUDA else ""))

        tok = AutoTokenizer.from_pretrained(model_path)
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)

        def runner(key: str, n: int = 1):
            _, kind, packed, ckpt = METHODS[key]
            if kind == "worker":
                return lambda: run_worker(cfg, model_path, shards, tmp, args, packed, envs[n],
                                          reshard_after_forward=True if key.endswith("freed") else None, ckpt=ckpt,
                                          nproc=n)
            return lambda: run_bare_child(cfg, model_path, shards, pad_id, tmp, args, kind, packed, ckpt, threads)

        methods = {}
        for k in keys:
            if METHODS[k][1] != "worker":
                methods[METHODS[k][0]] = runner(k)
                continue
            for n in args.nprocs:
                if k.endswith("freed") and n == 1:
                    continue  # nothing is sharded on one process
                suffix = f", {n} process{'es' if n > 1 else ''}" if len(args.nprocs) > 1 else ""
                methods[METHODS[k][0] + suffix] = runner(k, n)
        results: dict[str, dict] = {}
        # Rounds interleave the methods and each keeps its fastest round: another process
        # on the machine only ever slows a method down, so the best round is the least disturbed.
        for rnd in range(args.repeat):
            for name, run in methods.items():
                print(f"round {rnd + 1}/{args.repeat}: {name} ...", flush=True)
                r = run()
                if r.get("packing") is False and "(packed" in name:
                    name = name.replace("(packed", "(packing fell back to padded")
                if name not in results or tokens_per_s(r) > tokens_per_s(results[name]):
                    results[name] = r
        if args.json:  # first: the numbers survive a failing report
            head, rows = table_rows(results)
            args.json.write_text(json.dumps({"results": results, "head": head, "rows": rows, "data": {
                "samples": len(ds), "mean_tokens": float(lengths.mean()), "max_tokens": int(lengths.max())}}))
        report(results, pad_waste(ds, args, args.seed, True), pad_waste(ds, args, args.seed, False))
    name = (args.model or (f"{args.shape} shape (random init)" if args.shape else "builtin:tiny-chat")) + (
        f", data {args.data}" if args.data else "")
    print(f"model: {name}, {'LoRA r=%d' % args.lora if args.lora else 'full fine-tuning'}")
    print(f"\ntotal bench time {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
