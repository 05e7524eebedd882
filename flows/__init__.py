"""The Prefect flows and the CLI over the stages (docs/architecture.md)."""

import os

from stages.core.threads import wait_policy

wait_policy(os.environ)  # before anything loads torch (and OpenMP with it)
