"""What quantizing the base costs before any adapter trains (issue 70): each 4-bit format's round trip of
the base's block linears, against the base itself.

    .venv/bin/python bench/qlora_base_error.py --out /tmp/qlora   # after bench/qlora.py --out /tmp/qlora

Reads the converted model (OUT/artifacts/models/<fp>/) and the replay stage's conversations (the base
model's own greedy answers to general prompts) that bench/qlora.py left under OUT. Prints, per format:
the block linears' relative squared error (sum (W_q - W)^2 / sum W^2), and the teacher-forced loss of
the answers (nats a token, up to 256 tokens each, the prompt not counted) under the base and under the
base with its linears replaced by their round trip: the loss a format adds before the adapters learn.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from stages.core import nf4, q4_1  # noqa: E402

FORMATS = {
    "nf4 (block 64)": lambda w: nf4.roundtrip(w, 64, 256),
    "nf4 (block 32)": lambda w: nf4.roundtrip(w, 32, 256),
    "q4_1": q4_1.roundtrip,
}


def answers(out: Path, tok, limit: int) -> list[tuple[torch.Tensor, int]]:
    path = next((out / "artifacts" / "replay").glob("*/conversations.jsonl"))
    rows = [json.loads(line) for line in path.read_text().splitlines()][:limit]
    encoded = []
    for r in rows:
        msgs = r["messages"]
        ids = tok(tok.apply_chat_template(msgs, tokenize=False), return_tensors="pt").input_ids[0][:256]
        prompt = len(tok(tok.apply_chat_template(msgs[:-1], tokenize=False, add_generation_prompt=True)).input_ids)
        encoded.append((ids, prompt))
    return encoded


@torch.no_grad()
def loss(model, encoded) -> float:
    total = n = 0
    for ids, prompt in encoded:
        logp = torch.log_softmax(model(ids[None]).logits[0, :-1].float(), -1)
        nll = -logp[torch.arange(len(ids) - 1), ids[1:]][prompt - 1:]
        total, n = total + nll.sum().item(), n + len(nll)
    return total / n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="bench/qlora.py's --out")
    ap.add_argument("--rows", type=int, default=40)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder = next((args.out / "artifacts" / "models").glob("*/"))
    tok = AutoTokenizer.from_pretrained(folder)
    encoded = answers(args.out, tok, args.rows)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    print(f"{folder.name}: {len(encoded)} replay answers; base: loss {loss(base, encoded):.3f} nats a token")
    linears = [m for _, m in nf4.quantized_linears(base, 32, 256, "q4_1")]
    original = [m.weight.detach().clone() for m in linears]
    norm = sum((w ** 2).sum().item() for w in original)
    for name, roundtrip in FORMATS.items():
        with torch.no_grad():
            for m, w in zip(linears, original):
                m.weight.copy_(roundtrip(w))
        err = sum(((m.weight - w) ** 2).sum().item() for m, w in zip(linears, original)) / norm
        print(f"{name}: {len(linears)} linears, relative squared error {err:.2e}, loss {loss(base, encoded):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
