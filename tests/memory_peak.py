"""Run as a subprocess: `python tests/memory_peak.py SPEC.json` trains 3 steps of the real
`SFTWorker` as one gloo rank and prints, as JSON, the resident memory at each step's start and
its peak (Linux: VmHWM, reset through /proc/self/clear_refs before the step).

The caller sets MALLOC_MMAP_THRESHOLD_ so glibc serves every tensor of 64 KiB or more with its
own mmap, returned on free: resident memory then follows the live tensors instead of malloc's
high-water mark, and a step's peak over its start is what it allocated on top of the model,
gradients-to-be and optimizer state it began with."""

import json
import sys


def _status(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def peak_resettable() -> str | None:
    """None when this machine lets a process reset its VmHWM; else why not (a container may mount
    /proc read-only, or a kernel lack clear_refs' "5"): without it the peak is the setup's, not the step's."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError as e:
        return f"/proc/self/clear_refs is not writable here ({e.strerror or e}): a step's peak can't be isolated"
    return None


def main(spec_path: str) -> None:
    from stages.runtime.batches import DataPosition
    from stages.runtime.worker import SFTWorker, WorkerSpec
    why = peak_resettable()
    if why:
        raise SystemExit(why)
    before = _status("VmRSS")  # torch and transformers imported, nothing built
    w = SFTWorker(WorkerSpec.read(spec_path))
    w.setup()
    pos, steps = DataPosition(), []
    for _ in range(3):
        start = _status("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        batch = w.sampler.global_batch(pos)
        row = w.forward_backward(batch)
        w.optimizer_step()
        pos = w.sampler.advance(pos, len(batch))
        steps.append({"start": start, "peak": _status("VmHWM"), "tokens": row["tokens"]})
    print(json.dumps({"before_setup": before, "steps": steps, "packing": w.packing, "precision": w.precision}))


if __name__ == "__main__":
    main(sys.argv[1])
