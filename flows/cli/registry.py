"""`sftflow chat | models | champion | export | gc`: the registered model and what it keeps. Chat with
a version (or a folder), list the registered versions and why each alias is where it is, move the
champion alias back, export a version as GGUF, and free the disk per the retention policy; models:/
references are pinned to the version the registry names now. flows/cli/__init__.py adds them to its app.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table

from flows.cli.common import ConfigOpt, OverridesArg, _fail, _load, console, err
from stages.core.config import ConfigError, default_tracking_uri
from stages.core.errors import StageError
from stages.pipeline import plan


def register(app: typer.Typer) -> None:
    """Adds this family's commands to `app` (flows/cli/__init__.py's), in the order `sftflow --help` lists them."""
    for command in (chat, models, champion, export, gc):
        app.command()(command)


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
    try:  # a LoRA version loads as its base (by content: artifacts/bases/, else the MLflow store) + its adapter
        m, tok = load(path, precision=cfg.actor.precision if cfg is not None else "auto",
                      roots=(cfg.artifacts_path,) if cfg is not None else ())
    except (ValueError, RuntimeError) as e:  # base.json unreadable, its base nowhere
        _fail(f"{model}: {e}")

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
    from stages.tracking.registry import VERSION_COLUMNS, bases_note, list_versions, version_cells
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
    for line in bases_note(versions, cfg.artifacts_path):
        console.print(escape(line), highlight=False)


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
                               say=lambda line: err.print(escape(line), highlight=False), prepare_dir=prepare_dir,
                               roots=(cfg.artifacts_path,) if cfg is not None else ())
        except ConfigError as e:
            _fail(str(e))
    for note in done.notes:
        err.print(f"note: {escape(note)}", highlight=False)
    console.print(f"exported {escape(pinned if pinned == ref else f'{ref} (v{version})')} ({done.architecture}, "
                  f"{done.type}) to {escape(str(done.gguf))}; "
                  f"Ollama: `ollama create NAME -f {escape(str(done.modelfile))}`", highlight=False, soft_wrap=True)


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
