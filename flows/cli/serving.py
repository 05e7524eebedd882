"""`sftflow serve | notify | sweep | deploy | stop-server | ui`: beyond one run of one config. Retrain
on a schedule or when `notify` says data arrived (a served deployment, or one on a work pool that
`deploy` makes), a grid of trials in one flow run, and the Prefect server they use: stop the one
kept from earlier runs, or hold it open for its UI. flows/cli/__init__.py adds them to its app.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table

from flows.cli.common import ConfigOpt, OverridesArg, _fail, _load, _on_prefect, _plan_or_exit, _prefect_home, console
from stages.core.config import SERVE_PROTECTED, ConfigError


def register(app: typer.Typer) -> None:
    """Adds this family's commands to `app` (flows/cli/__init__.py's), in the order `sftflow --help` lists them."""
    for command in (serve, notify, sweep, deploy):
        app.command()(command)
    app.command("stop-server")(stop_server)
    app.command()(ui)


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
    from flows.servers.prefect_server import local_server
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


def notify(files: list[Path] = typer.Option([], "--file", "-f", help="a file that arrived (named on the event); "
                                            "repeatable"),
           config: Path = ConfigOpt, overrides: Optional[list[str]] = OverridesArg) -> None:
    """Say that new data arrived: a `sftflow.data.arrived` Prefect event that `sftflow serve --on-data` runs on."""
    cfg = _load(config, overrides)
    missing = [str(f) for f in files or [] if not f.exists()]
    if missing:
        _fail(f"no such file: {missing[0]}")
    _prefect_home(cfg)
    from flows.servers.prefect_server import running_server
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


def stop_server(config: Path = ConfigOpt) -> None:
    """Stop the Prefect server kept from earlier runs on this config's artifacts dir now, instead
    of after SFTFLOW_KEEP_SERVER seconds unused."""
    _prefect_home(_load(config, []))
    from flows.servers.prefect_server import stop_kept_server
    try:
        api = stop_kept_server(Path(os.environ["PREFECT_HOME"]))
    except RuntimeError as e:
        _fail(str(e), code=1)
    console.print(f"stopped the kept Prefect server at {api}" if api else "no kept Prefect server is running")


def ui(config: Path = ConfigOpt) -> None:
    """The Prefect UI over this config's flow runs (its Prefect home), without scheduling anything:
    the server kept from earlier runs, or one started and kept now, held until Ctrl-C."""
    cfg = _load(config, [])
    if os.environ.get("PREFECT_API_URL"):
        console.print(f"Prefect UI: {os.environ['PREFECT_API_URL'].removesuffix('/api').rstrip('/')}/runs "
                      "(PREFECT_API_URL's server)", highlight=False)
        return
    _prefect_home(cfg)
    from flows.servers import prefect_server as ps
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
