"""The stage table: every stage declared once.

A row says what a stage's result depends on and when it runs: the code it carries, the config keys
it reads (and the keys within them that can't change its result), the input files it reads (by
content), the stages whose folders it reads, which of those it depends on by fingerprint, the facts
it depends on (the base model, the worker's source, ...), when it is in a plan, the stage's own
function that runs it (`run`) and the function of stages/pipeline/calls.py that readies its arguments
from a plan (`call`). Planning and running (`stages/pipeline/`), `upstream()`,
`sftflow show`, the Prefect task graph (`flows/sft.py`) and the stage table of docs/architecture.md
(`render_markdown`) are all read from here;
tests/test_stage_graph.py checks the fingerprints against the table over the config schema.

    fingerprint(stage) = hash(stage, code version, {config key: its slice}, {input: content digests},
                              {upstream stage: its fingerprint}, {fact: its value})

Pure data and small functions of a config: importing this module imports nothing heavy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from .core.config import REHEARSE, REPLAY_PROMPTS, SFTConfig, eval_split, hashed, mix_split


@dataclass(frozen=True)
class Stage:
    name: str
    makes: str                                  # one line: what its folder holds
    code: str                                   # the package whose code version it carries
    reads: tuple[str, ...]                      # config keys (dotted), each with everything under it
    ignores: tuple[str, ...] = ()               # keys under `reads` that can't change its result ('*': any name)
    inputs: Callable[[SFTConfig], dict[str, tuple[str, ...]]] = lambda cfg: {}  # name -> input splits (contents)
    input_files: str = ""                       # docs: what `inputs` names
    upstream: tuple[str, ...] = ()              # stages whose folders it may read, earliest first
    folds: tuple[str, ...] = ()                 # of those, the ones its fingerprint includes (when in the plan)
    facts: tuple[str, ...] = ()                 # facts it depends on (FACTS)
    when: Callable[[SFTConfig, dict], bool] = lambda cfg, facts: True  # in the plan
    skips: Callable[[SFTConfig], set[str]] = lambda cfg: set()         # upstream stages this config doesn't read
    metric: tuple[str, str] = ("", "")          # (metrics key, label) summarizing a run of it
    neutral_code: bool = False                  # its code version includes the reporting-only modules
    why: str = ""                               # docs: the reason for what it leaves out
    # the stage's own function, `module:function`, imported only when the stage runs (by name: no stage code
    # here), and the function of stages/pipeline/calls.py that readies its call from a plan
    run: str = ""
    call: str = ""


def _named_prepared(cfg: SFTConfig) -> list[str]:
    return [n for n, s in cfg.eval.sets.items() if not s.is_harness]


def _held_out(cfg: SFTConfig) -> dict[str, tuple[str, ...]]:
    """Each scored set's files: a named set's own (a harness task's files are its set's input), or the
    val split's (without val files: the train files it is split from by `data.val_fraction`)."""
    if not cfg.eval.sets:
        return {"val": ("val",)} if cfg.data.val_data_paths else {"val (from train)": ("train",)}
    return {name: (eval_split(name),) for name in cfg.eval.set_names}


def _training_files(cfg: SFTConfig) -> dict[str, tuple[str, ...]]:
    out = {"train": ("train",), "val": ("val",)}
    out.update({f"mix.{n}": (mix_split(n),) for n, m in cfg.data.mix.items() if m.paths})
    if cfg.rehearsal_files:  # a warm start's: what its version trained on (models/start.py)
        out[f"mix.{REHEARSE}"] = (mix_split(REHEARSE),)
    return out


def _scoring_skips(cfg: SFTConfig) -> set[str]:
    # named sets come from prepare_eval; the val split from prepare
    return {"prepare"} if cfg.eval.sets else set()


# register alone judges with a set's champion_tolerance: changing it re-decides the alias, never re-scores
_JUDGED_BY_REGISTER = "eval.sets.*.champion_tolerance"
_SCORING_IGNORES = ("data.mix", "data.rehearsal", "eval.model", "eval.eval_base", "eval.primary",
                    "eval.sets.*.max_drop", "eval.sets.*.decide_on", _JUDGED_BY_REGISTER)
_HELD_OUT_FILES = "each scored set's files"

TABLE: tuple[Stage, ...] = (
    Stage("replay", "the base model's answers to replay.prompt_paths (a source of the training mixture)",
          code="replay", reads=("replay", "data.columns", "actor.model.trust_remote_code", "actor.precision"),
          inputs=lambda cfg: {"prompts": (REPLAY_PROMPTS,)}, input_files="replay.prompt_paths",
          facts=("model", "actor_precision"), when=lambda cfg, f: cfg.replay is not None,
          metric=("kept", "answers kept"), why="never the training data",
          run="stages.replay:run_replay", call="replay_call"),
    Stage("prepare", "Arrow shards of the training sources and the val split",
          code="prepare", reads=("data", "actor.model.trust_remote_code"),
          ignores=("data.mix.*.weight", "data.rehearsal"),
          inputs=_training_files, input_files="train, val and mixture files (a warm start's rehearsed files too)",
          upstream=("replay",), folds=("replay",), facts=("model",), metric=("train_rows_kept", "rows"),
          why="the mixture's weights only change what train samples; never the eval sets",
          run="stages.prepare.stage:run_prepare", call="prepare_call"),
    Stage("prepare_eval", "Arrow shards of the named eval sets",
          code="prepare", reads=("data", "eval.sets.*.mode", "actor.model.trust_remote_code"),
          ignores=("data.mix", "data.rehearsal"),
          inputs=lambda cfg: {name: (eval_split(name),) for name in _named_prepared(cfg)},
          input_files="each prepared named set's files", facts=("model",),
          when=lambda cfg, f: bool(_named_prepared(cfg)), metric=("rows_kept", "rows"),
          why="the mixture only trains; a harness set has nothing to prepare",
          run="stages.prepare.stage:run_prepare", call="prepare_call"),
    Stage("baseline", "the base model's scores on the eval sets",
          code="evaluate", reads=("data", "eval", "actor.model"), ignores=_SCORING_IGNORES, inputs=_held_out,
          input_files=_HELD_OUT_FILES,
          upstream=("prepare_eval", "prepare"), facts=("model", "prepare_code", "worker", "scorer", "harness",
                                                       "eval_precision"),
          skips=_scoring_skips,
          when=lambda cfg, f: cfg.eval.eval_base and cfg.eval.model != "base", metric=("accuracy", "accuracy"),
          why="never the training data (folds no fingerprint: it names the held-out files and what "
              "prepares them), so trials, sweeps and retrains reuse it; guards and the model choice only judge",
          run="stages.evaluate:run_reference", call="reference_call"),
    Stage("champion", "the registry's champion's scores on the eval sets",
          code="evaluate", reads=("data", "eval", "actor.model"), ignores=_SCORING_IGNORES, inputs=_held_out,
          input_files=_HELD_OUT_FILES,
          upstream=("prepare_eval", "prepare"), facts=("champion", "model", "prepare_code", "worker", "scorer",
                                                       "harness", "eval_precision"),
          skips=_scoring_skips, when=lambda cfg, f: f["champion"] is not None, metric=("accuracy", "accuracy"),
          why="as baseline; only with `registry.promote: if_better`, no `eval.model`, and a champion that "
              "another training produced", run="stages.evaluate:run_reference", call="reference_call"),
    Stage("train", "the trained model (HF folder), DCP checkpoints, metrics.jsonl",
          code="train", reads=("actor", "runner", "data.mix.*.weight"), upstream=("prepare",),
          folds=("prepare",), facts=("model", "worker", "start"), metric=("final_loss", "loss"),
          why="never the eval sets", run="stages.train:run_train", call="train_call"),
    Stage("evaluate", "the scored model's predictions and metrics, compared with the baseline",
          code="evaluate", reads=("eval", "actor.model"), ignores=(_JUDGED_BY_REGISTER,),
          inputs=lambda cfg: {n: (eval_split(n),) for n, s in cfg.eval.sets.items() if s.is_harness},
          input_files="each harness set's task files",
          upstream=("baseline", "train", "prepare_eval", "prepare"),
          folds=("baseline", "train", "prepare_eval", "prepare"),
          facts=("model", "eval_model", "worker", "scorer", "harness", "eval_precision"),
          skips=lambda cfg: _scoring_skips(cfg) | ({"train"} if cfg.eval.model is not None else set()),
          metric=("accuracy", "accuracy"),
          why="with `eval.model` it reads no training, so a new training leaves it a cache hit",
          run="stages.evaluate:run_evaluate", call="evaluate_call"),
    Stage("register", "the MLflow run, the model version and its aliases",
          code="register", neutral_code=True, reads=("registry", _JUDGED_BY_REGISTER),
          upstream=("champion", "evaluate", "train", "prepare"), folds=("evaluate", "train", "prepare"),
          facts=("tracking_uri", "compared_with"), metric=("version", "version"),
          why="the champion by the decision it compared with (`compared_with`); a set's champion_tolerance judges "
              "only here, so changing it re-decides the alias without re-scoring",
          run="stages.register:run_register", call="register_call"),
)

BY_NAME: dict[str, Stage] = {s.name: s for s in TABLE}
STAGES: tuple[str, ...] = tuple(s.name for s in TABLE)
UPSTREAM: dict[str, tuple[str, ...]] = {s.name: s.upstream for s in TABLE}
KEY_METRIC: dict[str, tuple[str, str]] = {s.name: s.metric for s in TABLE}

# What each fact is and which config keys decide it (the property test's closure; docs)
FACTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "model": ("the base model's fingerprint (a builtin's spec and corpus, a GGUF's digest, a folder's files)",
              ("actor.model.model_path", "data.format", "data.columns")),
    "prepare_code": ("prepare's code version (it made the held-out rows)", ()),
    "worker": ("the source of `actor.worker` and of an import-path `actor.model.model_type`",
               ("actor.worker", "actor.model.model_type")),
    "scorer": ("the source of each custom scorer", ("eval.scorer", "eval.sets.*.scorer")),
    "harness": ("each harness set's lm-eval task, metric, filter and lm-eval version", ()),
    "start": ("the identity of the weights training starts from (`actor.init_from`), with `data.rehearsal` when it "
              "rehearses what that version trained on", ("actor.init_from", "data.rehearsal")),
    "eval_model": ("what `eval.model` is (digests, registry version, hub id)", ("eval.model",)),
    "actor_precision": ("`actor.precision` resolved on the planning machine (`auto`: core/machine/precision.py)",
                        ("actor.precision",)),
    "eval_precision": ("`eval.precision` resolved on the planning machine (`auto`: core/machine/precision.py)",
                       ("eval.precision",)),
    "champion": ("the registry's champion when planned (its training's fingerprint)",
                 ("registry.model_name", "registry.promote", "registry.tracking_uri", "artifacts_dir", "eval.model")),
    "tracking_uri": ("the MLflow store (default: a SQLite file in the artifacts folder)",
                     ("registry.tracking_uri", "artifacts_dir")),
    "compared_with": ("the champion stage register's decision compared with",
                      ("registry.model_name", "registry.promote", "registry.tracking_uri", "artifacts_dir",
                       "eval.model")),
}


# The facts known only once other stages have fingerprints: the champion is told from this very
# training by train's, and register's decision names the champion stage it compared with.
FACT_AFTER: dict[str, tuple[str, ...]] = {"champion": ("train",), "compared_with": ("train", "champion")}


def planning_order() -> list[str]:
    """Stages in an order where each comes after what its fingerprint needs: its folded upstream and
    the stages its facts are known after (`FACT_AFTER`)."""
    needs = {s.name: set(s.folds) | {u for f in s.facts for u in FACT_AFTER.get(f, ())} for s in TABLE}
    done: list[str] = []
    while len(done) < len(TABLE):
        done.append(next(s for s in STAGES if s not in done and needs[s] <= set(done)))
    return done


# --------------------------------------------------------------------------- config slices


def _drop(tree: Any, path: list[str]) -> None:
    if not isinstance(tree, dict) or not path:
        return
    head, rest = path[0], path[1:]
    for key in (list(tree) if head == "*" else [head]):
        if key not in tree:
            continue
        if rest:
            _drop(tree[key], rest)
        else:
            del tree[key]


def _pick(tree: Any, path: list[str]) -> Any:
    if not path:
        return tree
    head, rest = path[0], path[1:]
    if not isinstance(tree, dict):
        return None
    if head == "*":
        return {k: _pick(v, rest) for k, v in tree.items()}
    return _pick(tree.get(head), rest)


def config_slice(cfg: SFTConfig, stage: Stage) -> dict[str, Any]:
    """{read key: the config under it as fingerprints see it (`hashed`), without the stage's ignores}."""
    tree = hashed(cfg)
    out = {}
    for key in stage.reads:
        value = _pick(tree, key.split("."))
        if isinstance(value, dict):
            value = _copy(value)
            for ign in stage.ignores:
                if ign.startswith(key + "."):
                    _drop(value, ign[len(key) + 1:].split("."))
                elif ign == key:
                    value = None
        out[key] = value
    return out


def _copy(tree: Any) -> Any:
    return {k: _copy(v) for k, v in tree.items()} if isinstance(tree, dict) else tree


# --------------------------------------------------------------------------- rendering


def render_markdown() -> str:
    """The stage table of docs/architecture.md (tests/test_stage_graph.py keeps the doc equal to it)."""
    rows = ["| stage | makes | code | reads (config) | leaves out | input files | after | fingerprint folds | "
            "facts | why |", "|---|---|---|---|---|---|---|---|---|---|"]
    for s in TABLE:
        rows.append("| " + " | ".join([
            f"`{s.name}`", s.makes, f"`{s.code}`" + (" (with reporting)" if s.neutral_code else ""),
            ", ".join(f"`{k}`" for k in s.reads), ", ".join(f"`{k}`" for k in s.ignores) or "—",
            s.input_files or "—", ", ".join(s.upstream) or "—", ", ".join(s.folds) or "—",
            ", ".join(s.facts) or "—", s.why or ""]) + " |")
    facts = ["", "| fact | what | decided by |", "|---|---|---|"]
    facts += [f"| `{name}` | {what} | {', '.join(f'`{k}`' for k in keys) or '—'} |"
              for name, (what, keys) in FACTS.items()]
    return "\n".join(rows + facts) + "\n"
