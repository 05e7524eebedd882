"""torchrun entry point: `python -m stages.evaluate <spec.json>` runs one rank of the evaluation."""

import sys

from stages.evaluate.runner import main
from stages.runtime.distributed import rank_entry

with rank_entry():
    main(sys.argv[1])
