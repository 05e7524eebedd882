"""`sftflow show`'s launch report: every decision the machine makes for training (`launch_report`),
torch-free, by the rules the ranks apply and the checks `check_launch` makes."""

from __future__ import annotations

from ..core.config import SFTConfig
from ..core.errors import ConfigError
from ..planning import memory_plan
from .checks import check_attention, check_memory, check_processes, train_memory
from .plans import Plan, planned_device


def launch_report(p: Plan, device: memory_plan.Device | None = None, memory: bool = True) -> dict:
    """Every decision the machine makes for training, as `sftflow show --json` reports it: the device
    inventory, processes per node and why, the backend, the precision, the attention kernel, each
    rank's device, the memory plan against the budget, and what `check_launch` would refuse (the
    first check that does, in its order) or warn of (torch-free: the worker's rules, on what
    planning sees). `memory=False` leaves the memory plan out (`sftflow show` prints its own table)."""
    from ..core.machine.topology import backend, inventory, rank_gpu
    from ..evaluate.placement import describe as describe_eval_launch
    from ..evaluate.placement import settled as settled_eval_launch
    device = device or planned_device(p.cfg, p.fingerprints["models"])
    a, inv = p.cfg.actor, inventory()
    # scoring in the stage's process uses one device; where the work's size decides, list the ranks' devices
    eval_rule = settled_eval_launch(p.cfg, device.kind == "cuda")
    eval_ranks = 1 if eval_rule is not None and eval_rule[0] else a.nproc_per_node
    precision = device.precision(a.precision)
    report: dict = {
        "device": {"kind": device.kind, "name": device.name, "count": device.count,
                   "memory_gib": round(device.bytes / memory_plan.GIB, 1),
                   "capability": ".".join(map(str, device.capability)) if device.capability else None,
                   "source": inv.source, "note": inv.note,
                   **({"bf16": _cpu_bf16(p.cfg, device)} if device.kind == "cpu" else {})},
        "nproc_per_node": a.nproc_per_node, "topology": a.topology, "backend": backend(device.kind),
        "precision": precision, "precision_why": device.precision_why(a.precision),
        "eval_precision": device.precision(p.cfg.eval.precision, "eval.precision"),
        "eval_precision_why": device.precision_why(p.cfg.eval.precision, "eval.precision"), "attn_implementation": None,
        "train_devices": [f"cuda:{rank_gpu(r, device.count)}" if device.kind == "cuda" else "cpu"
                          for r in range(a.nproc_per_node)],
        "eval_devices": [f"cuda:{rank_gpu(r, device.count, shared=True)}" if device.kind == "cuda" else "cpu"
                         for r in range(eval_ranks)],
        "eval_launch": describe_eval_launch(p.cfg, device.kind == "cuda"),
        "memory": None, "warnings": [], "refused": None, "refused_by": None,
    }
    try:
        report["attn_implementation"] = memory_plan.attention_kernel(a.attn_implementation, device, a.packing,
                                                                     precision)
    except ConfigError:
        pass  # check_attention below names it
    mp, source = train_memory(p, device) if memory else (None, "left out")
    budget = memory_plan.budget_for(p.cfg, device)
    if mp is not None:
        report["memory"] = {"per_rank_bytes": mp.total, "ranks_sharing_budget": budget.ranks if budget else None,
                            "budget_bytes": budget.bytes if budget else None,
                            "budget": budget.what if budget else None, "dims": source}
    else:
        report["memory"] = {"unknown": source}
    for check, name in ((check_processes, "processes"), (check_attention, "attention")):
        try:
            check(p.cfg, device)
        except ConfigError as e:
            report["refused"], report["refused_by"] = str(e), name
            return report
    try:
        if memory:
            check_memory(p, device, warn=report["warnings"].append)
    except ConfigError as e:
        report["refused"], report["refused_by"] = str(e), "memory"
    return report


def _cpu_bf16(cfg: SFTConfig, device: memory_plan.Device) -> dict | None:
    """`show --json`'s account of a CPU's bf16: what was measured, where, and whether `auto` takes it."""
    if "auto" not in (cfg.actor.precision, cfg.eval.precision):
        return None  # nothing asks: nothing measured
    speed = device.cpu_bf16
    if speed is None:
        return {"native": False, "measured": None}
    from ..core.machine.bf16_speed import MARGIN
    return {"native": True, "measured": {"train": speed.train, "generate": speed.generate}, "margin": MARGIN,
            "cpu": speed.cpu, "threads": speed.threads, "torch": speed.torch, "shape_class": speed.shape_class,
            "seconds": speed.seconds}
