"""Errors a user acts on: each message says what went wrong and what to do.

The CLI maps them to exit codes: `ConfigError` (and `MissingUpstream`) 2, `StageError` 1.
"""

__fingerprint__ = False  # messages only: never changes what a stage writes


class ConfigError(ValueError):
    """A config problem, phrased as one line that names the key and the fix (exit code 2)."""


class MissingUpstream(ConfigError):
    """A stage was asked for before the stages it reads from: a usage error (exit code 2)."""


class StageError(RuntimeError):
    """A stage could not produce its output (exit code 1)."""
