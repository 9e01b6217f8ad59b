"""Typed errors of the worker core; the servicer maps them to gRPC status codes in one table
(``worker.servicer.STATUS_OF``)."""


class WorkerError(Exception):
    """Base class of every error the worker core raises on bad input or configuration."""


# -- how a request ends when it does not finish (each has one status code) ----------------------


class InvalidRequest(WorkerError, ValueError):
    """A request the worker refuses: INVALID_ARGUMENT, before it holds any block."""


class Cancelled(WorkerError):
    """The client cancelled the call or went away (CANCELLED; nobody reads the answer)."""


class NotAdmitted(WorkerError):
    """A request that waited ``--admission-timeout-s`` for blocks the pool never had free
    (held by running requests, pins or a namespace quota): RESOURCE_EXHAUSTED, so the gateway
    tries another worker or answers 429 with Retry-After. Nothing waits forever."""


class CacheOutage(WorkerError):
    """The cache service has been unreachable for ``--cache-outage-timeout-s``: no lease can be
    had or grown, so a request that waits for one, or arrives meanwhile, ends (ABORTED; the
    gateway answers 503 with Retry-After). Running requests go on while their blocks last."""


class Overloaded(WorkerError):
    """The worker already holds ``--max-pending-requests`` requests (running + waiting):
    RESOURCE_EXHAUSTED, before the request holds anything. The gateway tries another worker.
    A worker's request is one sequence: the gateway sends each of a client request's ``n``
    choices as a request of its own, so they count ``n``."""


class ShuttingDown(WorkerError):
    """The worker is stopping: try another worker (UNAVAILABLE)."""


class ConstraintFailed(WorkerError):
    """A request's structured output failed while it generated: the grammar engine gave up on
    it (its lexer's limits) or no token continues it. The constraint's fault, not the
    worker's: INVALID_ARGUMENT, as a constraint refused before generating is; the request
    ends, the batch goes on. A constraint that admits no text at all is refused at compile
    time instead (``worker.model.grammar.Grammars``)."""


class StepFailed(WorkerError):
    """A model step raised: a bug, not the request's fault. Its requests end with INTERNAL and
    the worker keeps serving; nothing the step wrote is published to the cache."""


class CacheRejected(WorkerError):
    """The cache service refused the request's lease as malformed (INVALID_ARGUMENT there): the
    worker validated it first, so this is a worker bug (INTERNAL)."""


# -- errors of the model path and of startup -----------------------------------------------------


class BatchError(WorkerError, ValueError):
    """A forward batch is malformed: empty input, a block table that does not cover the
    sequence, a block id outside the pool, two sequences writing one slot. The engine builds
    every batch itself, so inside a step this is a bug: the step fails (StepFailed)."""


class PoolConfigError(WorkerError, ValueError):
    """The pool cannot be built as asked: no room for one block, a bad block size."""


class UnsupportedModelError(WorkerError):
    """The model keeps state a paged KV cache cannot hold (recurrent or SSM layers)."""


class RecurrentStateError(UnsupportedModelError):
    """The model's layers keep recurrent or SSM state (``ArraysCache``, alone or inside a
    ``CacheList``) besides plain K/V: not pageable, but servable by the dense per-sequence
    runner (``worker.model.dense_runner``)."""
