"""`python -m stages.export SRC --out DIR --type f16 [--name NAME]`: a trained model as GGUF + Modelfile.

Prints the written paths, one a line; a refusal is one line on stderr, exit code 2, nothing written."""

import sys

from stages.export.gguf import main

sys.exit(main())
