"""The worker's earlier home: `actor.worker` classes written against `stages.train.worker` keep
working. New code imports `stages.runtime.worker`."""

from stages.runtime.worker import SFTWorker, WorkerSpec  # noqa: F401
