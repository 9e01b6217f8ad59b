"""Domain errors. The servicer maps each class to one gRPC status code (servicer.STATUS_OF)."""


class CacheError(Exception):
    """Base class of everything the domain raises on purpose."""


class InvalidArgument(CacheError):
    """The request itself is malformed: empty or negative tokens, bad sizes."""


class UnknownPool(InvalidArgument):
    """No pool registered under that id."""


class UnknownLease(CacheError):
    """The lease does not exist: never granted, released, or expired."""


class FencedIncarnation(CacheError):
    """The caller names an incarnation older than the pool's current one."""


class OutOfBlocks(CacheError):
    """Not enough free or evictable blocks, even after eviction. Queue and retry."""


class NotFound(CacheError):
    """An admin target (a prefix to pin, unpin or evict) is not in the index."""
