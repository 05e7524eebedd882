"""Errors a user acts on: each message says what went wrong and what to do."""


class StageError(RuntimeError):
    """A stage could not produce its output (exit code 1)."""
