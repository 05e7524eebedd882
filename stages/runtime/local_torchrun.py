"""`python -m stages.runtime.local_torchrun <torchrun args>`: torchrun for a run on one machine, with
nothing listening beyond loopback.

`torchrun --standalone` hosts its rendezvous store, and a second store for the workers, on every
interface (`::`), so anyone on the network could talk to a single-machine run. TCPStore can't be
told which address to bind, but it can take a listening socket (`master_listen_fd`): this process
binds one to 127.0.0.1 and serves the store on it, then runs torchrun's static rendezvous in the
same process, where `multi_tenant` makes torchrun reuse that store instead of opening its own.
Workers reach it as clients (torchrun's agent store), and gloo/NCCL are kept on the loopback
interface unless the environment says otherwise.
"""

from __future__ import annotations

import os
import socket
import sys


def loopback_interface() -> str | None:
    """The loopback interface's name on Linux ("lo"), else None (leave gloo/NCCL to their defaults)."""
    return "lo" if os.path.exists("/sys/class/net/lo") else None


def main(argv: list[str]) -> None:
    import torch.distributed as dist
    from torch.distributed.run import main as torchrun

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
    torchrun(["--nnodes=1", "--node-rank=0", "--rdzv-backend=static", "--master-addr=127.0.0.1",
              f"--master-port={port}", *argv])


if __name__ == "__main__":
    main(sys.argv[1:])
