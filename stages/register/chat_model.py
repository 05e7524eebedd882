"""MLflow "models from code" definition of the chat model logged by the register stage.

Loaded by `mlflow.pyfunc.load_model(...)`; the Hugging Face folder travels as the
`hf_model` artifact. `predict` takes a list whose items are each a prompt (a string) or a
conversation (a list of `{"role", "content"}` messages), or a DataFrame with a `messages` or
`prompt` column, and returns one reply per item; `params={"max_new_tokens": N}` bounds a reply.
"""

from __future__ import annotations

import re

import mlflow
from mlflow.pyfunc import PythonModel
from mlflow.utils.logging_utils import suppress_logs

try:  # inside the project
    from stages.inference.generation import generate, load
except ImportError:  # inside a logged model: generation.py ships via code_paths
    from generation import generate, load

Item = str | list[dict[str, str]]
# A prompt or a conversation per item is what a chat model takes; MLflow records the union as "Any" in
# the signature and warns about it wherever it reads the hint: where the class is defined (each load of
# this file) and where log_model infers the signature (register, with the same pattern). Silenced only
# around those, as MLflow silences its own (mlflow/types/responses.py): a process that loads the model
# keeps its logging as it was.
UNION_HINT_WARNING = re.compile(r"^Union type hint")
MAX_NEW_TOKENS = 128  # the signature's default comes from register's input example: keep them equal


def _conversations(model_input) -> list[list[dict]]:
    if hasattr(model_input, "to_dict"):  # pandas DataFrame (called directly, not through pyfunc)
        col = "messages" if "messages" in model_input.columns else "prompt"
        model_input = list(model_input[col])
    if isinstance(model_input, (str, dict)):
        model_input = [model_input]
    out = []
    for item in model_input:
        if isinstance(item, str):
            out.append([{"role": "user", "content": item}])
        elif isinstance(item, dict):
            out.append([item] if "role" in item else list(item.get("messages", [])))
        else:
            out.append([dict(m) for m in item])
    return out


with suppress_logs("mlflow.types.type_hints", UNION_HINT_WARNING):
    class ChatModel(PythonModel):
        def load_context(self, context):
            self.model, self.tokenizer = load(context.artifacts["hf_model"])

        def predict(self, context, model_input: list[Item], params: dict | None = None) -> list[str]:
            params = params or {}
            replies = generate(self.model, self.tokenizer, _conversations(model_input),
                               max_new_tokens=int(params.get("max_new_tokens", MAX_NEW_TOKENS)), batch_size=8)
            return [r["text"] for r in replies]


mlflow.models.set_model(ChatModel())
