"""Domain errors. The servicer maps each class to one gRPC status code (convert.STATUS_OF)."""


class CacheError(Exception):
    """Base class of everything the domain raises on purpose."""


class InvalidArgument(CacheError):
    """The request itself is malformed: empty or negative tokens, bad sizes."""


class NotFound(CacheError):
    """An admin target (a pool, a prefix to pin, unpin or evict) is not there."""


class UnknownPool(NotFound):
    """An admin call names a pool that is not registered."""


class UnknownLease(CacheError):
    """The lease does not exist: never granted, released, or expired."""


class MustRegister(CacheError):
    """A pool's call cannot be served until the pool registers (again): every lease it held
    is void. The one answer a worker acts on by re-registering (FAILED_PRECONDITION), whichever
    of the two reasons below it is."""


class UnregisteredPool(MustRegister):
    """A worker's call names a pool this service does not know: it restarted and forgot it."""


class FencedIncarnation(MustRegister):
    """The caller names an incarnation older than the pool's current one."""


class PoolInUse(MustRegister):
    """RegisterPool names a live pool (heartbeating within its TTL) without its current
    incarnation: another registrant must not wipe its index. Retry once the pool's TTL lapses."""


class RegistrationLimit(CacheError):
    """RegisterPool asks for more blocks per pool, or more pools, than this service allows."""


class OutOfBlocks(CacheError):
    """Not enough free or evictable blocks, even after eviction. Queue and retry."""


class NeverFits(CacheError):
    """A lease larger than the pool could give it even with every other lease ended and every
    evictable block evicted: pinned blocks (and a namespace quota) hold the rest. Waiting
    cannot help, so the caller refuses the request instead of queueing it (OUT_OF_RANGE)."""


class FellBehind(CacheError):
    """A KV-event watcher's position is older than the replay buffer holds: its stream ends,
    and it resumes from its cursor (a snapshot, if that is gone too)."""


class TooManyWatchers(CacheError):
    """WatchEvents beyond the service's limit of watchers at once."""
