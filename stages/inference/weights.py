"""The one loader of a trained model's weights: a folder that is either a full Hugging Face model or a
LoRA adapter with its base reference (`base.json`, stages/core/cache/bases.py) -> one plain in-memory
model, the adapter merged. Evaluate, replay, `chat`, the registered model (which ships this file as its
code), a warm start's folder and `sftflow export` all load through `load_merged`.

A LoRA folder merges as training exported it before adapters were stored as adapters: the base
(itself possibly an adapter over its own base: a warm start's chain) built in fp32, the adapter
loaded with peft and merged (`merge_and_unload`), so the weights are those the merged copy held.
"""

from __future__ import annotations

from pathlib import Path

import torch

try:  # inside the project
    from stages.core.cache import bases
except ImportError:  # inside a logged model: bases.py ships beside this file (register's code_paths)
    import bases


def is_adapter(folder) -> bool:
    return bases.is_adapter(folder)


def config_folder(model_dir, roots=(), tracking_uri: str | None = None) -> str:
    """The folder whose config.json describes `model_dir`'s model: itself, or its chain's full base."""
    folder = Path(model_dir)
    while bases.is_adapter(folder):
        folder = bases.locate(bases.read_ref(folder)["base"], roots, tracking_uri)
    return str(folder)


def _apply_base_transform(model: torch.nn.Module, record: dict | None) -> None:
    """What training did to the base's weights before the adapter trained on them, done again here:
    the one place a `quantize` record of `base.json` is applied (QLoRA: the NF4 round trip of the base
    weights, stages/core/nf4.py, which needs torchao)."""
    if not record:
        return
    try:
        from stages.core.nf4 import roundtrip_nf4_
    except ImportError:  # inside a logged model: nf4.py ships beside this file (register's code_paths)
        try:
            from nf4 import roundtrip_nf4_
        except ImportError:
            raise RuntimeError(f"base.json: the base was quantized ({record}) but this sftflow cannot apply "
                               "that transform (no stages.core.nf4)") from None
    roundtrip_nf4_(model, record)


def _full(folder: str, trust_remote_code: bool, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=trust_remote_code, dtype=dtype)


def load_merged(model_dir, trust_remote_code: bool = False, dtype: torch.dtype = torch.float32, roots=(),
                tracking_uri: str | None = None):
    """A plain Hugging Face model of `model_dir`'s weights in `dtype` (on CPU): a full model as it is; an
    adapter folder as its base (loaded the same way, recursively) with the adapter merged in fp32.
    `roots`: artifacts folders whose `bases/` hold nodes; missing ones come from the MLflow store."""
    folder = Path(model_dir)
    if not bases.is_adapter(folder):
        return _full(str(folder), trust_remote_code, dtype)
    ref = bases.read_ref(folder)
    base_dir = bases.locate(ref["base"], roots, tracking_uri)
    base = load_merged(base_dir, trust_remote_code, torch.float32, roots, tracking_uri)
    _apply_base_transform(base, ref.get("quantize"))
    import warnings

    from peft import PeftModel
    with warnings.catch_warnings():  # peft asks transformers a deprecated question; not ours to fix
        warnings.simplefilter("ignore", FutureWarning)
        merged = PeftModel.from_pretrained(base, str(folder)).merge_and_unload()
    if (folder / "generation_config.json").is_file():
        from transformers import GenerationConfig
        merged.generation_config = GenerationConfig.from_pretrained(str(folder))
    return merged.to(dtype)


def save_merged(model_dir, dest, trust_remote_code: bool = False, roots=(), tracking_uri: str | None = None) -> None:
    """`dest`: `model_dir` as one full Hugging Face folder (weights merged, config, generation config,
    tokenizer), for a tool that reads only full models (a warm start's training, GGUF export)."""
    from transformers import AutoTokenizer
    model = load_merged(model_dir, trust_remote_code, torch.float32, roots, tracking_uri)
    model.save_pretrained(dest, safe_serialization=True)
    AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code).save_pretrained(dest)


def merged_start(adapter, root, tracking_uri: str | None = None, trust_remote_code: bool = False,
                 same_as=None) -> str:
    """A warm start from a LoRA version: the adapter node stored under `root/bases/` and the version merged
    once into `root/models/start/merged-<digest>/model/`, a full folder training builds from as it built
    from the merged copy versions had before, with `node.json` beside it naming the node, so the new
    adapter's base.json names that chain rather than a merged copy (bases.base_of_training). Dropped by
    retention with the other start copies; merged again when a run needs it. `same_as`: the version's
    adapter in this machine's train folder, which the node links instead of the downloaded copy."""
    import json
    import os
    import shutil
    import uuid
    digest = bases.node_digest(adapter)
    # the version's own train folder, when this machine trained it: the node shares its files (no copy)
    here = same_as if same_as is not None and bases.is_adapter(same_as) and bases.node_digest(same_as) == digest \
        else adapter
    bases.store_local(root, here, digest)
    dest = Path(root) / "models" / "start" / f"merged-{digest[:16]}"
    if (dest / "model" / "config.json").is_file():
        return str(dest / "model")
    tmp = dest.parent / f".{dest.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    save_merged(adapter, tmp / "model", trust_remote_code, (root,), tracking_uri)
    (tmp / bases.START_NODE).write_text(json.dumps({"digest": digest}) + "\n")
    try:
        os.replace(tmp, dest)
    except OSError:  # merged meanwhile by another run
        shutil.rmtree(tmp, ignore_errors=True)
    return str(dest / "model")
