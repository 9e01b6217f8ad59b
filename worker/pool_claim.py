"""What lets a restarted worker take its own pool back at once.

The cache service re-registers a live pool (one whose heartbeats have not lapsed) only for a
caller that presents the pool's current incarnation (``kvcache_service.authority``), so that a
second worker given the same pool id cannot wipe a live pool's index. A worker that crashed
and was restarted (by the launcher, systemd, Kubernetes) lost its incarnation with its memory,
and so waited out the lease TTL (30 s) before it could serve again, though it was ready in
seconds: a single-worker system answered 503 for all that time, and a router reading KV
events kept the dead pool's blocks.

The claim keeps the incarnation in a file of the user's (0600, ``~/.cache/kvserve/pools``),
one per (cache service, pool id), held under an exclusive ``flock`` for the worker's life.
The kernel drops the lock when the process dies, however it dies, so the next worker of that
pool on this machine takes the lock and presents the incarnation: its registration replaces
the dead one's at once (a new incarnation, an empty index, as before). A second live worker
misconfigured with the same pool id finds the lock held, presents nothing, and is refused as
before. A worker restarted on another machine has no file and waits the TTL, as before.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
from pathlib import Path

from kvserve_model.model_cache import user_cache_dir

log = logging.getLogger(__name__)


class PoolClaim:
    """This process's claim on a pool's incarnation (see the module docstring). ``held``:
    whether it took the lock; a claim not held reads 0 and records nothing."""

    def __init__(self, cache_address: str, pool_id: str, directory: Path | None = None) -> None:
        key = hashlib.sha256(f"{cache_address}\0{pool_id}".encode()).hexdigest()[:32]
        self.path = (directory or user_cache_dir("pools")) / f"{key}.json"
        self._fd: int | None = None
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as err:  # an unwritable cache: restarts wait the TTL, as before
            log.warning("cannot keep the pool's incarnation in %s: %s", self.path, err)
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            log.warning(
                "another live process on this machine holds pool %r of %s: this worker cannot "
                "take it over before that pool's lease TTL lapses (is a second worker running "
                "with the same --worker-id?)",
                pool_id,
                cache_address,
            )
            return
        self._fd = fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def incarnation(self) -> int:
        """The incarnation the last holder recorded, or 0 (none, unreadable, not held)."""
        if self._fd is None:
            return 0
        try:
            raw = os.pread(self._fd, 4096, 0)
            value = json.loads(raw.decode()).get("incarnation", 0) if raw else 0
        except (OSError, ValueError, AttributeError):
            return 0
        return value if isinstance(value, int) and value > 0 else 0

    def record(self, incarnation: int) -> None:
        """Keeps ``incarnation`` for the next holder (nothing if this claim is not held)."""
        if self._fd is None:
            return
        data = json.dumps({"incarnation": incarnation}).encode()
        try:
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, data, 0)
        except OSError as err:
            log.warning("cannot record the pool's incarnation in %s: %s", self.path, err)

    def close(self) -> None:
        """Lets the claim go (the lock too); the recorded incarnation stays for the next."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
