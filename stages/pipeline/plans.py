"""What a plan is: `Plan`, a validated config with everything resolved from it (the inputs and their
digests, what `eval.model` is, every stage's fingerprint, the champion, the start), and what it says
about its stages (`upstream`, `requires`, their folders); `planned_device`, the device training will
run on as planning sees it. `fingerprints.plan` makes one."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..core.cache.artifacts import damage, is_complete, stage_dir
from ..core.cache.inputs import HUB_PREFIX
from ..core.config import SFTConfig
from ..graph import BY_NAME, STAGES
from ..models.base import model_config_json
from ..models.start import start_tag
from ..planning import memory_plan
from ..tracking.run import Lineage


REFERENCES = ("baseline", "champion")  # models the trained one is compared with, item by item


@dataclass
class Plan:
    """A validated config with everything resolved from it: the inputs its paths name (with content
    digests), what `eval.model` is, and every stage's fingerprint (`models` is the base model's)."""

    cfg: SFTConfig
    fingerprints: dict[str, str]
    inputs: dict[str, list[tuple[str, str]]]  # split -> [(input, content sha256)]
    eval_model: dict | None = None
    champion: dict | None = None  # the registry version `champion` named at planning (registry.current_champion)
    start: dict | None = None     # the weights training starts from (models/start.py); None: the base model
    start_note: str | None = None  # why `actor.init_from` resolved to the base model, when it did
    facts: dict | None = None      # the facts the fingerprints saw (stages/graph.py FACTS)
    rehearsal: list[dict] | None = None  # a warm start's rehearsed files (models/start.py `rehearsal`), else None

    @property
    def stages(self) -> tuple[str, ...]:
        """The stages this plan runs, in order (a reference stage only when it has a model to score)."""
        return tuple(s for s in STAGES if s in self.fingerprints)

    def folder(self, stage: str) -> Path:
        return stage_dir(self.cfg.artifacts_path, stage, self.fingerprints[stage])

    def status(self, stage: str) -> str:
        """complete | damaged (complete, but fails the check a reuse makes: the flow rebuilds it, so
        nothing before the flow reads it) | missing."""
        folder = self.folder(stage)
        if not is_complete(folder):
            return "missing"
        return "complete" if damage(folder) is None else "damaged"

    def lineage(self, dirs: dict[str, str], tags: dict[str, str] | None = None) -> Lineage:
        started = {"sftflow.start": self.start["ref"] if self.start else "base",
                   "sftflow.models_fingerprint": self.fingerprints["models"],
                   **({"sftflow.parent_version": self.start["parent_version"]}
                      if self.start and self.start.get("parent_version") else {})}
        return Lineage(fingerprints={s: self.fingerprints[s] for s in self.stages}, dirs=dirs, inputs=self.inputs,
                       tags={**started, **(tags or {})}, start=start_tag(self.start))

    def to_dict(self) -> dict:
        return {"config": self.cfg.model_dump(mode="json"), "fingerprints": self.fingerprints,
                "inputs": {s: [list(x) for x in v] for s, v in self.inputs.items()}, "eval_model": self.eval_model,
                "champion": self.champion, "start": self.start, "start_note": self.start_note, "facts": self.facts,
                "rehearsal": self.rehearsal}

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        """The plan `to_dict` wrote; nothing is globbed, hashed or looked up again."""
        cfg = SFTConfig.model_validate(d["config"])
        inputs = {s: [(ref, digest) for ref, digest in v] for s, v in d["inputs"].items()}
        cfg.pin_inputs({s: [ref if ref.startswith(HUB_PREFIX) else Path(ref) for ref, _ in v]
                        for s, v in inputs.items()})
        if d.get("rehearsal"):
            cfg.pin_rehearsal(d["rehearsal"], cfg.inputs()["train"])
        return cls(cfg, dict(d["fingerprints"]), inputs, d.get("eval_model"), d.get("champion"), d.get("start"),
                   d.get("start_note"), d.get("facts"), d.get("rehearsal"))


def upstream(p: Plan, stage: str) -> tuple[str, ...]:
    """Stages `stage` reads in this plan (the stage table's `upstream` without its `skips`)."""
    row = BY_NAME[stage]
    skip = row.skips(p.cfg)
    return tuple(u for u in row.upstream if u in p.fingerprints and u not in skip)


def requires(p: Plan, stage: str) -> set[str]:
    """Every stage `stage` needs in this plan, directly or through another."""
    found: set[str] = set()
    todo = list(upstream(p, stage))
    while todo:
        s = todo.pop()
        if s not in found:
            found.add(s)
            todo += upstream(p, s)
    return found


def held_out_dir(dirs: dict[str, str]) -> str:
    """Where the scoring stages find their sets: prepare_eval's folder (named eval sets), else prepare's
    (the val split)."""
    return dirs.get("prepare_eval") or dirs.get("prepare") or ""  # "": harness sets only, nothing prepared


def planned_device(cfg: SFTConfig, model_fp: str) -> memory_plan.Device:
    """The device training will run on as planning sees it, with what a CPU's bf16 is measured at: the
    base model's shapes (its config.json; a default class where it can't be read before the model is
    built)."""
    from ..core.machine.bf16_speed import Dims
    found = model_config_json(cfg, model_fp)
    try:
        dims = Dims.from_hf_config(found[0]) if found is not None else None
    except (KeyError, TypeError, ValueError):
        dims = None
    return memory_plan.visible_device(dims)
