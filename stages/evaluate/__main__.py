"""torchrun entry point: `python -m stages.evaluate <spec.json>` runs one rank of the evaluation."""

from stages.evaluate.runner import main
from stages.runtime.distributed import run_rank

run_rank(main)
