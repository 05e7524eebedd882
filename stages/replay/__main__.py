"""torchrun entry point: `python -m stages.replay <spec.json>` runs one rank of the replay stage."""

from stages.replay.runner import main
from stages.runtime.distributed import exit_skipping_finalization

main()
exit_skipping_finalization()  # only reached when the rank finished its work
