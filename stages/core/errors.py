"""Errors a user acts on: each message says what went wrong and what to do.

The CLI maps them to exit codes: `ConfigError` (`DataError`, `MissingUpstream`) 2, `StageError` 1.
A ConfigError is never retried and never shown with a traceback: fixing the input is the only fix.
"""

__fingerprint__ = False  # messages only: never changes what a stage writes


class ConfigError(ValueError):
    """A config problem, phrased as one line that names the key and the fix (exit code 2)."""


class DataError(ConfigError):
    """The input data can't be used as given: an unreadable or ambiguous file, or a bad row under
    `data.strict`. One line naming the file (and line); exit code 2, like a config error."""


class MissingUpstream(ConfigError):
    """A stage was asked for before the stages it reads from: a usage error (exit code 2)."""


class StageError(RuntimeError):
    """A stage could not produce its output (exit code 1)."""
