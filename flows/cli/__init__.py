"""The CLI, `sftflow` (`python -m flows.cli`): this module holds the app, its `run | stage | show`
commands and `main`, the console script's entry; the families' commands are its modules, added to the
app here: registry.py `chat | models | champion | export | gc` (the registered model, the disk),
serving.py `serve | notify | sweep | deploy | stop-server | ui` (schedules, arrivals, a sweep, a work
pool, the Prefect server); common.py what they share (consoles, -c and overrides, one-line errors, the
Prefect home, the one plan, a flow on Prefect).

Nothing imports it but its entries (`sftflow`, `python -m flows.cli`) and tests; it imports the flows
(flows/sft.py and sweep.py, inside the commands that run them), the servers (flows/servers/) and what
docs/architecture.md's `flows` row allows of stages/.
"""

from __future__ import annotations

import json
import os
import sys
from functools import partial
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table

# What flows/ may import from stages is the `flows` row of docs/architecture.md's table (tested in
# tests/test_architecture.py); a command's own heavy imports stay inside it (torch: `chat` only).
# The commands beyond run, stage and show are in families beside this module (registry.py,
# serving.py), added to this app below; what they all share is in common.py.
from flows.cli import registry as cli_registry
from flows.cli import serving as cli_serving
from flows.cli.common import (RULE_WIDTH, ConfigOpt, OverridesArg, _fail, _on_prefect, _plan_or_exit, _prefect_home,
                              _say, console, err)
from stages.core.config import ConfigError, SFTConfig, flatten
from stages.core.errors import MissingUpstream, StageError
from stages.core.machine.process_env import apply_process_policy, exit_without_full_collections
from stages.core.quarantine import note as quarantine_note
from stages.evaluate.report import COLUMNS, table_cells
from stages.launch.launcher import request_stop, stop_requested
from stages.pipeline import (KEY_METRIC, STAGES, Plan, check_launch, check_memory, launch_report, planned_device,
                             replay_file, require_upstream, requires, train_memory, upstream, warm_imports)

HELP = """`sftflow`: run the flow, one stage, inspect a config, chat with a model.

Config problems are reported as one line on stderr with exit code 2, before anything runs.
"""
app = typer.Typer(add_completion=False, no_args_is_help=True, help=HELP)


@app.callback()
def _process_policy() -> None:
    # Every command runs after this, in `sftflow` as under typer's CliRunner; nothing the commands
    # import lazily (torch, transformers, mlflow, prefect) is loaded yet, so what they read when
    # loaded is already in place (stages/core/machine/process_env.py).
    apply_process_policy(os.environ)


def _check_launch(p: Plan) -> None:
    """A training this machine can't run (an attention kernel it lacks, a plan that clearly can't fit)
    fails here, before a Prefect server or torchrun; planning alone doesn't check it, so a deployment
    for a GPU pool is planned on any host (a completed train stage is reused, not run)."""
    if p.status("train") == "complete":
        return
    try:
        check_launch(p, warn=_say)
    except ConfigError as e:
        _fail(str(e))


def _memory_table(p: Plan) -> None:
    from stages.planning.memory_plan import budget_for, human  # arithmetic, no torch
    device = planned_device(p.cfg, p.fingerprints["models"])
    mp, source = train_memory(p, device)
    if mp is None:
        console.print(f"memory plan: unknown ({escape(source)})", highlight=False)
        return
    budget = budget_for(p.cfg, device)
    t = Table(title=f"memory plan per rank: {mp.world} process(es), {mp.precision}, longest micro-batch "
                    f"{mp.batch.tokens} tokens ({mp.batch.rows} x {mp.batch.row_len}; {mp.batch.source})")
    for col in ("term", "estimate", "note"):
        t.add_column(col)
    trained = f"{mp.n_trainable:,} trained of {mp.n_params:,}"
    sharded = f", sharded over {mp.world}" if mp.fsdp and mp.world > 1 else ""
    nf4 = f"; {mp.n_quantized:,} base weights 4-bit NF4" if mp.n_quantized else ""
    t.add_row("parameters", human(mp.params), f"{mp.n_params:,} (fp32 masters{sharded}"
              + (f"; {mp.precision} copy gathered" if mp.fsdp else "") + nf4 + ")")
    t.add_row("gradients", human(mp.grads), trained)
    t.add_row("optimizer", human(mp.optimizer), "AdamW, 2 fp32 moments")
    t.add_row("activations", human(mp.activations_full), "" if mp.checkpointing else "in use")
    t.add_row("activations, checkpointed", human(mp.activations_checkpointed), "in use" if mp.checkpointing else
              "with activation_checkpointing")
    if mp.dequant:
        t.add_row("4-bit dequantization", human(mp.dequant), "the largest quantized weight, unpacked for its matmul")
    t.add_row("total", human(mp.total), f"model dims: {escape(source)}")
    if budget is None:
        t.add_row("budget", "-", "not checked (actor.memory_budget_gb=0)")
    else:
        ranks = f" for {budget.ranks} processes" if budget.ranks > 1 else ""
        # RAM is shared and swaps: on CPU only a plan over all of it fails
        note = "" if device.kind == "cuda" else "; no accelerator visible"
        t.add_row("budget", human(budget.bytes), f"{escape(budget.what)}: needs {human(mp.total * budget.ranks)}"
                  f"{ranks}{note}")
    console.print(t)
    try:
        check_memory(p, device, warn=lambda line: err.print(f"[bold yellow]may not fit:[/] {escape(line)}",
                                                            highlight=False, soft_wrap=True))
    except ConfigError as e:
        err.print(f"[bold red]does not fit:[/] {escape(str(e))}", highlight=False, soft_wrap=True)


def _summary(results: list[dict], scored: str = "tuned") -> None:
    from flows.sft import shown  # the flow's own number format (loaded: the flow ran), as its summary prints
    table = Table(title="sftflow")
    for col in ("stage", "fingerprint", "cached", "seconds", "key metric"):
        table.add_column(col)
    for r in results:
        key, label = KEY_METRIC[r["stage"]]
        table.add_row(r["stage"], r["fingerprint"], "yes" if r["cached"] else "no", f"{r['seconds']:.1f}",
                      f"{label} {shown(r['metrics'].get(key))}")
    console.print(table)
    for r in results:  # rows the data had but training or scoring never saw
        left_out = quarantine_note(r["path"]) if r["stage"] in ("prepare", "prepare_eval") and r.get("path") else None
        if left_out:
            console.print(f"[bold yellow]{r['stage']}:[/] {escape(left_out)}", highlight=False, soft_wrap=True)
    ev = next((r for r in results if r["stage"] == "evaluate"), None)
    reg = next((r for r in results if r["stage"] == "register"), None)
    if ev:
        if scored != "tuned":
            console.print(f"scored: {escape(scored)} (the 'scored' column; 'base' is the base model)", highlight=False)
        sets = Table(title="eval sets (accuracy; paired change with its 95% interval)")
        for col in COLUMNS:
            sets.add_column("scored" if col == "tuned" and scored != "tuned" else col)
        for cells in table_cells(ev["metrics"], reg["metrics"].get("vs_champion") if reg else None):
            sets.add_row(*map(escape, cells))
        console.print(sets)
    if reg:
        m = reg["metrics"]
        aliases = ", ".join(m.get("aliases", [])) or "no alias"
        console.print(f"registered model version {m['version']} ({aliases})"
                      f"{escape(' [reused]') if m.get('reused_version') else ''}"
                      + (f": {escape(m['alias_reason'])}" if m.get("alias_reason") else ""))



@app.command()
def run(config: Path = ConfigOpt, overrides: Optional[list[str]] = OverridesArg,
        force: list[str] = typer.Option([], "--force",
                                        help="redo this stage (and everything after it); repeatable")) -> None:
    """The full flow: prepare -> train -> evaluate -> register."""
    for s in force:
        if s not in STAGES:
            _fail(f"--force {s}: unknown stage; stages: {', '.join(STAGES)}")
    p = _plan_or_exit(config, overrides)
    if p.cfg.eval.model is not None:
        _fail("eval.model is for `sftflow stage evaluate --model`: the flow registers the model it trains")
    _check_launch(p)
    _prefect_home(p.cfg)
    with _on_prefect("flows.sft", "sft_pipeline", warm=partial(warm_imports, p, forced=set(force))) as sft_pipeline:
        results = sft_pipeline(config_path=str(config), overrides=overrides or [], force=force, planned=p.to_dict())
    _summary(results)


@app.command()
def stage(name: str = typer.Argument(..., help="replay | prepare | prepare_eval | baseline | champion | train | "
                                               "evaluate | register"),
          config: Path = ConfigOpt, overrides: Optional[list[str]] = OverridesArg,
          force: bool = typer.Option(False, "--force", help="re-run even if the stage folder is complete"),
          with_upstream: bool = typer.Option(False, "--with-upstream",
                                             help="first run upstream stages that are missing"),
          model: Optional[str] = typer.Option(None, "--model", help="evaluate only: score this model instead of the "
                                              "trained one: base, a model, train stage or checkpoint folder, or "
                                              "models:/name@alias (sets eval.model)")) -> None:
    """One stage; upstream stages come from their completed folders."""
    if name not in STAGES:
        _fail(f"unknown stage '{name}'; stages: {', '.join(STAGES)}")
    if model is not None:
        if name != "evaluate":
            _fail(f"--model applies to `sftflow stage evaluate` only, not {name}")
        local = Path(model).expanduser()
        overrides = [*(overrides or []), f"eval.model={json.dumps(str(local.resolve()) if local.exists() else model)}"]
    p = _plan_or_exit(config, overrides)
    if name not in p.stages:
        _fail(f"this config has no {name} stage: " + ("the registry has no champion that another training made"
                                                     if name == "champion"
                                                     else "eval.eval_base is off or eval.model=base"))
    if not with_upstream:
        try:
            require_upstream(p, name)
        except MissingUpstream as e:
            _fail(f"{e} (or add --with-upstream)")
        except ConfigError as e:
            _fail(str(e))
    if name == "train":
        _check_launch(p)
    _prefect_home(p.cfg)
    runs = {name, *(requires(p, name) if with_upstream else ())}
    with _on_prefect("flows.sft", "sft_stage", warm=partial(warm_imports, p, runs, {name} if force else set())) \
            as sft_stage:
        results = sft_stage(stage=name, config_path=str(config), overrides=overrides or [], force=force,
                            with_upstream=with_upstream, planned=p.to_dict())
    _summary(results, scored=model or "tuned")


@app.command()
def show(config: Path = ConfigOpt, overrides: Optional[list[str]] = OverridesArg,
         as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
         preview: int = typer.Option(0, "--preview", metavar="N",
                                     help="print N prepared training samples, trainable tokens highlighted")) -> None:
    """The resolved config and each stage's fingerprint and status (or, with --preview, samples)."""
    p = _plan_or_exit(config, overrides)
    cfg = p.cfg
    if preview > 0:
        _preview(cfg, p, preview)
        return
    stages = {s: {"fingerprint": p.fingerprints[s], "status": p.status(s), "after": list(upstream(p, s)),
                  "path": str(p.folder(s))} for s in p.stages}
    if as_json:
        print(json.dumps({"config": cfg.model_dump(mode="json"), "topology": cfg.actor.topology, "stages": stages,
                          "start": p.start, "start_note": p.start_note, "rehearsal": p.rehearsal,
                          "launch": launch_report(p)}, indent=2))
        return
    table = Table(title=f"config {config}")
    table.add_column("key")
    table.add_column("value")
    unused = {f"actor.lora.{k}" for k in cfg.actor.lora.unused_keys()}
    for k, v in flatten(cfg.model_dump(mode="json")).items():
        if k not in unused:
            table.add_row(k, str(v))
    console.print(table)
    st = Table(title="stages")
    for col in ("stage", "fingerprint", "status", "reads", "path"):
        st.add_column(col)
    for s, info in stages.items():
        st.add_row(s, info["fingerprint"], info["status"], ", ".join(info["after"]) or "-", info["path"])
    console.print(st)
    for stage in ("prepare", "prepare_eval"):
        left_out = quarantine_note(p.folder(stage)) if stage in p.stages and p.status(stage) == "complete" else None
        if left_out:
            console.print(f"[bold yellow]{stage}:[/] {escape(left_out)}", highlight=False, soft_wrap=True)
    console.print(f"training runs {escape(cfg.actor.topology)}", highlight=False)
    console.print("training starts from " + escape(p.start["note"].removeprefix("starting from ") if p.start else
                                                   p.start_note or "the base model"), highlight=False)
    launch = launch_report(p, memory=False)  # the memory table below plans and checks memory once
    dev = launch["device"]
    where = (f"{dev['count']} x {dev['name']}" + (f" (compute {dev['capability']})" if dev["capability"] else "")
             if dev["kind"] == "cuda" else "the CPU")
    console.print(f"on {escape(where)}: {launch['backend']}, training in {escape(launch['precision_why'])}; "
                  f"evaluation in {escape(launch['eval_precision_why'])}; attention "
                  f"{launch['attn_implementation'] or '-'}" + (f" ({escape(dev['note'])})" if dev["note"] else ""),
                  highlight=False)
    console.print(f"evaluation runs {escape(launch['eval_launch'])}", highlight=False)
    if launch["validation"]:  # the held-out rows of each source, and the rule that picks the step that ships
        v = launch["validation"]
        console.print(escape(v["line"]) + (f"; checks {escape(v['selection'])}" if v["selection"] else ""),
                      highlight=False)
        if v.get("note"):
            console.print(f"[yellow]{escape(v['note'])}[/]", highlight=False)
    _memory_table(p)
    if launch["refused"]:
        err.print(f"[bold red]would not launch:[/] {escape(launch['refused'])}", highlight=False, soft_wrap=True)


def _preview(cfg: SFTConfig, p, n: int) -> None:
    """What the model is trained on, as a careful user checks it by hand: from the prepared shards
    when prepare has run, else prepared on the fly from the first rows (nothing is written)."""
    from rich.rule import Rule
    from rich.text import Text
    from stages.models.base import resolve_model  # may build a builtin model (torch) on first use
    from stages.prepare.stage import preview_samples  # tokenizers: only for --preview
    try:
        # a damaged prepare folder is not read (the flow rebuilds it): prepared on the fly instead
        prepared = p.folder("prepare") if p.status("prepare") == "complete" else None
        samples = preview_samples(cfg, prepared, resolve_model(cfg, p.fingerprints["models"]), n, replay_file(p))
    except (StageError, ConfigError) as e:
        _fail(str(e), 1)
    color = console.color_system is not None
    for source, segments in samples:
        console.print(Rule(escape(source), style="dim"), width=min(console.width, RULE_WIDTH))
        text = Text()
        for piece, trainable in segments:
            if color:
                text.append(piece, style="bold black on green" if trainable else "dim")
            else:  # a file or a pipe keeps no colours: the marks of preview.txt instead
                text.append(f"[[{piece}]]" if trainable else piece)
        console.print(text, soft_wrap=True)
    where = "prepared shards" if prepared is not None else "first rows, prepared on the fly"
    legend = "[bold black on green]highlighted[/] = trained" if color else "\\[[ ]] = trained"
    console.print(f"{len(samples)} sample(s) from the {where}; {legend} (data.loss_on={cfg.data.loss_on})",
                  highlight=False)


# The other families' commands, after run, stage and show, in the order `sftflow --help` lists them:
# chat, models, champion, export, gc; serve, notify, sweep, deploy, stop-server, ui.
cli_registry.register(app)
cli_serving.register(app)


def _stop(signum, frame) -> None:
    # Ctrl-C and SIGTERM unwind alike, so the launcher's cleanup kills the torchrun tree. The
    # exception can be lost (raised inside a finalizer), so torchrun is told directly as well.
    request_stop()
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> None:
    import signal
    exit_without_full_collections()
    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    try:
        app()
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)
    except SystemExit as e:
        if stop_requested() and e.code != 130:  # the KeyboardInterrupt was lost; the run stopped anyway
            err.print("interrupted")
            sys.exit(130)
        raise

