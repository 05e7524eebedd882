"""`python -m stages.launch.orphan_guard <python args...>`: asks for a parent-death signal, then
becomes `python <args>` (exec keeps the request). The launcher starts torchrun through it, so a
SIGKILLed caller (the CLI, a Prefect worker) takes torchrun, and so its workers, with it. Done here
rather than in a `preexec_fn`, which is unsafe in a process that runs threads (Prefect's)."""

import os
import signal
import sys

from stages.core.machine.proctree import die_with_parent

if __name__ == "__main__":
    die_with_parent(signal.SIGTERM)  # SIGTERM: torchrun's agent then stops its workers cleanly
    os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
