"""Planning and running the stage graph: what each stage reads, its fingerprint, and how to run it.

Orchestrators (the Prefect flow, the CLI, tests) validate a config once (`load_config`),
plan once (`plan`), and hand the `Plan` to `run_stage` for each stage; a plan travels as
JSON (`Plan.to_dict`) to Prefect tasks and is never re-resolved there.

    models ─┐  ┌─► baseline ──────────┐       (the base model's scores: one folder across trials and retrains)
    prepare ─┼─► train ──────────────► evaluate ─► register
             └─► champion ─────────────────────────┘  (the registry's champion, scored on today's eval sets)

Evaluate compares the trained model with the base model; register compares it with the champion
(the champion is a fact about the registry when the run is planned, so when it moves only register
re-runs, never an evaluation).

`baseline` and `champion` are in a plan only when there is something to score: the base model
unless `eval.eval_base` is off or `eval.model` is the base model; the champion when `eval.model` is
unset, `registry.promote` is `if_better` and the registry has one that another training produced.

Its modules, along the seams of the road (each imports at most half of stages/' packages; this one
re-exports the names flows/, sweep and the tests use):

    plans.py         the Plan type, what it says about its stages, the device it plans for
    checks.py        the pre-flight checks: at planning, and on the machine that trains before torchrun
    fingerprints.py  plan(): inputs, digests, facts and every stage's fingerprint, as the stage table declares
    show.py          `sftflow show`'s launch report: every decision the machine makes for training
    calls.py         run_stage: the stage's function the table names, called with what its `call` readies
    warm.py          the rank started ahead and the imports warmed while a server starts

Imported by flows/ and stages/sweep.py; never by a stage.
"""

from ..core.errors import ConfigError, MissingUpstream, StageError
from ..graph import KEY_METRIC, STAGES, UPSTREAM
from .warm import launch_ahead, warm_imports
from .calls import CALLS, GATED, replay_file, require_upstream, run_stage, stage_function
from .checks import (check_attention, check_checkpoints, check_code, check_contamination, check_launch, check_memory,
                     check_processes, train_memory)
from .fingerprints import harness_tasks, plan, reference_set_keys
from .plans import REFERENCES, Plan, held_out_dir, planned_device, requires, upstream
from .show import launch_report

__all__ = ["STAGES", "REFERENCES", "UPSTREAM", "KEY_METRIC", "Plan", "plan", "run_stage", "upstream", "requires",
           "require_upstream", "ConfigError", "MissingUpstream", "StageError",
           "launch_ahead", "warm_imports", "CALLS", "GATED", "replay_file", "stage_function",
           "check_attention", "check_checkpoints", "check_code", "check_contamination", "check_launch", "check_memory",
           "check_processes", "train_memory", "harness_tasks", "reference_set_keys", "held_out_dir", "planned_device",
           "launch_report"]
