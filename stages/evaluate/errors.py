from stages.core.errors import StageError


class EvaluationError(StageError):
    """The model or worker cannot be evaluated as configured (raised in a worker or in the caller)."""
