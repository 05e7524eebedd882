"""torchrun entry point: `python -m stages.replay <spec.json>` runs one rank of the replay stage."""

import sys

from stages.replay.runner import main
from stages.runtime.distributed import rank_entry

with rank_entry():
    main(sys.argv[1])
