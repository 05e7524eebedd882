"""A Ctrl-C whose KeyboardInterrupt Python loses still stops the training.

When a signal handler runs while a finalizer (`__del__`, a weakref callback) is executing, the
exception it raises is printed as "Exception ignored in ..." and dropped. CI hit exactly that: the
CLI kept waiting on torchrun for minutes after Ctrl-C. Here a real SIGINT is delivered inside a
real finalizer, in a real process, with the CLI's own handler installed."""

import subprocess
import sys
import textwrap
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    import psutil
    from flows.cli import _stop
    from stages.core.errors import StageError
    from stages.runtime.launcher import run_torchrun

    signal.signal(signal.SIGINT, _stop)

    class SignalledWhileFinalized:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(2_000_000):  # the handler runs in here, so its KeyboardInterrupt is lost
                pass

    def on_line(line):
        if line == "up":
            print("tree", *[p.pid for p in psutil.Process().children(recursive=True)], flush=True)
            SignalledWhileFinalized()
            print("the interrupt was lost", flush=True)

    sleeper = [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(600)"]
    try:
        run_torchrun(sleeper, Path(sys.argv[1]), StageError, "sleeper", on_line)
    except KeyboardInterrupt:
        sys.exit(130)
    sys.exit(0)
""")


def test_a_lost_keyboard_interrupt_still_stops_torchrun(tmp_path):
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "train.log")], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    out = proc.stdout + proc.stderr
    assert "Exception ignored in" in out and "the interrupt was lost" in out, out  # the case under test
    assert proc.returncode == 130, out
    tree = [int(pid) for pid in next(x for x in proc.stdout.splitlines() if x.startswith("tree")).split()[1:]]
    assert tree, out
    alive = []
    for pid in tree:
        try:
            alive.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(alive, timeout=10)
    assert alive == []


def test_a_command_that_finishes_after_a_lost_interrupt_still_exits_130():
    """No training running when the interrupt is lost: the command runs on to its end, but the
    shell still hears that it was interrupted (exit 130), not success."""
    code = ("import sys; from stages.runtime.launcher import request_stop; request_stop(); "
            "sys.argv = ['sftflow', 'show', '-c', 'configs/default.yaml']; from flows.cli import main; main()")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 130, proc.stdout + proc.stderr
    assert "interrupted" in proc.stderr
