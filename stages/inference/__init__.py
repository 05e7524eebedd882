"""Generation that evaluate, replay, `sftflow chat` and the registered chat model share (`generation`:
loading a model in the precision rule's dtype, the batched greedy decode loop, stop tokens), and
lm-evaluation-harness tasks scored on a model (`harness`). `generation.py` also ships inside a logged
MLflow model (register's code_paths), so it imports only torch-free core modules, with a fallback."""
