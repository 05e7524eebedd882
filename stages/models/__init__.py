"""Models: where the base model comes from (base), the offline builtin (builtin), and what
a model reference names for evaluation (refs). Shared by the plan and the stages."""
