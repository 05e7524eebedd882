"""Chat text: chat_tokens (where a reply ends: the end-of-turn markers and stop ids that generation
and a GGUF export's Modelfile share; it ships flat beside a registered model) and model_card (the
Hugging Face README.md of a trained, registered or exported model, and what it trained on).

Imported by inference, train, register and export; imports stages.core.cache and stages.core.config.
"""
