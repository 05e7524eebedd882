"""The memory plan (stages/planning/memory_plan.py) at the settings of published LoRA / QLoRA memory
figures (issue 70): torchtune's README tables and Axolotl's examples/llama-3. Pure arithmetic, no
torch, no download: the models' dimensions are their config.json values, written out below.

    .venv/bin/python bench/published_memory.py      # prints the rows of docs/benchmarks.md's table

Each row: the published figure, the settings as the source's config states them, and the plan's
per-GPU total at those settings (its terms beside it). Where the source leaves a setting open (the
longest batch of a dataset without max_seq_len), the row shows the plan at two values of it.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stages.planning import memory_plan as mp

LLAMA2_7B = dict(model_type="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32, tie_word_embeddings=False)
LLAMA3_8B = dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False)
LLAMA3_70B = dict(model_type="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                  num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, tie_word_embeddings=False)
TT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# (source, published GB, model, world, lora r, targets, nf4, batch rows x length (a list: open), checkpointing,
#  kernel, note)
ROWS = [
    ("torchtune README (2024-04), llama2/7B_qlora_single_device: QLoRA, 1x RTX 4090", "8.57 GB", LLAMA2_7B, 1, 8,
     TT_TARGETS, True, [(2, 512), (2, 2048)], True, "sdpa",
     "batch_size 2, bf16, activation checkpointing, AdamW, r 8 on q/k/v/o + MLP; Alpaca-cleaned, no max_seq_len"),
    ("torchtune README (2024-04), llama3/8B_qlora_single_device: QLoRA", "~9 GB (allocated)", LLAMA3_8B, 1, 8,
     TT_TARGETS, True, [(2, 512), (2, 2048)], True, "sdpa", "as above, Llama-3-8B"),
    ("torchtune README (2024-04), llama3/8B_lora_single_device: LoRA", "~19 GB (allocated)", LLAMA3_8B, 1, 8,
     TT_TARGETS, False, [(2, 512), (2, 2048)], True, "sdpa", "as above without quantization"),
    ("Axolotl examples/llama-3 README: lora-8b.yml, 'Single GPU @ 11GB VRAM'", "11 GB", LLAMA3_8B, 1, 32,
     "all-linear", True, [(1, 8192)], True, "flash_attention_2",
     "load_in_8bit (int8 base: nf4 planned instead), r 32 all-linear, micro_batch 2 x sequence_len 4096 packed, "
     "gradient checkpointing, flash attention; lora_modules_to_save embed_tokens + lm_head and adamw_bnb_8bit "
     "(not planned: sftflow has neither)"),
    ("Axolotl examples/llama-3/qlora-fsdp-70b.yaml: QLoRA + FSDP, 70B", "none published", LLAMA3_70B, 2, 8,
     "all-linear", True, [(1, 512)], True, "flash_attention_2",
     "micro_batch 1 x sequence_len 512 padded, r 8 all-linear, gradient checkpointing, FSDP full shard with "
     "fsdp_offload_params (CPU offload: not planned); shown on 2 and 8 GPUs"),
]


def plan(model: dict, world: int, r: int, targets, nf4: bool, rows: int, length: int, ckpt: bool, kernel: str):
    return mp.estimate(mp.Arch.from_hf_config(model), world=world, precision="bf16", batch=mp.Batch(rows, length, ""),
                       checkpointing=ckpt, lora_r=r, lora_targets=targets, keep_gathered=False,
                       attn_implementation=kernel, nf4=(64, 256) if nf4 else None)


def bf16_frozen(p, model: dict, world: int) -> int:
    """The plan's total had the frozen weights outside the 4-bit ones been held as torchtune and Axolotl
    hold them, bf16 alone, instead of sftflow's fp32 master plus the gathered bf16 copy: the term that differs."""
    arch = mp.Arch.from_hf_config(model)
    full = p.n_params - p.n_quantized
    Q = p.params - 4 * full // world - 2 * (arch.root_params() + 2 * (arch.block_params() - p.n_quantized //
                                                                         arch.layers))
    return p.total - p.params + Q + 2 * full // world


def gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB"


def main() -> int:
    print("| source | published | settings | plan: total per GPU (params / grads + optimizer / activations); the "
          "same with the frozen weights held in bf16 |")
    print("|---|---:|---|---|")
    for source, published, model, world, r, targets, nf4, batches, ckpt, kernel, note in ROWS:
        worlds = [world] if world == 1 else [world, 8]
        cells = []
        for w in worlds:
            for rows, length in batches:
                p = plan(model, w, r, targets, nf4, rows, length, ckpt, kernel)
                where = f"{w} GPUs, " if w > 1 else ""
                cells.append(f"{where}{rows}x{length}: **{gb(p.total)}** ({gb(p.params)} / "
                             f"{gb(p.grads + p.optimizer)} / {gb(p.activations)}); frozen in bf16: "
                             f"**{gb(bf16_frozen(p, model, w))}**")
        print(f"| {source} | {published} | {note} | {'; '.join(cells)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
