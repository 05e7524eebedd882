"""The machine and its processes, torch-free at import: topology (the GPUs, processes per node and
the backend), cores (the machine's ledger of running ranks), threads (how OpenMP threads wait),
process_env (every process's defaults, applied where a process starts), proctree (process trees),
precision (the one precision rule) and bf16_speed (a CPU's bf16 against fp32, measured and cached).

Any package of stages/ may import it, and flows/ (the CLI's and a flow's process defaults); it imports
only stages.core.cache (the user's cache folder). precision.py and bf16_speed.py also ship flat beside a
registered model (stages/register `CODE_PATHS`), where each imports the other by its bare name.
"""
