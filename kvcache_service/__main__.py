"""`python -m kvcache_service`: run the KV-cache authority until SIGINT/SIGTERM."""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

from kvcache_service.config import ServiceConfig
from kvcache_service.server import running
from kvserve_launch.run import run_until_signal

log = logging.getLogger("kvcache_service")


def save_token(token: str) -> Path:
    """Writes a generated admin token where only this user can read it."""
    path = Path(tempfile.gettempdir()) / f"kvcache-admin-token-{os.getpid()}"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return path


@contextlib.asynccontextmanager
async def serving(config: ServiceConfig) -> AsyncIterator[str]:
    """The service, running; yields its ready line."""
    async with running(config) as svc:
        if not config.admin_token:
            where = save_token(svc.config.admin_token)
            # Never the token itself: logs are collected and read far more widely than it is.
            log.warning(
                "no admin token configured; generated one (%s...), saved to %s (mode 0600)",
                svc.config.admin_token[:4],
                where,
            )
        if not config.service_token:
            log.warning("no service token configured: data-plane calls are not authenticated")
        log.info(
            "kvcache service listening on %s (lease TTL %.1fs)", svc.address, config.lease_ttl_s
        )
        yield f"KVCACHE_READY {svc.address}"


if __name__ == "__main__":
    cfg = ServiceConfig.from_args()
    run_until_signal("kvcache_service", cfg.log_level, lambda: serving(cfg))
