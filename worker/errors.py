"""Typed errors of the worker core; the servicer maps them to gRPC status codes in one table."""


class WorkerError(Exception):
    """Base class of every error the worker core raises on bad input or configuration."""


class BatchError(WorkerError, ValueError):
    """A forward batch is malformed: empty input, a block table that does not cover the
    sequence, a block id outside the pool, two sequences writing one slot (INVALID_ARGUMENT)."""


class PoolConfigError(WorkerError, ValueError):
    """The pool cannot be built as asked: no room for one block, a bad block size."""


class UnsupportedModelError(WorkerError):
    """The model keeps state a paged KV cache cannot hold (recurrent or SSM layers)."""


class ModelLoadError(WorkerError):
    """A model name or path could not be resolved or loaded."""
