"""Small GGUF files written by the tests themselves (the `gguf` package's writer), so the GGUF
model source is tested without the 93 MB SmolLM2 download: a Qwen2 Hugging Face folder's
weights (F32, exact) and byte-level BPE tokenizer, as llama.cpp's converter lays them out."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def write_qwen2_gguf(hf_folder: Path, out: Path, architecture: str = "qwen2") -> Path:
    import gguf
    from safetensors.numpy import load_file

    cfg = json.loads((hf_folder / "config.json").read_text())
    tok = json.loads((hf_folder / "tokenizer.json").read_text())
    tok_cfg = json.loads((hf_folder / "tokenizer_config.json").read_text())
    w = gguf.GGUFWriter(str(out), architecture)
    w.add_name("sftflow-test")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(float(cfg.get("rope_theta") or cfg.get("rope_parameters", {}).get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)

    vocab = tok["model"]["vocab"]
    added = {t["content"]: t["id"] for t in tok.get("added_tokens", [])}
    by_id = {**{i: t for t, i in vocab.items()}, **{i: t for t, i in added.items()}}
    tokens = [by_id[i] for i in range(len(by_id))]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in added else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_eos_token_id(added["<|im_end|>"])
    w.add_pad_token_id(added["<|endoftext|>"])
    w.add_bos_token_id(added["<|endoftext|>"])
    w.add_add_bos_token(False)
    w.add_chat_template(tok_cfg.get("chat_template") or (hf_folder / "chat_template.jinja").read_text())

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, cfg["num_hidden_layers"])
    for name, value in load_file(str(hf_folder / "model.safetensors")).items():
        stem, suffix = name.rsplit(".", 1)
        w.add_tensor(f"{names.get_name(stem)}.{suffix}", np.ascontiguousarray(value.astype(np.float32)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
