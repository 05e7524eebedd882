"""`sftflow`: run the flow, one stage, inspect a config, chat with a model.

Config problems are reported as one line on stderr with exit code 2, before anything runs.
"""

from __future__ import annotations

import importlib
import json
import os
import time
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

# What flows/ may import from stages is the `flows` row of docs/architecture.md's table (tested in
# tests/test_architecture.py); a command's own heavy imports stay inside it (torch: `chat` only).
from flows.prefect_server import KeepSettingError, ServerDidNotStart, prefect_api
from stages.core.quarantine import note as quarantine_note
from stages.core.config import SERVE_PROTECTED, ConfigError, SFTConfig, default_tracking_uri, flatten, load_config
from stages.core.errors import MissingUpstream, StageError
from stages.core.process_env import apply_process_policy
from stages.evaluate.report import COLUMNS, table_cells
from stages.pipeline import (KEY_METRIC, STAGES, Plan, check_launch, check_memory, launch_report, plan, replay_file,
                             require_upstream, train_memory, upstream)
from stages.launch.launcher import request_stop, stop_requested

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)


@app.callback()
def _process_policy() -> None:
    # Every command runs after this, in `sftflow` as under typer's CliRunner; nothing the commands
    # import lazily (torch, transformers, mlflow, prefect) is loaded yet, so what they read when
    # loaded is already in place (stages/core/process_env.py).
    apply_process_policy(os.environ)


# A file or a pipe (CI, `make run > log`) has no width: rich would fit every table into 80 columns,
# wrapping and clipping cells ("retention…"). There a table keeps every column and cell whole, one line
# per row (a table is never wider than its content); an explicit COLUMNS still wins, as in rich.
UNBOUNDED_WIDTH = 10_000
RULE_WIDTH = 100  # a rule (`show --preview`) spans the console: not 10,000 characters in a log


def _console(stderr: bool = False) -> Console:
    c = Console(stderr=stderr)
    return c if c.is_terminal or os.environ.get("COLUMNS") else Console(stderr=stderr, width=UNBOUNDED_WIDTH)


console = _console()
err = _console(stderr=True)

ConfigOpt = typer.Option(..., "-c", "--config", help="YAML config, e.g. configs/default.yaml")
OverridesArg = typer.Argument(None, help="dotted overrides, e.g. actor.optim.lr=1e-3")


def _fail(msg: str, code: int = 2) -> None:
    err.print(f"[bold red]error:[/] {escape(msg)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def _load(config: Path, overrides: Optional[list[str]]) -> SFTConfig:
    try:
        return load_config(config, overrides or [])
    except ConfigError as e:
        _fail(str(e))


def _prefect_home(cfg: SFTConfig) -> None:
    """Prefect's home lives in the config's artifacts_dir (unless PREFECT_HOME says otherwise), made
    only once the config is valid; it must be set before prefect is imported (flows.sft, lazily)."""
    home = Path(os.environ.setdefault("PREFECT_HOME", str(cfg.artifacts_path / ".prefect"))).expanduser()
    home.mkdir(parents=True, exist_ok=True)  # prefect won't create parents


def _plan_or_exit(config: Path, overrides: Optional[list[str]]) -> Plan:
    """The run's one validation and one plan: the flow gets this plan and never redoes either."""
    cfg = _load(config, overrides)
    try:
        return plan(cfg)
    except ConfigError as e:
        _fail(str(e))


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
    from stages.planning.memory_plan import budget_for, human, visible_device  # arithmetic, no torch
    device = visible_device()
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
    t.add_row("parameters", human(mp.params), f"{mp.n_params:,} (fp32 masters{sharded}"
              + (f"; {mp.precision} copy gathered" if mp.fsdp else "") + ")")
    t.add_row("gradients", human(mp.grads), trained)
    t.add_row("optimizer", human(mp.optimizer), "AdamW, 2 fp32 moments")
    t.add_row("activations", human(mp.activations_full), "" if mp.checkpointing else "in use")
    t.add_row("activations, checkpointed", human(mp.activations_checkpointed), "in use" if mp.checkpointing else
              "with activation_checkpointing")
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


def _say(message: str) -> None:
    err.print(message, highlight=False)


@contextmanager
def _on_prefect(module: str, name: str) -> Iterator[Callable]:
    """The flow `module.name`, to be called on the Prefect API `prefect_api` picks (PREFECT_API_URL,
    else a local server on PREFECT_HOME: flows/prefect_server.py); its failure ends as one line
    (Prefect's log above has the details). Importing the flow (Prefect: seconds) happens while a
    server starts rather than before it."""
    def load_flow() -> Callable:
        return getattr(importlib.import_module(module), name)
    try:
        with prefect_api(Path(os.environ["PREFECT_HOME"]), meanwhile=load_flow, say=_say):
            flow = load_flow()
            try:
                yield flow
            except ConfigError as e:
                _fail(str(e))
            except StageError as e:
                _fail(str(e), code=1)
            except Exception as e:  # noqa: BLE001 - the flow log already holds the traceback
                _fail(f"{type(e).__name__}: {str(e).strip() or 'failed'} (traceback in the log above)", code=1)
    except KeepSettingError as e:
        _fail(str(e))
    except ServerDidNotStart as e:
        _fail(str(e), code=1)


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
    with _on_prefect("flows.sft", "sft_pipeline") as sft_pipeline:
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
    with _on_prefect("flows.sft", "sft_stage") as sft_stage:
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
    for k, v in flatten(cfg.model_dump(mode="json")).items():
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


def _sqlite_file(uri: str) -> Path | None:
    return Path(uri[len("sqlite:///"):]) if uri.startswith("sqlite:///") else None


def _pinned(ref: str, uri: str) -> tuple[str, str | None, str | None]:
    """(`models:/name/N`, name, N) for `models:/name@alias` or `models:/name/N` as the registry has it now, so
    that an export or a chat names the version it used and an alias that moves meanwhile changes nothing;
    (ref, None, None) for a folder. A name, alias or version the registry lacks exits with its one line."""
    if not ref.startswith("models:/"):
        return ref, None, None
    from stages.tracking.registry import registry_version
    try:
        name, version = registry_version(ref, uri, key="--model")
    except ConfigError as e:
        _fail(str(e))
    return f"models:/{name}/{version}", name, version


@app.command()
def chat(question: Optional[str] = typer.Argument(None, help="the user message; none: a conversation on stdin, a "
                                                             "line a turn (/reset forgets it, /exit or EOF ends)"),
         model: Optional[str] = typer.Option(None, "-m", "--model", help="train stage folder, HF folder, or "
                                             "models:/name@alias (default with -c: models:/<registry.model_name>"
                                             "@champion)"),
         config: Optional[Path] = typer.Option(None, "-c", "--config", help="the config whose MLflow store holds "
                                               "models:/ (registry.tracking_uri, else its artifacts folder)"),
         max_new_tokens: int = typer.Option(128, help="reply length limit"),
         tracking_uri: Optional[str] = typer.Option(None, help="MLflow tracking URI for models:/ "
                                                               "(default: -c's, else ./artifacts/mlflow.db)")) -> None:
    """Chat with a model through its chat template: one question, or a conversation on stdin."""
    cfg = _load(config, []) if config is not None else None
    if model is None:
        if cfg is None:
            _fail("give -m MODEL (a folder or models:/name@alias), or -c CONFIG for its champion")
        model = f"models:/{cfg.registry.model_name}@champion"
    uri = tracking_uri or (cfg.resolved_tracking_uri if cfg is not None else default_tracking_uri())
    store = _sqlite_file(uri)
    if model.startswith("models:/") and store is not None and not store.is_file():
        # opening a SQLite store creates it: a chat from another folder must not leave an empty one behind
        _fail(f"{model}: no MLflow store at {store}" + ("" if cfg is not None else
              " (run from the project folder, or give -c CONFIG or --tracking-uri)"))
    pinned, registered, version = _pinned(model, uri)
    if version is not None:  # on stderr: stdout holds the replies alone
        err.print(f"[dim]{escape(registered)} v{version}" + ("" if pinned == model else f" ({escape(model)})") + "[/]",
                  highlight=False)
    from stages.models.refs import resolve_model_ref
    from stages.inference.generation import generate, load  # torch: only for chat, the one flows import of it
    try:
        path = resolve_model_ref(pinned, uri)
    except ValueError as e:
        _fail(str(e))
    m, tok = load(path, precision=cfg.actor.precision if cfg is not None else "auto")

    def reply(turns: list[dict]) -> str:
        return generate(m, tok, [turns], max_new_tokens, batch_size=1)[0]["text"]
    if question is not None:
        console.print(reply([{"role": "user", "content": question}]), highlight=False, markup=False)
        return
    tty = sys.stdin.isatty()
    if tty:
        err.print(f"chatting with {escape(model)}; /reset forgets the conversation, /exit or Ctrl-D ends",
                  highlight=False)
    turns: list[dict] = []
    while True:
        try:
            line = input("you> " if tty else "")
        except EOFError:
            break
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            break
        if text == "/reset":
            turns = []
            continue
        turns.append({"role": "user", "content": text})
        answer = reply(turns)
        turns.append({"role": "assistant", "content": answer})
        console.print(answer, highlight=False, markup=False)


@app.command()
def models(config: Path = ConfigOpt, overrides: Optional[list[str]] = OverridesArg) -> None:
    """The registered versions of the config's model: aliases, the version each continued from, the day,
    the data it added, tokens trained, accuracy, the disk its training takes, and why each alias is where it is."""
    cfg = _load(config, overrides)
    store = _sqlite_file(cfg.resolved_tracking_uri)
    name = cfg.registry.model_name
    if store is not None and not store.is_file():
        console.print(f"no versions of '{escape(name)}': nothing is logged at {escape(str(store))} yet",
                      highlight=False)
        return
    from stages.tracking.registry import VERSION_COLUMNS, list_versions, version_cells
    try:
        versions = list_versions(cfg.resolved_tracking_uri, name, cfg.artifacts_path)
    except OSError as e:  # a tracking server that does not answer
        _fail(f"MLflow at {cfg.resolved_tracking_uri} did not answer ({e})", 1)
    if not versions:
        console.print(f"no versions of '{escape(name)}' registered yet", highlight=False)
        return
    table = Table(title=f"registered model {name}")
    for col in VERSION_COLUMNS:
        # in 100 columns only `why` (a sentence) wraps; every other cell stays one line
        table.add_column(col, no_wrap=col != "why", min_width=24 if col == "why" else None)
    for v in versions:
        table.add_row(*(escape(c) for c in version_cells(v)))
    console.print(table)


@app.command()
def champion(version: str = typer.Argument(..., help="the version to make champion, e.g. 3"),
             reason: str = typer.Option(..., "--reason", help="why: recorded on the version, shown by the next run"),
             config: Path = ConfigOpt, overrides: Optional[list[str]] = OverridesArg) -> None:
    """The way back: move the config's `champion` alias to an earlier (or any) version, with a reason."""
    cfg = _load(config, overrides)
    store = _sqlite_file(cfg.resolved_tracking_uri)
    name = cfg.registry.model_name
    if store is not None and not store.is_file():
        _fail(f"no versions of '{name}': nothing is logged at {store} yet")
    from stages.tracking.registry import set_champion
    try:
        done = set_champion(cfg.resolved_tracking_uri, name, version.removeprefix("v"), reason)
    except ValueError as e:
        _fail(str(e))
    except OSError as e:  # a tracking server that does not answer
        _fail(f"MLflow at {cfg.resolved_tracking_uri} did not answer ({e})", 1)
    was = f" (was v{done['replaced']})" if done["replaced"] and done["replaced"] != done["version"] else ""
    console.print(f"{escape(name)}@champion -> v{done['version']}{was}: {escape(done['reason'])}", highlight=False)


@app.command()
def export(model: Optional[str] = typer.Option(None, "--model", "-m", help="models:/name/N or @alias, a train stage "
                                               "folder or a Hugging Face folder; default: the config's champion"),
           config: Optional[Path] = typer.Option(None, "--config", "-c", help="find the champion and "
                                                 "eval.max_new_tokens here"),
           out: Path = typer.Option(Path("exports"), "--out", help="folder for <name>-<TYPE>.gguf and Modelfile"),
           type_: str = typer.Option("f16", "--type", help="f32, f16, bf16 or q8_0"),
           name: Optional[str] = typer.Option(None, "--name", help="the model's name in the file")) -> None:
    """A registered version or a trained folder as GGUF (llama.cpp, Ollama) with an Ollama Modelfile."""
    if model is None and config is None:
        _fail("give --model (models:/name/N, a folder) or -c CONFIG (its champion)")
    cfg = _load(config, []) if config is not None else None
    ref = model or f"models:/{cfg.registry.model_name}@champion"
    uri = cfg.resolved_tracking_uri if cfg else os.environ.get("MLFLOW_TRACKING_URI") or default_tracking_uri()
    store = _sqlite_file(uri)
    if ref.startswith("models:/") and store is not None and not store.is_file():  # opening one creates it
        _fail(f"{ref}: no MLflow store at {store}" + ("" if cfg is not None else " (give -c CONFIG)"))
    pinned, registered, version = _pinned(ref, uri)
    prepare_dir = None
    if version is not None:
        # `<model>-v<N>`, never `<model>-champion`: the next champion's export would overwrite this one
        name = name or f"{registered}-v{version}"
        if cfg is not None:  # the rows it trained on, for the Modelfile's SYSTEM (a folder's manifest names its own)
            from stages.tracking.registry import version_tag
            fp = version_tag(uri, registered, version, "prepare_fingerprint")
            prepare_dir = cfg.artifacts_path / "prepare" / fp if fp else None
    from stages.export.gguf import export_gguf
    from stages.models.refs import resolve_model_ref
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        try:
            folder = resolve_model_ref(pinned, uri, tmp)
        except ValueError as e:
            _fail(str(e))
        try:
            done = export_gguf(folder, out, type_, name, cfg.eval.max_new_tokens if cfg else None,
                               say=lambda line: err.print(escape(line), highlight=False), prepare_dir=prepare_dir)
        except ConfigError as e:
            _fail(str(e))
    for note in done.notes:
        err.print(f"note: {escape(note)}", highlight=False)
    console.print(f"exported {escape(pinned if pinned == ref else f'{ref} (v{version})')} ({done.architecture}, "
                  f"{done.type}) to {escape(str(done.gguf))}; "
                  f"Ollama: `ollama create NAME -f {escape(str(done.modelfile))}`", highlight=False, soft_wrap=True)


@app.command()
def gc(config: Path = ConfigOpt, overrides: Optional[list[str]] = OverridesArg,
       yes: bool = typer.Option(False, "--yes", help="delete; without it, a dry run that only says what it would "
                                "free and why")) -> None:
    """Free the disk per the config's `retention` policy: what it would free and why (a dry run), --yes deletes."""
    cfg = _load(config, overrides)
    try:  # the folders the config's next run would reuse are kept whatever their age
        protect = dict(plan(cfg).fingerprints)
    except (ConfigError, StageError) as e:
        err.print(f"note: the config can't be planned now ({escape(str(e))}); only the registry's versions and "
                  "recent use keep folders", highlight=False)
        protect = None
    from stages.retention import collect
    try:
        collect(cfg, protect=protect, delete=yes, on_line=lambda line: console.print(escape(line), highlight=False))
    except OSError as e:  # a tracking server that does not answer
        _fail(f"MLflow at {cfg.resolved_tracking_uri} did not answer ({e})", 1)


@app.command()
def serve(config: Path = ConfigOpt, overrides: Optional[list[str]] = OverridesArg,
          cron: Optional[str] = typer.Option(None, "--cron", help='cron schedule, e.g. "0 3 * * *"'),
          interval: Optional[float] = typer.Option(None, "--interval", help="seconds between runs"),
          name: str = typer.Option("sftflow-retrain", "--name", help="deployment name"),
          start_server: bool = typer.Option(False, "--start-server", help="start a local Prefect server first"),
          host: str = typer.Option("127.0.0.1", help="--start-server host"),
          port: int = typer.Option(4200, help="--start-server port"),
          allow_override: list[str] = typer.Option([], "--allow-override", help="let runs started through the "
                                                   "Prefect API override this protected key "
                                                   f"({', '.join(SERVE_PROTECTED)}); repeatable"),
          on_data: bool = typer.Option(False, "--on-data", help="also run when `sftflow notify` says new data "
                                       "arrived (a Prefect event)"),
          within: float = typer.Option(60, "--within", min=0, help="--on-data: arrivals within this many seconds "
                                       "of the one that started a run start no other")) -> None:
    """Retrain on a schedule and/or when data arrives: serve the flow as a Prefect deployment (blocks; Ctrl-C stops)."""
    cfg = _load(config, overrides)
    if cron is not None and interval is not None:
        _fail("give at most one of --cron or --interval")
    if cron is None and interval is None and not on_data:
        _fail("give --cron, --interval or --on-data (or --on-data with one of them)")
    arrivals = cfg.registry.model_name if on_data else None
    for key in allow_override:
        if key not in SERVE_PROTECTED:
            _fail(f"--allow-override {key}: not a protected key; protected: {', '.join(SERVE_PROTECTED)}")
    _prefect_home(cfg)
    from flows.prefect_server import local_server
    from flows.serve import serve as serve_flow
    if start_server:
        home = Path(os.environ["PREFECT_HOME"])
        with local_server(host, port, home, home.parent / "prefect-server.log", shared=True) as api:
            os.environ["PREFECT_API_URL"] = api
            console.print(f"Prefect UI: http://{host}:{port}  (API {api}); serving deployment '{name}'")
            serve_flow(str(config), overrides or [], name, cron, interval, allow_override, arrivals, within)
        return
    if not os.environ.get("PREFECT_API_URL"):
        _fail("serving needs a running Prefect server: `make serve`, or `sftflow serve --start-server`, "
              "or set PREFECT_API_URL")
    serve_flow(str(config), overrides or [], name, cron, interval, allow_override, arrivals, within)


@app.command()
def notify(files: list[Path] = typer.Option([], "--file", "-f", help="a file that arrived (named on the event); "
                                            "repeatable"),
           config: Path = ConfigOpt, overrides: Optional[list[str]] = OverridesArg) -> None:
    """Say that new data arrived: a `sftflow.data.arrived` Prefect event that `sftflow serve --on-data` runs on."""
    cfg = _load(config, overrides)
    missing = [str(f) for f in files or [] if not f.exists()]
    if missing:
        _fail(f"no such file: {missing[0]}")
    _prefect_home(cfg)
    from flows.prefect_server import running_server
    api = os.environ.get("PREFECT_API_URL") or (running_server(Path(os.environ["PREFECT_HOME"])) or {}).get("api")
    if not api:
        _fail("no Prefect server to tell: `sftflow serve --on-data --start-server -c <config>` runs one on this "
              "config's artifacts dir, or set PREFECT_API_URL", 1)
    os.environ["PREFECT_API_URL"] = api
    from flows.events import emit_arrival
    try:
        event = emit_arrival(cfg.registry.model_name, [f.resolve() for f in files or []], config.resolve())
    except Exception as e:  # noqa: BLE001 - the server's answer, in one line
        _fail(f"Prefect at {api} did not take the event: {type(e).__name__}: {str(e).strip()[:200]}", 1)
    console.print(f"sent sftflow.data.arrived for '{escape(cfg.registry.model_name)}' ({len(files or [])} file(s)) "
                  f"to {api}: event {event}", highlight=False)


@app.command()
def sweep(config: Path = ConfigOpt,
          grid: list[str] = typer.Argument(..., help="KEY=V1,V2,... (a grid axis) or KEY=VALUE (fixed)"),
          metric: str = typer.Option("accuracy", "--metric", help="pick the best trial by this eval metric: accuracy, "
                                     "eval_loss (lower is better), or <set>/accuracy"),
          max_parallel: int = typer.Option(1, "--max-parallel", min=1, help="trainings at once")) -> None:
    """A grid of trials in one flow run: prepare once, train -> evaluate per trial, register the best."""
    from stages.sweep import parse_grid, plan_trials
    try:
        fixed, axes = parse_grid(grid)
        trials = plan_trials(config, fixed, axes)
    except ConfigError as e:
        _fail(str(e))
    if trials[0].plan.cfg.eval.model is not None:
        _fail("eval.model is for `sftflow stage evaluate --model`: a sweep registers a model it trains")
    sets = trials[0].plan.cfg.eval.set_names
    if "/" in metric and metric.split("/", 1)[0] not in sets:
        _fail(f"--metric {metric}: no eval set '{metric.split('/', 1)[0]}'; sets: {', '.join(sets)}")
    console.print(f"sweep: {len(trials)} trials over {', '.join(axes)}")
    _prefect_home(trials[0].plan.cfg)

    with _on_prefect("flows.sweep", "sft_sweep") as sft_sweep:
        out = sft_sweep(config_path=str(config), args=grid, metric=metric, max_parallel=max_parallel,
                        planned=[{"index": t.index, "values": t.values, "plan": t.plan.to_dict()} for t in trials])
    _sweep_summary(out, metric)


def _sweep_summary(out: dict, metric: str) -> None:
    from flows.sweep import trial_table  # loaded: the sweep flow ran; its markdown summary is the same table
    columns, rows = trial_table(out["trials"], out["order"], metric)
    table = Table(title=f"trials by {metric}, best first")
    for col in columns:
        table.add_column(col)
    for row in rows:
        table.add_row(*row)
    console.print(table)
    by_index = {t["index"]: t for t in out["trials"]}
    reg = out["register"]["metrics"]
    best = by_index[out["best"]]["values"]
    console.print(f"best trial {' '.join(f'{k}={v}' for k, v in best.items())}: "
                  f"registered model version {reg['version']} "
                  f"({', '.join(reg['aliases']) or 'no alias'})"
                  + (f": {escape(reg['alias_reason'])}" if reg.get("alias_reason") else ""))


@app.command()
def deploy(config: Path = ConfigOpt, overrides: Optional[list[str]] = OverridesArg,
           pool: str = typer.Option(..., "--pool", help="work pool (a `process` pool is created if missing)"),
           name: str = typer.Option("sftflow-retrain", "--name", help="deployment name"),
           cron: Optional[str] = typer.Option(None, "--cron", help='cron schedule, e.g. "0 3 * * *"'),
           interval: Optional[float] = typer.Option(None, "--interval", help="seconds between runs"),
           allow_override: list[str] = typer.Option([], "--allow-override", help="as for `serve`; repeatable"),
           on_data: bool = typer.Option(False, "--on-data", help="also run when `sftflow notify` says new data "
                                        "arrived (a Prefect event), on whichever worker takes it"),
           within: float = typer.Option(60, "--within", min=0, help="as for `serve --on-data`")) -> None:
    """Deploy the flow to a Prefect work pool: `prefect worker start --pool NAME` runs it (needs PREFECT_API_URL)."""
    p = _plan_or_exit(config, overrides)  # a config that can't plan here is not deployed
    for key in allow_override:
        if key not in SERVE_PROTECTED:
            _fail(f"--allow-override {key}: not a protected key; protected: {', '.join(SERVE_PROTECTED)}")
    if not os.environ.get("PREFECT_API_URL"):
        _fail("deploying needs a Prefect server that workers reach: set PREFECT_API_URL")
    _prefect_home(p.cfg)
    from flows.deploy import deploy as deploy_flow, ensure_work_pool
    try:
        if ensure_work_pool(pool):
            console.print(f"created work pool '{pool}' (type process)")
        deployment = deploy_flow(str(config), overrides or [], name, pool, cron, interval, allow_override,
                                 p.cfg.registry.model_name if on_data else None, within)
    except Exception as e:  # noqa: BLE001 - the server's answer, in one line
        _fail(f"deploy failed: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}", code=1)
    console.print(f"deployed '{deployment}' to work pool '{pool}'; start a worker with "
                  f"`prefect worker start --pool {pool}`, run it with `prefect deployment run '{deployment}'`"
                  + (" or `sftflow notify`" if on_data else ""))


@app.command("stop-server")
def stop_server(config: Path = ConfigOpt) -> None:
    """Stop the Prefect server kept from earlier runs on this config's artifacts dir now, instead
    of after SFTFLOW_KEEP_SERVER seconds unused."""
    _prefect_home(_load(config, []))
    from flows.prefect_server import stop_kept_server
    try:
        api = stop_kept_server(Path(os.environ["PREFECT_HOME"]))
    except RuntimeError as e:
        _fail(str(e), code=1)
    console.print(f"stopped the kept Prefect server at {api}" if api else "no kept Prefect server is running")


@app.command()
def ui(config: Path = ConfigOpt) -> None:
    """The Prefect UI over this config's flow runs (its Prefect home), without scheduling anything:
    the server kept from earlier runs, or one started and kept now, held until Ctrl-C."""
    cfg = _load(config, [])
    if os.environ.get("PREFECT_API_URL"):
        console.print(f"Prefect UI: {os.environ['PREFECT_API_URL'].removesuffix('/api').rstrip('/')}/runs "
                      "(PREFECT_API_URL's server)", highlight=False)
        return
    _prefect_home(cfg)
    from flows import prefect_server as ps
    home = Path(os.environ["PREFECT_HOME"])
    with ps.lease(home):  # the server stays up while this command runs
        found = ps.running_server(home)
        try:
            api = found["api"] if found else ps.start_kept_server(home, max(ps.keep_seconds(), ps.DEFAULT_KEEP_S))
        except (ps.KeepSettingError, ps.ServerDidNotStart) as e:
            _fail(str(e), code=1)
        console.print(f"Prefect UI: {api.removesuffix('/api')}/runs (flow runs of {home}); Ctrl-C stops "
                      "holding it (the server then stops once unused)", highlight=False)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass


def _stop(signum, frame) -> None:
    # Ctrl-C and SIGTERM unwind alike, so the launcher's cleanup kills the torchrun tree. The
    # exception can be lost (raised inside a finalizer), so torchrun is told directly as well.
    request_stop()
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> None:
    import signal
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


if __name__ == "__main__":
    main()
