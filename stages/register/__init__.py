"""register: eval results, artifacts and the model into the trained model's MLflow run; a
registered model version and its alias.

The run was opened before training (`tracking/run.py`: a readable name, a description linking the
Prefect flow run, params = the flattened config, tags, dataset inputs; step and system metrics
logged live by rank 0); register backfills any step metric the run lacks from `metrics.jsonl`, then
adds the eval metrics worth a chart (accuracy, base accuracy, loss; per named set accuracy, base
accuracy and delta), every eval number as the `eval/summary.json` table, the predictions as the
`eval/predictions.json` table (and the JSONL), the stage manifests and `metrics.jsonl`, and the chat
model (pyfunc, models-from-code, named after the registered model, typed, with an input example).
The version is tagged with fingerprints, data digest, config hash and accuracy;
`champion` moves per `registry.promote`:
  always     every new version becomes champion
  if_better  champion unless it is worse than the current champion by more than `registry.tolerance`
             on the primary set, both scored on this run's eval sets and compared item by item
             (the estimate, or the 95% interval's lower bound with `registry.decide_on: interval`),
             or worse on any other set by more than that set's `champion_tolerance` (default 0.1, on the
             paired estimate: `champion_guards`); otherwise the version becomes `challenger`. A version
             registered before (an older config run again) takes the alias back only when strictly
             better, and not worse on any other set beyond its tolerance: a tie moves nothing
  never      no alias
A set in `eval.sets` with `max_drop` guards promotion under `always` and `if_better`: a version
whose accuracy on it fell more than that below the base model's (per the set's `decide_on`)
becomes `challenger`, never `champion`. See docs/evaluation.md.
The decision and its reason are in the stage's manifest and the version's tags.
Registering a train fingerprint that already has a version reuses that version.
`registration.json` links the run's and the version's pages in the MLflow UI (`run_url`, `version_url`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from stages.core.cache import bases
from stages.core.chat import model_card
from stages.core.nf4 import quantize_record
from stages.core.cache.artifacts import StageBuild, read_manifest
from stages.core.config import SFTConfig
from stages.core.config.eval import EvalSetConfig
from stages.core.stats.paired import clears, compare_sets, describe, read_predictions
from stages.core.stats.scores import named_sets
from stages.tracking.registry import CHALLENGER, CHAMPION, promotion_lock, set_by_hand
from stages.tracking.live import (champion_metric_values, eval_metric_values, is_number, read_metrics_file, send_values,
                                  sync_rows)
from stages.core.errors import StageError
from stages.core.cache.lineage_paths import project_ref
from stages.tracking.run import (FLOW_RUN_ID, FLOW_RUN_URL, NOTE_TAG, RUN_TAG, TAG, Lineage, config_hash, data_digest,
                                 find_or_create_run, reachable, redact_uri, run_note, run_url, setup_mlflow, ui_url,
                                 version_url)

# shipped with the logged model as its code (found, not imported: register never needs torch itself):
# generation.py and what it imports of the project, each imported there by its bare name
CODE_PATHS = [importlib.util.find_spec(m).origin
              for m in ("stages.inference.generation", "stages.inference.weights", "stages.core.cache.bases",
                        "stages.core.machine.precision", "stages.core.machine.bf16_speed",
                        "stages.core.chat.chat_tokens", "stages.core.nf4", "stages.core.q4_1")]
PIP_REQUIREMENTS = ["torch", "transformers", "tokenizers", "safetensors", "mlflow", "pandas", "peft"]
UNION_HINT_WARNING = re.compile(r"^Union type hint")  # chat_model.py's, for log_model (it can't import the project)
# What the model page shows and `mlflow models serve` documents: a prompt and a conversation; its
# params are the signature's defaults (chat_model.MAX_NEW_TOKENS).
INPUT_EXAMPLE = (["Who are you?", [{"role": "user", "content": "Repeat after me: apple river stone"}]],
                 {"max_new_tokens": 128})


def _existing_version(client, name: str, train_fp: str):
    try:
        versions = client.search_model_versions(f"name='{name}'")
    except Exception:  # noqa: BLE001 - no such model yet (MLflow raises its own RestException)
        return None
    return next((v for v in versions if v.tags.get(RUN_TAG) == train_fp), None)


def failed_guards(eval_metrics: dict) -> list[str]:
    """One line per guarded eval set whose accuracy fell more than its max_drop below the base model's."""
    def line(name: str, m: dict) -> str:
        shown = describe(m["vs_base"], "the base model") if "vs_base" in m else f"{m['delta']:+.3f} vs the base model"
        judged = "its 95% interval's lower bound" if m.get("decided_on") == "interval" else "the estimate"
        return (f"'{name}' accuracy {m['accuracy']:.3f} vs the base model's {m['base_accuracy']:.3f}: {shown}; "
                f"{judged} is below -{m['max_drop']:g} (max_drop)")
    return [line(name, m) for name, m in eval_metrics["sets"].items() if m.get("guard_ok") is False]


def champion_comparison(eval_metrics: dict, evaluate_dir: str, champion_dir: str) -> dict[str, dict]:
    """Per eval set: the champion's accuracy (scored by the champion stage on this run's sets) and the
    paired comparison of the new model with it (`delta` = new - champion, its 95% interval, wins...)."""
    manifest = read_manifest(Path(champion_dir))
    theirs, mine = manifest["metrics"]["sets"], eval_metrics["sets"]
    try:
        paired = compare_sets(read_predictions(evaluate_dir), read_predictions(champion_dir),
                              f"the champion folder {champion_dir}")
    except ValueError as e:
        raise StageError(f"register: {e}; `sftflow run --force champion -c <config>` scores it again") from None
    return {name: {"version": str(manifest["version"]), "train_fingerprint": manifest.get("train_fingerprint", ""),
                   "accuracy": theirs[name]["accuracy"],
                   **(paired.get(name) or {"delta": m["accuracy"] - theirs[name]["accuracy"]})}
            for name, m in mine.items()}


def champion_guards(cfg: SFTConfig, versus: dict[str, dict] | None, primary: str) -> list[str]:
    """One line per eval set other than the primary on which the new model fell more than the set's
    `champion_tolerance` below the champion (`champion_comparison`: same items, paired), naming the set.
    Judged on the estimate, not the interval: each day's skill is a small set (16-24 items), where the
    95% interval of a paired change spans about +-0.2 even for a model that answers as the champion did;
    a lower-bound rule would hold back every version, an upper-bound one would pass one that lost a
    third of a skill. A lost skill is a large change, which the estimate sees."""
    out = []
    for name, vs in (versus or {}).items():
        if name == primary:
            continue  # registry.tolerance and registry.decide_on judge it (decide_alias)
        s = cfg.eval.sets.get(name)
        tol = s.champion_tolerance if s is not None else EvalSetConfig.model_fields["champion_tolerance"].default
        if vs["delta"] >= -tol - 1e-12:
            continue
        against = f"champion v{vs['version']}"
        shown = describe(vs, against) if "delta_low" in vs else f"{vs['delta']:+.3f} vs {against}"
        out.append(f"'{name}' {vs['accuracy'] + vs['delta']:.3f} vs the champion's {vs['accuracy']:.3f}: {shown}; "
                   f"worse by more than {tol:g} (eval.sets.{name}.champion_tolerance)")
    return out


def _unscored(current, vs: dict[str, dict] | None) -> list[str]:
    """Sets the champion's own evaluation scored (its `eval_<set>_accuracy` tags) that this run did not."""
    pattern = re.compile(rf"^{re.escape(TAG)}eval_(.+)_accuracy$")
    theirs = [m.group(1) for k in (current.tags or {}) if (m := pattern.match(k))]
    return sorted(n for n in theirs if n not in (vs or {}))


def decide_alias(client, name: str, policy: str, vs: dict | None, primary: str, train_fp: str,
                 tolerance: float = 0.0, decide_on: str = "estimate",
                 guards: list[str] | None = None, reused: bool = False, lost: list[str] | None = None,
                 compared: dict[str, dict] | None = None) -> tuple[str | None, str]:
    """(alias to set, why). `if_better` compares with the champion item by item on the primary set, both
    scored on this run's eval sets (`vs`: `champion_comparison`'s entry), never with a stored accuracy.
    A new version that ties the champion takes the alias (a retrain on newer data moves forward), unless
    both answer no item of the primary set right and no tolerance was granted (a tie at 0 says nothing
    of either; `registry.tolerance` > 0 accepts versions that much worse, so that one too); a
    version registered before (`reused`: an older config run again) takes it back only when it is
    strictly better, tolerance aside, so re-running or alternating configs moves nothing on a tie. `lost`
    (`champion_guards`): the other sets on which it is worse than the champion beyond their tolerance; any
    keeps the alias where it is. `compared`: every set compared with the champion, so the reason can name
    a set the champion was scored on that this run did not score."""
    if policy == "never":
        return None, "registry.promote=never"
    if guards:
        return CHALLENGER, "held back by the retention guard: " + "; ".join(guards)
    if policy == "always" and reused:
        return None, "registered before; registry.promote=always moves the alias to new versions only"
    if policy == "always":
        return CHAMPION, "registry.promote=always"
    try:
        current = client.get_model_version_by_alias(name, CHAMPION)
    except Exception:  # noqa: BLE001 - no alias (MLflow raises RestException / MlflowException)
        return CHAMPION, "no champion yet"
    if current.tags.get(RUN_TAG) == train_fp:
        return CHAMPION, f"v{current.version} is this training's version and the champion already"
    if (vs is None
            or (str(vs.get("version")), vs.get("train_fingerprint"))
            != (str(current.version), current.tags.get(RUN_TAG))):
        seen = "none" if vs is None else f"v{vs['version']}" + (
            "" if vs.get("train_fingerprint") == current.tags.get(RUN_TAG) else " of another training")
        return CHALLENGER, (f"champion v{current.version} was not compared in this run (the run compared with {seen}; "
                            "the alias moved after it was planned): run the flow again to compare with it")
    alias, why = _decide_primary(vs, primary, current.version, tolerance, decide_on, reused)
    if alias == CHAMPION and lost:
        alias = None if reused else CHALLENGER
        why += "; but it lost ground the champion holds: " + "; ".join(lost)
    missing = _unscored(current, compared) if compared is not None else []
    if missing:  # said, not judged: a set retired on purpose must not hold every later version back
        why += (f"; not compared: {', '.join(repr(n) for n in missing)} (champion v{current.version} was scored on "
                "it, this run's eval.sets lack it)")
    return alias, why


def _decide_primary(vs: dict, primary: str, version, tolerance: float, decide_on: str,
                    reused: bool) -> tuple[str | None, str]:
    """decide_alias's verdict on the primary set alone."""
    on = decide_on if "delta_low" in vs else "estimate"  # a worker's own counts: no per-item records to pair
    shown = describe(vs, f"champion v{version}") if "delta_low" in vs else f"{vs['delta']:+.3f} vs champion v{version}"
    if reused:
        better = (vs["delta_low"] if on == "interval" else vs["delta"]) > 1e-12
        return (CHAMPION, f"'{primary}' {shown}: registered before and better than the champion "
                          f"(registry.decide_on={on})") if better else \
            (None, f"'{primary}' {shown}: registered before and not better than the champion, so the alias stays "
                   f"(a version registered earlier takes it back only when strictly better; registry.decide_on={on})")
    ok = vs["delta"] >= -tolerance - 1e-12 if on == "estimate" else clears(vs, tolerance, decide_on)
    if ok and tolerance <= 0 and vs["accuracy"] + vs["delta"] <= 1e-12:  # a tie at zero says nothing of either
        return CHALLENGER, (f"'{primary}' {shown}: no item right, as the champion: a version that answers nothing "
                            "right does not take the alias on a tie (registry.tolerance > 0 would let it)")
    verdict = "not worse than" if ok else "worse than"
    return (CHAMPION if ok else CHALLENGER), (f"'{primary}' {shown}: {verdict} the champion by more than "
                                               f"{tolerance:g} (registry.decide_on={on})")


def promote(client, name: str, version: str, train_fp: str, policy: str, vs: dict | None, primary: str,
            tolerance: float = 0.0, decide_on: str = "estimate", guards: list[str] | None = None,
            reused: bool = False, champion_fp: str | None = None, lost: list[str] | None = None,
            compared: dict[str, dict] | None = None) -> tuple[str | None, str, list[str]]:
    """Decides `version`'s alias (`decide_alias`) and moves it, holding the registry's promotion lock from the
    read of the champion to the last write, so two registers finishing together promote one after the other:
    the second sees the champion the first set (one it did not compare with: `challenger`), never moves the
    alias over it. Tags the version with the reason (`alias_reason`) and, unless None, `champion_fingerprint`.
    Returns (alias decided, why, the version's aliases after)."""
    with promotion_lock(client, name):
        alias, why = decide_alias(client, name, policy, vs, primary, train_fp, tolerance, decide_on, guards,
                                  reused=reused, lost=lost, compared=compared)
        hand = _champion_set_by_hand(client, name)
        if hand is not None and hand[0] != version:  # the way back, said where the next run reports
            why += f"; champion v{hand[0]} was set by hand ({hand[1].get('at', '')[:10]}): {hand[1].get('reason', '')}"
        client.set_model_version_tag(name, version, TAG + "alias_reason", why)
        if champion_fp is not None:
            client.set_model_version_tag(name, version, TAG + "champion_fingerprint", champion_fp)
        aliases = set(client.get_model_version(name, version).aliases)
        if alias and alias not in aliases and CHAMPION not in aliases:
            client.set_registered_model_alias(name, alias, version)
        return alias, why, sorted(client.get_model_version(name, version).aliases)


def _champion_set_by_hand(client, name: str) -> tuple[str, dict] | None:
    """(version, what `sftflow champion` recorded) when the champion now is one set by hand."""
    try:
        current = client.get_model_version_by_alias(name, CHAMPION)
    except Exception:  # noqa: BLE001 - no champion
        return None
    record = set_by_hand(current.tags)
    return (str(current.version), record) if record else None


def version_description(cfg: SFTConfig, lineage: Lineage) -> str:
    """The version's description in the registry: where its training started, and on what."""
    start = lineage.tags.get("sftflow.start", "base")
    parent = lineage.tags.get("sftflow.parent_version")
    began = (f"continued from {cfg.registry.model_name} v{parent}" if parent else
             "trained from the base model" if start == "base" else f"trained from {start}")
    return (f"Fine-tuned `{cfg.actor.model.model_path}`: {began} (actor.init_from={cfg.actor.init_from}); "
            f"train fingerprint `{lineage.fingerprints.get('train', '')}`.")


SUMMARY_FIRST = ("accuracy", "base_accuracy", "delta", "correct", "total", "base_correct", "base_total",
                 "eval_loss", "base_eval_loss")


def eval_summary(eval_metrics: dict) -> list[dict]:
    """One row per eval set with every number evaluate reported (the `eval/summary.json` table),
    the ones read first in front."""
    sets = eval_metrics["sets"]
    order = {k: i for i, k in enumerate(SUMMARY_FIRST)}
    return [{"set": name, **{k: m[k] for k in sorted((k for k, v in m.items() if is_number(v)),
                                                      key=lambda k: (order.get(k, len(order)), k))}}
            for name, m in sets.items()]


def _prompt_text(prompt) -> str:
    """A one-question prompt as its text, a longer conversation as `role: content` lines, a harness set's
    document (a mapping) as JSON."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict):
        return json.dumps(prompt, ensure_ascii=False)
    if len(prompt) == 1 and prompt[0]["role"] == "user":
        return prompt[0]["content"]
    return "\n".join(f"{m['role']}: {m['content']}" for m in prompt)


def predictions_table(path: Path):
    """The predictions as a table (the `eval/predictions.json` the UI shows), wrong answers first."""
    import pandas as pd
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    table = pd.DataFrame(rows, columns=[c for c in ("correct", "set", "prompt", "reference", "prediction")
                                        if any(c in r for r in rows)])
    if "prompt" in table:
        table["prompt"] = [_prompt_text(p) for p in table["prompt"]]
    return table.sort_values("correct", kind="stable") if "correct" in table else table


def _log_run_files(mlflow, dirs: dict[str, str], eval_metrics: dict) -> None:
    import pandas as pd
    for stage, folder in dirs.items():
        mlflow.log_artifact(str(Path(folder) / "manifest.json"), artifact_path=f"manifests/{stage}")
    predictions = Path(dirs["evaluate"]) / "predictions.jsonl"
    mlflow.log_artifact(str(predictions), artifact_path="eval")
    mlflow.log_table(predictions_table(predictions), artifact_file="eval/predictions.json")
    mlflow.log_table(pd.DataFrame(eval_summary(eval_metrics)), artifact_file="eval/summary.json")
    mlflow.log_artifact(str(Path(dirs["train"]) / "metrics.jsonl"), artifact_path="train")


@contextmanager
def _with_card(model_dir: str, card: str, scratch: Path) -> Iterator[str]:
    """The train stage's model folder with the model card beside its files, for logging: hard links (no
    copy of the weights) in a scratch folder removed afterwards, since train's folder is never written
    after it is complete."""
    folder = scratch / "hf_model"
    shutil.rmtree(folder, ignore_errors=True)
    for f in sorted(Path(model_dir).rglob("*")):
        dest = folder / f.relative_to(model_dir)
        if f.is_dir():
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(f, dest)
        except OSError:  # another file system
            shutil.copy2(f, dest)
    (folder / model_card.CARD).unlink(missing_ok=True)  # a link to the train folder's own file: never written through
    (folder / model_card.CARD).write_text(card, encoding="utf-8")
    try:
        yield str(folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def promote_version(cfg: SFTConfig, client, version: str, fingerprints: dict[str, str], eval_metrics: dict,
                    versus: dict[str, dict] | None, reused: bool) -> tuple[str | None, str, list[str]]:
    """register's decision for `version` of the config's model (`promote`): the primary set, every other set
    compared with the champion (`champion_guards`), and the guards against the base model."""
    r, primary = cfg.registry, eval_metrics["primary_set"]
    return promote(
        client, cfg.registry.model_name, version, fingerprints["train"], r.promote, (versus or {}).get(primary),
        primary, r.tolerance, r.decide_on, failed_guards(eval_metrics), reused=reused,
        # what this decision compared with: once the version is champion, planning finds this register folder by
        # it (a re-registration of the champion itself compared with nothing new: kept)
        champion_fp=fingerprints.get("champion", "") if "champion" in fingerprints or not reused else None,
        lost=champion_guards(cfg, versus, primary), compared=versus)


def run_register(cfg: SFTConfig, fp: str, lineage: Lineage) -> dict:
    from mlflow.tracking import MlflowClient
    from mlflow.utils.logging_utils import suppress_logs

    fingerprints, dirs = lineage.fingerprints, lineage.dirs
    uri = redact_uri(cfg.resolved_tracking_uri)
    try:  # seconds, not the minutes MLflow's client retries for
        reachable(cfg.resolved_tracking_uri)
    except OSError as e:
        raise StageError(f"register: MLflow at {uri} can't be reached ({getattr(e, 'reason', e)}); start it or fix "
                         "registry.tracking_uri, then `sftflow stage register -c <config>` "
                         "registers the model") from None
    build = StageBuild(cfg.artifacts_path, "register", fp)
    mlflow = setup_mlflow(cfg)
    client = MlflowClient()
    name = cfg.registry.model_name
    evaluate_manifest = read_manifest(Path(dirs["evaluate"]))
    eval_metrics = evaluate_manifest["metrics"]
    eval_set = evaluate_manifest["eval_set_fingerprint"]
    lora_dir = Path(dirs["train"]) / "adapter"
    adapter = bases.is_adapter(lora_dir)  # a LoRA version: its adapter and a reference to its base
    model_dir = str(lora_dir if adapter else Path(dirs["train"]) / "model")

    versus = champion_comparison(eval_metrics, dirs["evaluate"], dirs["champion"]) if "champion" in dirs else None
    existing = _existing_version(client, name, fingerprints["train"])
    if existing is not None:
        version, run_id = existing, existing.run_id
    else:
        # the run training opened (or a new one when training ran without MLflow)
        tags = {f"{TAG}{s}_fingerprint": f for s, f in fingerprints.items()}
        flow_run = lineage.tags.get(FLOW_RUN_ID)
        run_id, _ = find_or_create_run(cfg, lineage, tags)
        if flow_run and client.get_run(run_id).data.tags.get(FLOW_RUN_ID) != flow_run:
            client.set_tag(run_id, "prefect.register_flow_run_id", flow_run)
            if lineage.tags.get(FLOW_RUN_URL):
                client.set_tag(run_id, "prefect.register_flow_run_url", lineage.tags[FLOW_RUN_URL])
        sync_rows(client, run_id, read_metrics_file(Path(dirs["train"]) / "metrics.jsonl"))  # what live logging missed
        send_values(client, run_id, {**eval_metric_values(eval_metrics), **champion_metric_values(versus or {})})
        learned = model_card.trained_on(cfg, read_manifest(Path(dirs["train"]))["prepare_dir"], lineage.inputs)
        card = model_card.render(name, cfg.actor.model.model_path, eval_metrics,
                                 version_description(cfg, lineage).split(": ", 1)[-1], learned, cfg.actor.lora.r > 0,
                                 run_url(ui_url(cfg), client.get_run(run_id).info.experiment_id, run_id),
                                 quantized=quantize_record(cfg))
        # the base a LoRA version names, and the nodes under it, logged to the store once (bases.py)
        sqlite = cfg.resolved_tracking_uri.startswith("sqlite:///")
        chain = bases.publish(client, bases.read_ref(lora_dir)["base"], (cfg.artifacts_path,),
                              (cfg.artifacts_path / "mlartifacts" / bases.BASES).as_uri() if sqlite else None
                              ) if adapter else []
        with mlflow.start_run(run_id=run_id), _with_card(model_dir, card, build.partial) as hf_model:
            _log_run_files(mlflow, dirs, eval_metrics)
            here = Path(__file__).resolve().parent
            # a QLoRA version's base is rebuilt through the NF4 round trip (nf4.py), which needs torchao
            pip = PIP_REQUIREMENTS + (["torchao==0.18.0"] if (quantize_record(cfg) or {}).get("kind") == "nf4" else [])
            with suppress_logs("mlflow.types.type_hints", UNION_HINT_WARNING):  # chat_model.py says why
                info = mlflow.pyfunc.log_model(
                    name=name, python_model=str(here / "chat_model.py"), artifacts={"hf_model": hf_model},
                    code_paths=CODE_PATHS, pip_requirements=pip,
                    input_example=INPUT_EXAMPLE, registered_model_name=name)
        version = client.get_model_version(name, str(info.registered_model_version))
        client.set_tag(run_id, NOTE_TAG, run_note(cfg, client.get_run(run_id).data.tags, (name, version.version)))
        vtags = {"train_fingerprint": fingerprints["train"], "prepare_fingerprint": fingerprints["prepare"],
                 "evaluate_fingerprint": fingerprints.get("evaluate", ""), "config_hash": config_hash(cfg),
                 "data_digest": data_digest(lineage.inputs), "eval_accuracy": str(eval_metrics["accuracy"]),
                 "eval_set_fingerprint": eval_set, "start": lineage.start,
                 "parent_version": lineage.tags.get("sftflow.parent_version", ""),
                 "models_fingerprint": lineage.tags.get("sftflow.models_fingerprint", ""),
                 "trained_on": json.dumps(learned, separators=(",", ":")),
                 "base_chain": ",".join(chain),
                 "rehearsed": json.dumps([{**e, "ref": project_ref(e["ref"])} for e in cfg.rehearsal_files],
                                         separators=(",", ":")) if cfg.rehearsal_files else ""}
        vtags.update({f"eval_{n}_accuracy": str(m["accuracy"]) for n, m in named_sets(eval_metrics).items()})
        for k, v in vtags.items():
            client.set_model_version_tag(name, version.version, TAG + k, v)
        client.update_model_version(name, version.version, description=version_description(cfg, lineage))

    alias, why, aliases = promote_version(cfg, client, str(version.version), fingerprints, eval_metrics, versus,
                                          reused=existing is not None)
    metrics = {"version": int(version.version), "accuracy": eval_metrics["accuracy"], "aliases": aliases,
               "reused_version": existing is not None, "alias_decision": alias, "alias_reason": why,
               **({"vs_champion": versus} if versus else {})}
    ui = ui_url(cfg)
    (build.partial / "registration.json").write_text(json.dumps(
        {"tracking_uri": uri, "run_id": run_id, "model_name": name,
         "version": version.version, "model_uri": f"models:/{name}/{version.version}", "aliases": aliases,
         "run_url": run_url(ui, client.get_run(run_id).info.experiment_id, run_id),
         "version_url": version_url(ui, name, version.version)}, indent=2))
    build.commit({"metrics": metrics, "run_id": run_id, "model_name": name, "version": int(version.version),
                  "tracking_uri": uri})
    return metrics
