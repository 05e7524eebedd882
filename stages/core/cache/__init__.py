"""Caching and identity: what makes a stage's folder reusable. artifacts (digests, fingerprints,
atomic stage folders, their locks and manifests), inputs (config paths -> files), codeversion (a
stage's code version from the import graph), imports (user code by `module:name`, and its source's
identity), user_cache (`~/.cache/sftflow`) and lineage_paths (an input as the project names it).

Any package of stages/ may import it, and flows/; it imports only stages.core.errors.
"""
