"""`python -m stages.runtime.local_torchrun <torchrun args>`: torchrun for a run on one machine, with
nothing listening beyond loopback.

`torchrun --standalone` hosts its rendezvous store, and a second store for the workers, on every
interface (`::`), so anyone on the network could talk to a single-machine run. TCPStore can't be
told which address to bind, but it can take a listening socket (`master_listen_fd`): this process
binds one to 127.0.0.1 and serves the store on it, then runs torchrun's static rendezvous in the
same process, where `multi_tenant` makes torchrun reuse that store instead of opening its own.
Workers reach it as clients (torchrun's agent store), and gloo/NCCL are kept on the loopback
interface unless the environment says otherwise.

On Linux without a GPU, the ranks of a Python entry (`-m <module>` or a script) are forked from this
process (torch elastic's function entry point, start method `fork`) once it has imported what the
entry imports: a rank then starts in a fraction of a second instead of importing torch, FSDP and
transformers again (seconds of CPU each). With GPUs they start as fresh interpreters (torchrun's own
`python -u -m`), since CUDA must not be initialized in the process a CUDA rank is forked from;
SFTFLOW_FORK_RANKS=0 asks for fresh interpreters everywhere.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import runpy
import socket
import sys
from pathlib import Path


def loopback_interface() -> str | None:
    """The loopback interface's name on Linux ("lo"), else None (leave gloo/NCCL to their defaults)."""
    return "lo" if os.path.exists("/sys/class/net/lo") else None


# What every rank's work imports on top of its entry's own imports (the model and tokenizer classes
# are seconds of CPU): imported once here, before the ranks fork.
RANK_IMPORTS = ("transformers.modeling_utils", "transformers.models.auto.modeling_auto",
                "transformers.models.auto.tokenization_auto")
FORK_ENV = "SFTFLOW_FORK_RANKS"  # 0: ranks start as fresh interpreters on CPU too (bench/rank_start.py)


def entry_file(script: str, module: bool) -> Path | None:
    """The Python file `python -m <script>` (a package: its `__main__`) or `python <script>` runs."""
    if not module:
        return Path(script) if script.endswith(".py") and Path(script).is_file() else None
    spec = importlib.util.find_spec(script)
    if spec is not None and spec.submodule_search_locations is not None:
        spec = importlib.util.find_spec(f"{script}.__main__")
    return Path(spec.origin) if spec is not None and spec.origin and spec.origin.endswith(".py") else None


def entry_imports(path: Path) -> list[str]:
    """The modules a file imports at its top level."""
    names = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names]
    return names


def run_entry(script: str, module: bool, *args: str) -> None:
    """A forked rank: runs what `python [-m] <script> <args>` would run, in this process, whose imports
    are done."""
    import torch
    threads = os.environ.get("OMP_NUM_THREADS")  # torchrun's per-rank setting; OpenMP read it at import
    if threads and threads.isdigit():
        torch.set_num_threads(int(threads))
    sys.argv = [script, *args]
    if module:
        runpy.run_module(script, run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(script, run_name="__main__")


def forked_entry(args) -> tuple | None:
    """(entry point, its arguments) that fork the ranks of torchrun's `args` from this process, their
    entry's imports done; None where they start as fresh interpreters: on a machine with GPUs, for a
    program that is not Python, off Linux, with SFTFLOW_FORK_RANKS=0, or when an import fails here."""
    from stages.core.topology import visible_gpus  # torch-free: nvidia-smi, as the CLI decides the topology
    if args.no_python or not sys.platform.startswith("linux") or os.environ.get(FORK_ENV, "1") == "0" \
            or visible_gpus():
        return None
    path = entry_file(args.training_script, args.module)
    if path is None:
        return None
    if not args.module:  # as `python script.py`: its folder first on the path
        sys.path.insert(0, str(path.resolve().parent))
    try:
        for name in [*entry_imports(path), *RANK_IMPORTS]:
            importlib.import_module(name)
    except Exception:  # noqa: BLE001 - the ranks then import it themselves and report it as a rank's failure
        return None
    return run_entry, [args.training_script, args.module, *args.training_script_args]


def main(argv: list[str]) -> None:
    import torch.distributed as dist
    from torch.distributed.elastic.multiprocessing.errors import record
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    port = listener.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, is_master=True, multi_tenant=True,  # noqa: F841 - serves the run
                          master_listen_fd=listener.fileno(), wait_for_workers=False)
    lo = loopback_interface()
    if lo:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", lo)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", lo)
    args = parse_args(["--nnodes=1", "--node-rank=0", "--rdzv-backend=static", "--master-addr=127.0.0.1",
                       f"--master-port={port}", *argv])
    config, cmd, cmd_args = config_from_args(args)
    forked = forked_entry(args)
    if forked is not None:
        config.start_method = "fork"
        cmd, cmd_args = forked
    record(elastic_launch(config=config, entrypoint=cmd))(*cmd_args)  # as torchrun's own main: @record


if __name__ == "__main__":
    main(sys.argv[1:])
