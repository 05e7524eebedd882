"""A sweep in MLflow: a parent run whose children are the trials' own runs (one per train
fingerprint, as for any training), so the UI's compare view lines up their params and eval
metrics (parallel coordinates of the grid's keys against accuracy).

Observability only (`__fingerprint__ = False`). The parent is found again by the sweep's identity
(its config and its trials' train fingerprints), so re-running a sweep updates one parent run.
"""

from __future__ import annotations

import hashlib

from stages.core.cache.artifacts import canonical_json
from stages.core.config import SFTConfig

from .live import eval_metric_values, send_values
from .run import NOTE_TAG, RUN_TAG, TAG, setup_mlflow

__fingerprint__ = False

SWEEP_TAG = TAG + "sweep_id"


def record_sweep(cfg: SFTConfig, name: str, axes: dict[str, list[str]], metric: str,
                 trials: list[tuple[dict[str, str], str, dict]], best_fp: str, prefect_url: str | None) -> str:
    """Creates (or finds) the sweep's parent run and makes each trial's run its child, with the trial's
    eval metrics; `trials`: (grid values, train fingerprint, evaluate metrics). Returns the parent's id."""
    from mlflow.entities import Param
    from mlflow.tracking import MlflowClient
    setup_mlflow(cfg)
    client = MlflowClient()
    exp = client.get_experiment_by_name(cfg.registry.experiment)
    sweep_id = hashlib.sha256(canonical_json({"name": name,
                                              "trials": sorted(fp for _, fp, _ in trials)}).encode()).hexdigest()[:16]
    found = client.search_runs([exp.experiment_id], filter_string=f"tags.`{SWEEP_TAG}` = '{sweep_id}'", max_results=1)
    if found:
        parent = found[0].info.run_id
    else:
        note = f"Sweep of {len(trials)} trials over {', '.join(axes)}, best by `{metric}`."
        if prefect_url:
            note += f"\n\n- Prefect flow run: [{prefect_url}]({prefect_url})"
        parent = client.create_run(exp.experiment_id, run_name=f"sweep-{name}-{sweep_id[:8]}",
                                   tags={SWEEP_TAG: sweep_id, NOTE_TAG: note}).info.run_id
        client.log_batch(parent, params=[Param(f"sweep.{k}", ",".join(dict.fromkeys(v))) for k, v in axes.items()]
                         + [Param("sweep.metric", metric)])
    best_run = None
    for values, fp, eval_metrics in trials:
        runs = client.search_runs([exp.experiment_id], filter_string=f"tags.`{RUN_TAG}` = '{fp}'", max_results=1)
        if not runs:  # trained without MLflow reachable: nothing to attach
            continue
        run_id = runs[0].info.run_id
        best_run = run_id if fp == best_fp else best_run
        if "eval/accuracy" not in runs[0].data.metrics:  # else register logged them (the best trial), or a re-run
            send_values(client, run_id, eval_metric_values(eval_metrics))
        client.set_tag(run_id, "mlflow.parentRunId", parent)
        client.set_tag(run_id, TAG + "sweep_trial", " ".join(f"{k}={v}" for k, v in values.items()))
    if best_run:
        client.set_tag(parent, TAG + "best_run_id", best_run)
    client.set_terminated(parent, "FINISHED")
    return parent
