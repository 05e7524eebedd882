"""Caching and identity: what makes a stage's folder reusable. artifacts (digests, fingerprints,
atomic stage folders, their locks and manifests), inputs (config paths -> files), codeversion (a
stage's code version from the import graph), imports (user code by `module:name`, and its source's
identity), user_cache (`~/.cache/sftflow`), lineage_paths (an input as the project names it) and bases
(LoRA's bases stored once by content: `base.json`, artifacts/bases/, the MLflow store's base runs).

Any package of stages/ may import it, and flows/; it imports only stages.core.errors.
"""
