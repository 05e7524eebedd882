"""Generation that evaluate, replay, `sftflow chat` and the registered chat model share (`generation`:
loading a model in the precision rule's dtype, the batched greedy decode loop, stop tokens), and
lm-evaluation-harness tasks scored on a model (`harness`), and the one loader of a trained model's
weights (`weights`: a full folder, or a LoRA adapter with its base reference merged in memory).
`generation.py` and `weights.py` also ship inside a logged MLflow model (register's code_paths), so they
import only torch-free core modules, with a fallback."""
