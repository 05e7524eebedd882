"""`python -m stages.tracking.ui CONFIG [--port N] [--print-only]` (what `make ui CONFIG=...` runs):
prints the runs page of the config's experiment (`registry.experiment` in `registry.tracking_uri`'s
store), or says that nothing was logged there yet, then serves the MLflow UI over that store.

It never creates an experiment or a store: a link to an empty experiment it made itself would send
a person to "No runs logged". With a tracking server as the URI, the server is the UI: the link is
printed and nothing is started."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from stages.core.config import load_config
from stages.core.errors import ConfigError

from .run import VIEW_TAG, runs_url

__fingerprint__ = False


def find_experiment(uri: str, name: str):
    """The experiment in the store, or None when the store or the experiment does not exist."""
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).is_file():
        return None
    from mlflow.tracking import MlflowClient
    return MlflowClient(tracking_uri=uri).get_experiment_by_name(name)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m stages.tracking.ui", description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("--port", type=int, default=5000)
    ap.add_argument("--print-only", action="store_true", help="print the link, start no UI")
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.config)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    uri, name = cfg.resolved_tracking_uri, cfg.registry.experiment
    local = not uri.startswith(("http://", "https://"))
    ui = f"http://127.0.0.1:{args.port}" if local else uri.rstrip("/")
    found = find_experiment(uri, name)
    if found is None:
        print(f"MLflow UI: {ui} — nothing logged to experiment '{name}' yet; "
              f"`sftflow run -c {args.config}` logs its first run there", flush=True)
    else:
        link = runs_url(ui, found.experiment_id, VIEW_TAG in found.tags)
        print(f"MLflow UI, experiment '{name}': {link}", flush=True)
    if args.print_only or not local:
        return 0
    store = Path(uri.removeprefix("sqlite:///")) if uri.startswith("sqlite:///") else None
    artifacts = (store.parent if store else cfg.artifacts_path) / "mlartifacts"
    print(f"starting the MLflow UI on {ui} (it answers in a few seconds; Ctrl-C stops it)", flush=True)
    mlflow_bin = shutil.which("mlflow", path=str(Path(sys.executable).parent)) or "mlflow"
    # one worker: the UI answers sooner on a small machine, and one person browses it
    os.execv(mlflow_bin, [mlflow_bin, "ui", "--host", "127.0.0.1", "--port", str(args.port), "--workers", "1",
                          "--backend-store-uri", uri, "--default-artifact-root", str(artifacts)])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
