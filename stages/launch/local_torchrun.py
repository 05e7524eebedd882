"""`python -m stages.launch.local_torchrun <torchrun args>`: torchrun for a run on one machine, with
nothing listening beyond loopback.

`torchrun --standalone` hosts its rendezvous store, and a second store for the workers, on every
interface (`::`), so anyone on the network could talk to a single-machine run. TCPStore can't be
told which address to bind, but it can take a listening socket (`master_listen_fd`): this process
binds one to 127.0.0.1 and serves the store on it, then runs torchrun's static rendezvous in the
same process, where `multi_tenant` makes torchrun reuse that store instead of opening its own.
Workers reach it as clients (torchrun's agent store), and gloo/NCCL are kept on the loopback
interface unless the environment says otherwise.

Ranks start as torchrun starts them everywhere: fresh interpreters (`python -u -m <module>`), on
CPU as on GPUs, so the road a CPU run takes is the one GPU users take (torchtitan and torchtune do
the same). Ranks once forked from this process on CPU (0.8-1.6 s saved per launch) inherited torch
elastic's signal handlers, the store's server thread and an OpenMP pool; that path was removed.
"""

from __future__ import annotations

import os
import socket
import sys

from stages.core.machine.process_env import exit_without_full_collections


def loopback_interface() -> str | None:
    """The loopback interface's name on Linux ("lo"), else None (leave gloo/NCCL to their defaults)."""
    return "lo" if os.path.exists("/sys/class/net/lo") else None


def main(argv: list[str]) -> None:
    exit_without_full_collections()  # the agent's exit follows its ranks' on every launch's path
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
    record(elastic_launch(config=config, entrypoint=cmd))(*cmd_args)  # as torchrun's own main: @record


if __name__ == "__main__":
    main(sys.argv[1:])
