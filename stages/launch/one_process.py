"""`python -m stages.launch.one_process --log-dir=DIR -m <module> <args>`: a run of one process on one
machine, without torchrun's agent.

With one rank there is nothing for an agent to supervise, restart or rendezvous, yet torchrun costs a
second interpreter that imports torch (1.5-3 s on 2 cores) and then starts the rank in a third. Here
the rank is this interpreter: it gives itself the environment torchrun gives a rank (RANK,
LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT, TORCHELASTIC_ERROR_FILE, ...), serves the rendezvous store
on loopback itself, as `local_torchrun` does, and runs `<module>` as `python -m` would. The module's
code (`init_process_group("env://")`, `rank_entry`'s error file) takes the same road as under
torchrun, and the launcher reads a failure from the same place (`<DIR>/one/attempt_0/0/error.json`).
Two processes or more, or several machines, always go through torchrun (launcher.torchrun_command).
`--ahead=MODULES` first: started before the flow reached train, it imports MODULES and waits on stdin
for the launcher to let it go, with the environment (launch/ahead.py).
"""

from __future__ import annotations

import os
import runpy
import socket
import sys
from pathlib import Path

from stages.launch.local_torchrun import loopback_interface

ERROR_FILE = Path("one", "attempt_0", "0", "error.json")  # laid out as torch elastic's agent lays it out


def rank_environment(log_dir: Path, port: int) -> dict[str, str]:
    """What torchrun's agent sets for the only rank of a one-process run."""
    (log_dir / ERROR_FILE).parent.mkdir(parents=True, exist_ok=True)
    env = {"RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0", "ROLE_RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": "1", "ROLE_NAME": "default", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
           "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_USE_AGENT_STORE": "True",
           "TORCHELASTIC_ERROR_FILE": str(log_dir / ERROR_FILE)}
    lo = loopback_interface()
    if lo:
        env["GLOO_SOCKET_IFNAME"] = os.environ.get("GLOO_SOCKET_IFNAME", lo)
        env["NCCL_SOCKET_IFNAME"] = os.environ.get("NCCL_SOCKET_IFNAME", lo)
    return env


def main(argv: list[str]) -> None:
    if argv and argv[0].startswith("--ahead="):  # started ahead (ahead.py): warm up, wait to be let go
        from stages.launch.ahead import wait_to_go
        wait_to_go([m for m in argv[0].split("=", 1)[1].split(",") if m])
        argv = argv[1:]
    if len(argv) < 3 or not argv[0].startswith("--log-dir=") or argv[1] != "-m":
        raise SystemExit("usage: python -m stages.launch.one_process --log-dir=DIR -m MODULE [ARGS...]")
    import torch.distributed as dist

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    # the store the rank's `env://` rendezvous connects to as a client (TORCHELASTIC_USE_AGENT_STORE),
    # as it would to the agent's: loopback only, and alive as long as this process
    store = dist.TCPStore("127.0.0.1", listener.getsockname()[1], is_master=True, multi_tenant=True,
                          master_listen_fd=listener.fileno(), wait_for_workers=False)
    os.environ.update(rank_environment(Path(argv[0].split("=", 1)[1]), listener.getsockname()[1]))
    sys.argv = [argv[2], *argv[3:]]
    runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
    del store


if __name__ == "__main__":
    main(sys.argv[1:])
