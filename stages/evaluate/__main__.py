"""torchrun entry point: `python -m stages.evaluate <spec.json>` runs one rank of the evaluation."""

from stages.runtime.distributed import exit_skipping_finalization
from stages.evaluate.runner import main

main()
exit_skipping_finalization()  # only reached when the rank finished its work
