"""The tuned model where people run models: a Hugging Face chat model folder (what the train stage
writes to `<train folder>/model/`, LoRA already merged) -> one GGUF file for llama.cpp and Ollama, and
an Ollama `Modelfile` beside it.

    python -m stages.export SRC --out DIR --type f16 [--name NAME]

`gguf.py` writes the file as llama.cpp's own convert_hf_to_gguf.py lays it out; `modelfile.py` writes
the Modelfile. docs/export.md: the command, the types and their measured tolerances, what is refused.
"""

from stages.export.gguf import FAMILIES, TYPES, ExportError, Exported, export_gguf

__all__ = ["FAMILIES", "TYPES", "ExportError", "Exported", "export_gguf"]
