"""The sweep flow: one Prefect flow run for a grid of trials (`stages/sweep.py` plans them).

prepare and the baseline (the base model's scores) once per distinct fingerprint, then train ->
evaluate per trial (one at a time, or `max_parallel` trainings at once in the sweep's own thread
pool), then the champion stage and register for the best trial by the chosen metric under the
config's promotion rules. Trials already trained or
evaluated are cache hits. MLflow gets a parent run with the trials' runs as its children; the
flow run's summary is a table of trials, best first.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run
from prefect.task_runners import ThreadPoolTaskRunner

from stages.core.errors import ConfigError
from stages.sweep import Trial, lower_is_better, metric_of, parse_grid, plan_trials, ranked
from stages.pipeline import Plan, upstream

from flows.sft import at_flow_start, run_stage_task, update_flow_run, shown, configured_task, flow_run_url


def _sweep_name() -> str:
    params = flow_run.parameters
    return f"sweep-{Path(params.get('config_path') or 'sftflow').stem}"


def _trials(config_path: str, args: list[str], planned: list[dict] | None) -> list[Trial]:
    if planned is not None:
        return [Trial(t["index"], t["values"], Plan.from_dict(t["plan"])) for t in planned]
    fixed, axes = parse_grid(args)
    return plan_trials(config_path, fixed, axes)


# stages trials share when their fingerprints agree: run once per sweep, in this order
SHARED = ("replay", "prepare", "prepare_eval", "baseline")


def _shared_states(t: Trial, done: dict[tuple[str, str], Any]) -> dict[str, Any]:
    return {s: done[(s, t.plan.fingerprints[s])] for s in SHARED if s in t.plan.fingerprints}


def _run_shared(trials: list[Trial]) -> dict[tuple[str, str], Any]:
    """(stage, fingerprint) -> final state of prepare and the baseline, each distinct one run once: a
    sweep scores the base model once, not once per trial (and the champion once, for the best trial
    that register compares with it)."""
    done: dict[tuple[str, str], Any] = {}
    for t in trials:
        for stage in (s for s in SHARED if s in t.plan.fingerprints):
            key = (stage, t.plan.fingerprints[stage])
            if key not in done:
                states = {u: done[(u, t.plan.fingerprints[u])] for u in upstream(t.plan, stage) if u in SHARED}
                run_stage_task(stage, t.plan, False, states)
                done[key] = states[stage]
    return done


def _train_and_evaluate(trials: list[Trial], done: dict[tuple[str, str], Any], max_parallel: int) -> dict[int, dict]:
    """{trial index: {"train": result, "evaluate": result}}; with max_parallel > 1 every train is
    submitted before any evaluate, so the pool's threads go to trainings first. The pool is the
    sweep's own (max_parallel threads), whatever task runner the flow has: a sweep started by a
    deployment runs as many at once as one started from the CLI."""
    out: dict[int, dict] = {t.index: {} for t in trials}
    if max_parallel <= 1:
        for t in trials:
            states = _shared_states(t, done)
            out[t.index]["train"] = run_stage_task("train", t.plan, False, states, t.label)
            out[t.index]["evaluate"] = run_stage_task("evaluate", t.plan, False, states, t.label)
        return out
    futures: dict[tuple[int, str], Any] = {}
    with ThreadPoolTaskRunner(max_workers=max_parallel) as pool:
        for stage in ("train", "evaluate"):
            for t in trials:
                task, kwargs = configured_task(stage, t.plan, False, t.label)
                shared = _shared_states(t, done)
                after = [shared["prepare"]] if stage == "train" else [*shared.values(), futures[(t.index, "train")]]
                futures[(t.index, stage)] = pool.submit(task, parameters=kwargs, wait_for=after)
        for (i, stage), future in futures.items():
            future.wait()
            out[i][stage] = dict(future.state.result())
    return out


def trial_table(trials: list[dict], order: list[int], metric: str) -> tuple[list[str], list[list[str]]]:
    """(columns, text cells per trial, best first) for trials as `sft_sweep` returns them ({"index",
    "values", "train", "evaluate"}): what its markdown summary and `sftflow sweep` print."""
    keys, by_index = list(trials[0]["values"]), {t["index"]: t for t in trials}
    extra = [(k, label) for k, label in (("accuracy", "accuracy"), ("eval_loss", "eval loss")) if k != metric]
    rows = []
    for rank, i in enumerate(order, 1):
        t = by_index[i]
        m = t["evaluate"]["metrics"]
        rows.append([str(rank), *(t["values"][k] for k in keys), shown(metric_of(m, metric)),
                     *(shown(m.get(k)) for k, _ in extra), "cached" if t["train"]["cached"] else "yes",
                     t["train"]["fingerprint"]])
    # the ranking metric once, by its name (with --metric accuracy no second accuracy column)
    return ["rank", *keys, metric, *(label for _, label in extra), "trained", "train fingerprint"], rows


def _publish(finished: list[dict], order: list[int], metric: str, registered: dict | None, mlflow_note: str) -> None:
    columns, rows = trial_table(finished, order, metric)
    lines = [f"**Sweep** of {len(finished)} trials by `{metric}` "
             f"({'lower' if lower_is_better(metric) else 'higher'} is better), best first",
             "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(row[:-1] + [f"`{row[-1]}`"]) + " |" for row in rows]
    if registered:
        m = registered["metrics"]
        lines += ["", f"**Registered** the best trial as version {m['version']} "
                      f"(aliases: {', '.join(m['aliases']) or 'none'}): {m.get('alias_reason', '')}"]
    if mlflow_note:
        lines += ["", mlflow_note]
    create_markdown_artifact("\n".join(lines), key="sftflow-sweep", description=f"sweep: {len(finished)} trials")


@flow(name="sft_sweep", log_prints=True, flow_run_name=_sweep_name)
def sft_sweep(config_path: str, args: list[str], metric: str = "accuracy", max_parallel: int = 1,
              planned: list[dict] | None = None, workdir: str | None = None) -> dict:
    """`args`: the command line's `KEY=V1,V2,...` grid and `KEY=VALUE` fixed overrides. `planned`: the
    CLI's trials (`{"index", "values", "plan"}`), used instead of planning again."""
    at_flow_start()
    if workdir:
        os.chdir(workdir)
    logger = get_run_logger()
    trials = _trials(config_path, args, planned)
    done = _run_shared(trials)
    results = _train_and_evaluate(trials, done, max_parallel)
    order = ranked([(i, metric_of(r["evaluate"]["metrics"], metric)) for i, r in results.items()], metric)
    if metric_of(results[order[0]]["evaluate"]["metrics"], metric) is None:
        raise ConfigError(f"--metric {metric}: no trial's evaluation has it (e.g. accuracy, eval_loss, <set>/accuracy)")
    best = next(t for t in trials if t.index == order[0])
    logger.info(f"best trial: {best.label} "
                f"({metric} {shown(metric_of(results[best.index]['evaluate']['metrics'], metric))})")
    states = _shared_states(best, done)
    if "champion" in best.plan.fingerprints:
        run_stage_task("champion", best.plan, False, states, best.label)
    registered = run_stage_task("register", best.plan, False, states, best.label)
    mlflow_note = ""
    try:
        from stages.tracking.sweep import record_sweep
        parent = record_sweep(best.plan.cfg, Path(config_path).stem,
                              {k: [t.values[k] for t in trials] for k in best.values}, metric,
                              [(t.values, t.plan.fingerprints["train"], results[t.index]["evaluate"]["metrics"])
                               for t in trials], best.plan.fingerprints["train"], flow_run_url())
        mlflow_note = f"**MLflow**: parent run `{parent}` with the {len(trials)} trial runs as its children"
    except Exception as e:  # noqa: BLE001 - tracking never fails a sweep whose models are built
        logger.warning(f"mlflow: the sweep's parent run was not recorded ({type(e).__name__}: {e})")
    finished = [{"index": t.index, "values": t.values, "train": results[t.index]["train"],
                 "evaluate": results[t.index]["evaluate"]} for t in trials]
    _publish(finished, order, metric, registered, mlflow_note)
    trained = sum(not r["train"]["cached"] for r in results.values())
    new = [f"trials:{len(trials)}", f"trained:{trained}", f"version:{registered['metrics']['version']}",
           f"model:{best.plan.cfg.registry.model_name}"]
    update_flow_run(tags=new + [t for t in (flow_run.tags or []) if t not in new])
    return {"trials": finished, "order": order, "best": best.index, "register": registered}
