"""`sftflow show`'s launch report: every decision the machine makes for training (`launch_report`),
torch-free, by the rules the ranks apply and the checks `check_launch` makes."""

from __future__ import annotations

from ..core.config import SFTConfig, stale_train_validation
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
        "validation": validation_report(p),
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


def validation_report(p: Plan) -> dict | None:
    """What training validates and how it chooses the step that ships: each mixture source's held-out rows
    (how they are chosen, and how many once prepare has run: its manifest's `val_mix`) and the runner's
    rule; None without a validation set."""
    from ..core.cache.artifacts import read_manifest
    from ..runtime.mixture import held_out_line, held_out_rule
    cfg = p.cfg
    d, r = cfg.data, cfg.runner
    if not (d.val_data_paths or d.val_fraction > 0):
        return None
    sources = list(cfg.mix_weights()) or ["train"]
    rows, counted = None, "prepare's count"
    if "prepare" in p.stages and p.status("prepare") == "complete":
        rows = {m["source"]: m["rows"] for m in read_manifest(p.folder("prepare")).get("val_mix") or []} or None
    if rows is None:  # before prepare: the rule applied to the files (quarantined rows not yet left out)
        rows, counted = {s: _held_out_now(cfg, s) for s in sources}, "counted in the files, before prepare"
    held = [{"source": s, "rule": held_out_rule(s, d.val_fraction, bool(d.val_data_paths)), "rows": rows.get(s)}
            for s in sources]
    if all(h["rows"] is not None for h in held):
        line = held_out_line(held, d.val_fraction, bool(d.val_data_paths)) + f" ({counted})"
    else:
        line = ("validation: held out, scored per source: "
                + ", ".join(f"{h['source']} {h['rows'] if h['rows'] is not None else '?'} ({h['rule']})"
                            for h in held) + " (? : counted by prepare)")
    selecting = r.early_stopping_patience or r.load_best_model_at_end
    ships = ("the last step" if not r.load_best_model_at_end else
             f"the best check's by {r.metric_for_best_model}" + ("".join(
                 f", among those whose {g.key} is within {g.max_drop:g} of the start's (step 0; the start ships "
                 "when no trained check is eligible and better)" for g in r.best_model_guard)))
    rule = (f"every {r.val_check_interval} steps; ships {ships}"
            + (f"; early stopping after {r.early_stopping_patience} checks without an improvement"
               if r.early_stopping_patience else "")) if selecting else None
    return {"held_out": held, "line": line, "selection": rule, "note": stale_train_validation(cfg)}


def _held_out_now(cfg: SFTConfig, source: str) -> int | None:
    """A source's held-out rows by the rule, counted in its files; None where they can't be read yet."""
    from ..core.config import REHEARSE, mix_split
    d = cfg.data
    if source == "train" and d.val_data_paths:
        return _count_held_out(cfg.inputs()["val"], 1.0)  # every row of the val files
    if d.val_fraction <= 0:
        return 0
    if source == "train":
        refs = cfg.inputs()["train"]
    elif source == REHEARSE:
        refs = [e["ref"] for e in cfg.rehearsal_files]
    elif source in d.mix and d.mix[source].paths:
        refs = cfg.inputs()[mix_split(source)]
    else:  # replay: the replay stage's answers, written when it runs
        return None
    return _count_held_out(refs, d.val_fraction)


def _count_held_out(refs: list, fraction: float) -> int | None:
    """Rows of local files `refs` that `runtime.mixture.held_out` keeps out, before prepare's quarantine;
    None when one is not a local file (a hub dataset, an answers file not written yet)."""
    from pathlib import Path

    from ..chatdata.readers import iter_records, row_content_key
    from ..runtime.mixture import held_out
    n = 0
    for ref in refs:
        if str(ref).startswith("hf:") or not Path(ref).exists():
            return None
        n += sum(held_out(row_content_key(rec), fraction) for _, rec in iter_records(Path(ref)))
    return n
