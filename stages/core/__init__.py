"""What every package of stages/ shares, and nothing that knows a stage: imported by all of stages/ and
by flows/, imports no other package of stages/ (tests/test_architecture.py `ALLOWED`).

Its rooms, each a package whose `__init__` says what it owns:

    config/   the config schema: loading, overrides, validation; every name importable from `stages.core.config`
    machine/  the machine and its processes: GPUs and processes per node, the cores ledger, OpenMP threads,
              a process's defaults, process trees, the precision rule and a CPU's measured bf16
    cache/    caching and identity: digests, fingerprints, stage folders and their locks, input files,
              code versions, the identity of user code, the user's cache folder, lineage paths
    stats/    numbers from scored items: a set's scores, the paired comparison
    chat/     chat text: where a reply ends, the model card

and at its top: errors (the project's error types), quarantine (the rows a stage left out, the data
gate), narrow (a config narrowed to some eval sets) and nf4 (QLoRA's rule of which base weights
are 4-bit, their bytes, and the NF4 round trip a merge goes through; torch inside its functions).
Within core: errors imports nothing; nf4 imports errors; cache imports errors; machine imports cache;
config imports cache and machine; chat imports cache and config.
"""
