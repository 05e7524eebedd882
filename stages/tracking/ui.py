"""`python -m stages.tracking.ui TRACKING_URI EXPERIMENT UI_URL`: prints the experiment's runs page,
creating the store and the experiment first when missing (`make ui` runs it before `mlflow ui`)
so the link works before the first run, with every artifact location under the artifacts folder."""

from __future__ import annotations

import sys
from pathlib import Path

from .run import ensure_experiment, runs_url

__fingerprint__ = False


def main(argv: list[str]) -> None:
    uri, experiment, ui = argv
    artifacts = Path(uri.removeprefix("sqlite:///")).parent
    artifacts.mkdir(parents=True, exist_ok=True)
    print(f"MLflow UI, experiment '{experiment}': {runs_url(ui.rstrip('/'), ensure_experiment(uri, experiment, artifacts))}",
          flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
