"""A drop the data gate stopped (data.max_bad_fraction), recorded in MLflow where a person browsing the
experiment finds it: a failed run in the config's experiment, tagged `sftflow.gate=rejected`, whose
description is the gate's line, with the counts as metrics and the quarantined rows as an artifact.
Before this only the Prefect run and the log knew; the experiment showed no trace of the day."""

from __future__ import annotations

from pathlib import Path

from stages.core.config import SFTConfig

from .run import NOTE_TAG, TAG, ensure_experiment, reachable

GATE_TAG = TAG + "gate"  # "rejected" on a run the gate stopped


def record_rejected(cfg: SFTConfig, gate: dict, line: str, moved_to: str | None = None,
                    tags: dict[str, str] | None = None) -> str:
    """The id of a FAILED run `rejected <file>` in the config's experiment for the gate's stop `gate`
    (quarantine.gate_error's record) and its one-line error `line`; `moved_to`: where the file went."""
    from mlflow.tracking import MlflowClient

    from .live import send_values
    uri = cfg.resolved_tracking_uri
    reachable(uri)  # a server that is down costs seconds here, not minutes of client retries
    experiment_id = ensure_experiment(uri, cfg.registry.experiment, cfg.artifacts_path)
    client = MlflowClient(uri)
    what = gate["what"]
    note = line + (f"\n\nThe file was moved to {moved_to}; later runs go on without it." if moved_to else "")
    run_tags = {GATE_TAG: "rejected", TAG + "gate_stage": gate["stage"], TAG + "gate_file": what,
                NOTE_TAG: note, "mlflow.source.name": "sftflow data gate", "mlflow.source.type": "JOB",
                **({TAG + "gate_moved_to": moved_to} if moved_to else {}),
                **{k: v for k, v in (tags or {}).items() if v}}
    name = Path(what).name if not what.startswith("the ") else what.removeprefix("the ")
    run_id = client.create_run(experiment_id, run_name=f"rejected {name}", tags=run_tags).info.run_id
    client.log_param(run_id, "data.max_bad_fraction", gate["limit"])
    quarantined = sum(gate["dropped"].values())
    send_values(client, run_id, {"data.rows_read": gate["rows_read"], "data.rows_quarantined": quarantined,
                                 **{f"data.quarantined.{r}": n for r, n in sorted(gate["dropped"].items())}})
    if Path(gate["quarantine_file"]).is_file():
        client.log_artifact(run_id, gate["quarantine_file"], artifact_path="data")
    client.set_terminated(run_id, "FAILED")
    return run_id
