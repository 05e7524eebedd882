"""What every `sftflow` command shares (flows/cli/__init__.py and its command families, registry.py and
serving.py): the consoles (stdout for results, stderr for notes and errors; a file or a pipe
gets whole table rows), the `-c/--config` option and the overrides argument, a config problem as
one line with exit code 2, the config's Prefect home, the plan a command validates once, and a flow
called on the Prefect API whose failure ends as one line.
"""

from __future__ import annotations

import importlib
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional

import typer
from rich.console import Console
from rich.markup import escape

from flows.servers.prefect_server import KeepSettingError, ServerDidNotStart, prefect_api
from stages.core.config import ConfigError, SFTConfig, load_config
from stages.core.errors import StageError
from stages.pipeline import Plan, plan

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


def _say(message: str) -> None:
    err.print(message, highlight=False)


@contextmanager
def _on_prefect(module: str, name: str, warm: Callable[[], object] | None = None) -> Iterator[Callable]:
    """The flow `module.name`, to be called on the Prefect API `prefect_api` picks (PREFECT_API_URL,
    else a local server on PREFECT_HOME: flows/servers/prefect_server.py); its failure ends as one line
    (Prefect's log above has the details). Importing the flow (Prefect: seconds) happens while a
    server starts rather than before it, and so does `warm` (the imports of the stages the run computes)."""
    def load_flow() -> Callable:
        return getattr(importlib.import_module(module), name)

    def meanwhile() -> None:
        load_flow()
        if warm is not None:
            warm()
    try:
        with prefect_api(Path(os.environ["PREFECT_HOME"]), meanwhile=meanwhile, say=_say):
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
