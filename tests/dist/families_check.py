"""Under torchrun (2 processes): every decoder family of FAMILIES, as a tiny random-init Hugging Face
folder sharing one tokenizer, through sftflow's own paths, each against an independent reference.
Rank 0 writes one JSON object per family to OUT.json (tests/test_families.py asserts on it and renders
docs/models.md from it).

    torchrun --nproc_per_node=2 tests/dist/families_check.py OUT.json WORK_DIR SPEC.json [FAMILY ...]

SPEC.json is a worker spec over prepared shards whose `model_path` is the builtin model (its tokenizer
is every family's). Per family, in one process group:

  build      rank 0 writes WORK_DIR/<family>/base: AutoConfig.for_model(family, tiny dims, the tokenizer's
             vocabulary and special ids, `sliding_window` WINDOW where the family has one, 4 experts with 2
             active for MoE), `torch.manual_seed(0)`, `from_config`, every dropout 0;
  packing    SFTWorker.setup() (FSDP2 over 2 ranks, fp32, `actor.packing: true`): sftflow's decision
             (`worker.packing`) and whether the padded fallback was logged; then the micro-batch of three
             samples longer than the window as `worker.collate` makes it (packed, or padded when the
             fallback was taken), run through the sharded model, against each sample alone through plain
             transformers (eager attention, no FSDP). `packed_gap` is the packed row's gap whichever way
             the worker went (why a fallback is right), `window_effect` what the sliding window changes in
             that reference (the samples do reach past it);
  grads      `forward_backward` of the first global batch (8 samples, 2 micro-batches per rank), the
             gradients gathered whole, against one plain process: the summed cross-entropy of each sample
             alone, over the batch's trainable tokens, `.backward()`. Reported as the worst
             |g - ref| / (ATOL + RTOL |ref|) over every element of every parameter (<= 1 passes);
  export     one optimizer step, the sharded model's logits of a sample, `worker.export()`; rank 0 reloads
             `model/` with `generation.load` (what evaluate and chat use) and compares logits;
  generate   that reloaded model: `generation.generate` on PROMPTS in one left-padded batch against one
             prompt at a time (token ids and texts equal);
  lora       a worker with `actor.lora` r=4 on `all-linear`: setup, or the one-line error it stops with;
             when it builds, one step, then export (adapters merged into `model/`), its reloaded logits
             against the sharded peft model's.

An exception in one family's check (the same on both ranks: every step is deterministic and symmetric)
is recorded as that family's `error` and the walk goes on.
"""

from __future__ import annotations

import io
import json
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from stages.runtime.batches import DataPosition, collate_packed
from stages.runtime.distributed import choose_precision, exit_skipping_finalization, local_device
from stages.runtime.worker import SFTWorker, WorkerSpec

WINDOW = 8  # sliding window of the families that have one: the samples run 2-6 windows past it
DIMS = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, initializer_range=0.2)  # larger than the usual 0.02: peaked logits,
# so a leak across samples or a wrong mask moves greedy tokens, and argmax ties don't decide generation
SLIDING = {"sliding_window": WINDOW}
OPTIONAL_SLIDING = {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}  # layer 1 windowed
MOE = {"num_local_experts": 4, "num_experts_per_tok": 2}
FAMILIES: dict[str, dict] = {
    "llama": {},
    "mistral": SLIDING,
    "qwen2": OPTIONAL_SLIDING,
    "qwen3": {**OPTIONAL_SLIDING, "head_dim": 16},
    "gemma": {"head_dim": 16},
    # alternating windowed/global layers, softcaps. Their blocks' outputs are normalized (RMS 1) before the
    # residual add, which a 0.2-initialised embedding (x sqrt(hidden)) drowns: the model would echo its last
    # token whatever the prompt, and batched generation would be compared on identical replies
    "gemma2": {**SLIDING, "head_dim": 16, "query_pre_attn_scalar": 16, "initializer_range": 0.02},
    "gemma3_text": {**SLIDING, "head_dim": 16, "query_pre_attn_scalar": 16, "initializer_range": 0.02,
                    "layer_types": ["sliding_attention", "full_attention"]},
    "phi3": SLIDING,
    "olmo2": {},
    "granite": {"logits_scaling": 4.0},  # the output transform loss.py must apply
    "smollm3": {"use_sliding_window": True, "sliding_window": WINDOW, "no_rope_layers": [1, 0]},  # layer 1: NoPE, windowed
    "gpt_neox": {},
    "starcoder2": SLIDING,
    "stablelm": {},
    "cohere": {},
    "glm4": {"head_dim": 16},
    "qwen3_moe": {**OPTIONAL_SLIDING, "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 32},
    "mixtral": {**SLIDING, **MOE},
    "gpt_oss": {**SLIDING, **MOE, "head_dim": 16},
}
ATOL, RTOL = 1e-5, 1e-4
PROMPTS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "Repeat after me: light happy seven"}],
    [{"role": "user", "content": "Good morning! Tell me about yourself, and what you were made for."}],
    [{"role": "user", "content": "Who are you?"}, {"role": "assistant", "content": "I am TinyChat."},
     {"role": "user", "content": "Say it again, in other words please"}],
]


class SharedGroup(SFTWorker):
    """Every worker joins the one process group (a bounded timeout: a rank that fails alone stops the run)."""

    def init_distributed(self):
        device = local_device()
        if not dist.is_initialized():
            dist.init_process_group("gloo", timeout=timedelta(seconds=120))
        return device, dist.get_rank(), dist.get_world_size(), choose_precision(self.cfg.actor.precision, device)


class Tee(io.TextIOBase):
    """stdout, also kept: what `log` printed (rank 0) is read back for the packing and loss decisions."""

    def __init__(self, out):
        self.out, self.lines = out, []

    def write(self, s: str) -> int:
        self.lines.append(s)
        return self.out.write(s)

    def flush(self) -> None:
        self.out.flush()


def build_family(family: str, tok, dest: Path) -> dict:
    """The tiny random-init folder of `family` (rank 0); its config's facts for the table."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
    pad, eos = tok.pad_token_id, tok.convert_tokens_to_ids("<|im_end|>")
    config = AutoConfig.for_model(family, **{**DIMS, **FAMILIES[family]}, vocab_size=len(tok), bos_token_id=pad,
                                  eos_token_id=eos, pad_token_id=pad)
    for key, value in list(config.to_dict().items()):
        if ("dropout" in key or "pdrop" in key) and isinstance(value, (int, float)) and value:
            setattr(config, key, 0.0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=[eos, pad], pad_token_id=pad, do_sample=False)
    model.save_pretrained(dest, safe_serialization=True)
    tok.save_pretrained(dest)
    layer_types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    if layer_types and "sliding_attention" not in layer_types:
        window = None
    return {"architecture": type(model).__name__, "window": window, "layer_types": layer_types,
            "params": sum(p.numel() for p in model.parameters()),
            "experts": getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None),
            "tied": bool(getattr(config, "tie_word_embeddings", False))}


def worker_for(base_spec: dict, folder: Path, out: Path, lora: bool) -> SharedGroup:
    spec = json.loads(json.dumps(base_spec))
    spec["model_path"], spec["out_dir"] = str(folder), str(out)
    spec["config"]["actor"]["lora"] = ({"r": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": "all-linear"} if lora
                                       else {"r": 0})
    out.mkdir(parents=True, exist_ok=True)
    return SharedGroup(WorkerSpec.model_validate(spec))


def plain(folder: Path, **kw):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager", **kw)


def ids_of(sample: dict) -> torch.Tensor:
    return torch.tensor(np.asarray(sample["input_ids"]), dtype=torch.long)[None]


@torch.no_grad()
def sharded_logits(worker, batch: dict) -> torch.Tensor:
    worker.model.eval()
    logits = worker.model(**{k: v for k, v in batch.items() if k != "labels"}, use_cache=False).logits.float()
    worker.reshard()
    worker.model.train()
    return logits


def rows_gap(logits: torch.Tensor, batch: dict, refs: list[torch.Tensor]) -> float:
    """Largest gap between each sample's logits in a collated batch (packed: one row; padded: a row each)
    and its reference."""
    gap, start = 0.0, 0
    for b, ref in enumerate(refs):
        n = ref.shape[0]
        got = logits[0, start:start + n] if "position_ids" in batch else logits[b, :n]
        start += n
        gap = max(gap, (got - ref).abs().max().item())
    return gap


def reference_grads(folder: Path, samples: list[dict]) -> tuple[dict, int, float]:
    """One plain process: sum of each sample's cross-entropy alone over the batch's trainable tokens."""
    model = plain(folder)
    model.train()
    total = sum(int(np.asarray(s["loss_mask"])[1:].sum()) for s in samples)
    loss_sum = 0.0
    for s in samples:
        ids = ids_of(s)
        mask = torch.as_tensor(np.asarray(s["loss_mask"]), dtype=torch.bool)[1:]
        logits = model(input_ids=ids, use_cache=False).logits[0, :-1].float()
        loss_sum = loss_sum + F.cross_entropy(logits[mask], ids[0, 1:][mask], reduction="sum")
    (loss_sum / total).backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, total, loss_sum.item() / total


def grad_error(got: dict, want: dict) -> tuple[float, list[str]]:
    """max over every element of |got - want| / (ATOL + RTOL |want|), a missing gradient counting as zeros;
    and the parameters whose gradient exists on one side only (beyond all-zero ones)."""
    worst, one_sided = 0.0, []
    for name in sorted(set(got) | set(want)):
        g, w = got.get(name), want.get(name)
        if g is None or w is None:
            present = g if w is None else w
            if present.abs().max().item() > 0:
                one_sided.append(name)
            g = torch.zeros_like(present) if g is None else g
            w = torch.zeros_like(present) if w is None else w
        worst = max(worst, ((g - w).abs() / (ATOL + RTOL * w.abs())).max().item())
    return worst, one_sided


def whole(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu()


def check_full(base_spec: dict, folder: Path, out: Path, tee: Tee | None, rank: int) -> dict:
    res: dict = {}
    mark = len(tee.lines) if tee else 0
    w = worker_for(base_spec, folder, out, lora=False)
    w.setup()
    logged = "".join(tee.lines[mark:]) if tee else ""
    res["packing"] = w.packing
    res["fallback_logged"] = "can't be packed" in logged and "using padded micro-batches" in logged
    res["attention"] = w.attn_implementation
    res["fsdp"] = w.fsdp

    # packing: the worker's collate (its decision) on samples longer than the window vs each alone
    lengths = w.sample_lengths
    long_ones = [int(i) for i in np.argsort(-lengths, kind="stable")[:3]]
    samples = [w.train_ds[i] for i in long_ones]
    res["sample_lengths"] = [len(s["input_ids"]) for s in samples]
    batch = w.collate(samples)
    got = sharded_logits(w, batch)
    packed_batch = {k: v.to(w.device) for k, v in collate_packed(samples).items()}
    packed_got = sharded_logits(w, packed_batch)
    if rank == 0:
        ref_model = plain(folder).eval()
        with torch.no_grad():
            refs = [ref_model(input_ids=ids_of(s), use_cache=False).logits[0].float() for s in samples]
        res["collate_gap"] = rows_gap(got, batch, refs)
        res["packed_gap"] = rows_gap(packed_got, packed_batch, refs)
        if getattr(ref_model.config, "sliding_window", None):  # the same model with a window wider than the samples
            wide_model = plain(folder, sliding_window=4096).eval()
            with torch.no_grad():
                wide = [wide_model(input_ids=ids_of(s), use_cache=False).logits[0].float() for s in samples]
            res["window_effect"] = max((a - b).abs().max().item() for a, b in zip(refs, wide))
        res["logit_scale"] = max(r.abs().max().item() for r in refs)

    # gradients: FSDP2 over 2 ranks vs one plain process
    pos = DataPosition()
    idx = w.sampler.global_batch(pos)
    stats = w.forward_backward(idx)
    grads = {n: whole(p.grad) for n, p in w.model.named_parameters() if p.grad is not None}
    res["micro_batches"] = stats["micro_batches"]
    if rank == 0:
        want, total, loss = reference_grads(folder, [w.train_ds[int(i)] for i in idx])
        res["grad_error"], res["grad_one_sided"] = grad_error(grads, want)
        res["grad_params"] = len(set(grads) | set(want))
        res["tokens_match"] = stats["trainable_tokens"] == total
        res["loss_gap"] = abs(stats["loss"] - loss) / loss
    logged = "".join(tee.lines[mark:]) if tee else ""
    loss_lines = [line for line in logged.splitlines() if line.startswith("loss: ")]
    res["loss_path"] = ("chunked" if any("trained positions only" in line for line in loss_lines)
                        else "full logits" if loss_lines else None)

    # export -> reload -> same logits; then batched generation on the reloaded model
    w.optimizer_step()
    probe = {"input_ids": ids_of(samples[0]).to(w.device)}
    trained = sharded_logits(w, probe)
    w.export()
    if rank == 0:
        from stages.inference.generation import generate, load
        model, tok = load(str(out / "model"), device="cpu")
        with torch.no_grad():
            reloaded = model(**probe, use_cache=False).logits.float()
        res["export_gap"] = (reloaded - trained).abs().max().item()
        before = plain(folder).eval()
        with torch.no_grad():
            res["trained_moved"] = (before(**probe, use_cache=False).logits.float() - trained).abs().max().item()
        batched = generate(model, tok, PROMPTS, max_new_tokens=8, batch_size=len(PROMPTS))
        alone = [generate(model, tok, [p], max_new_tokens=8, batch_size=1)[0] for p in PROMPTS]
        res["generation_equal"] = batched == alone
        res["generation_distinct"] = len({r["text"] for r in alone})
        if batched != alone:
            res["generation_diff"] = [[a["text"], b["text"]] for a, b in zip(batched, alone) if a != b][:2]
    w.model = w.optimizer = None
    return res


def check_lora(base_spec: dict, folder: Path, out: Path, tee: Tee | None, rank: int) -> dict:
    from stages.core.errors import ConfigError
    res: dict = {}
    w = worker_for(base_spec, folder, out, lora=True)
    try:
        w.setup()
    except ConfigError as e:  # what the user reads: one line
        return {"lora": "refused", "lora_error": str(e), "lora_one_line": "\n" not in str(e)}
    from peft.tuners.lora import LoraLayer
    targets = sorted({name.rsplit(".", 1)[-1] for name, m in w.model.named_modules()
                      if isinstance(m, LoraLayer) and not name.endswith(".base_layer")})  # peft nests some wrappers
    res["lora"] = "trains"
    res["lora_targets"] = targets
    res["lora_trainable"] = sum(p.numel() for p in w.model.parameters() if p.requires_grad)
    pos = DataPosition()
    idx = w.sampler.global_batch(pos)
    w.forward_backward(idx)
    w.optimizer_step()
    probe = {"input_ids": ids_of(w.train_ds[0]).to(w.device)}
    tuned = sharded_logits(w, probe)
    w.export()
    if rank == 0:
        from stages.core.cache import bases
        from stages.inference.weights import load_merged
        # what the train stage adds to the exported adapter: its base by content (stored under out/bases/)
        bases.write_ref(out / "adapter", bases.base_of_training(str(folder), out), None)
        merged = load_merged(out / "adapter", roots=(out,)).eval()
        with torch.no_grad():
            res["lora_export_gap"] = (merged(**probe, use_cache=False).logits.float() - tuned).abs().max().item()
            res["lora_moved"] = (plain(folder)(**probe, use_cache=False).logits.float() - tuned).abs().max().item()
        res["lora_adapter_saved"] = (out / "adapter" / "adapter_config.json").is_file()
    w.model = w.optimizer = None
    return res


def main() -> None:
    out_path, work, spec_path = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    families = sys.argv[4:] or list(FAMILIES)
    base_spec = json.loads(spec_path.read_text())
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    tee = Tee(sys.stdout) if rank == 0 else None
    if tee:
        sys.stdout = tee
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(base_spec["model_path"])
    results: dict = {}
    for family in families:
        t0 = time.perf_counter()
        folder = work / family / "base"
        res: dict = {"family": family}
        if rank == 0:
            print(f"== {family}", flush=True)
            try:
                res.update(build_family(family, tok, folder))
                res["available"] = True
            except (KeyError, ValueError, ImportError) as e:  # not in this transformers
                res.update(available=False, error=f"{type(e).__name__}: {e}")
        flags = [res.get("available", True)]
        dist.broadcast_object_list(flags, src=0)
        if flags[0]:
            for name, check in (("full", check_full), ("lora", check_lora)):
                try:
                    res.update(check(base_spec, folder, work / family / name, tee, rank))
                except Exception as e:  # noqa: BLE001 -- recorded per family; the walk goes on
                    res[f"{name}_error"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
                    if rank == 0:
                        traceback.print_exc()
                dist.barrier()
        res["seconds"] = round(time.perf_counter() - t0, 1)
        results[family] = res
        if rank == 0:
            print(json.dumps(res), flush=True)
            out_path.write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    exit_skipping_finalization()  # as the stage entry points do


if __name__ == "__main__":
    main()
