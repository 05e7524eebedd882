"""Starting and stopping processes: torchrun for a stage (`launcher`: the command, the child
environment, Ctrl-C/SIGTERM handling), the in-tree torchrun entry (`local_torchrun`) and the
parent-death guard (`orphan_guard`); process trees are `core/machine/proctree.py`, which ranks use too.
Used by the stages that launch ranks and by the CLI's signal handling; torch-free, and never imported
by the training loop (tests/test_architecture.py)."""
