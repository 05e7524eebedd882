"""torchrun entry point: `python -m stages.replay <spec.json>` runs one rank of the replay stage."""

from stages.replay.runner import main
from stages.runtime.distributed import run_rank

run_rank(main)
