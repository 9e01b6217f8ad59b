"""What the gateway believes of the cache service during and after an outage
(gateway/cache_status.py): a request while it is believed down asks the service once more, so
the first request after it is back is served, not refused on the last failed poll's word; the
others are refused at once while a probe is recent."""

from __future__ import annotations

from gateway import cache_status
from gateway.cache_status import CacheStatus
from gateway.tokenizer import Tokenizer
from kvcache_service.server import RunningService
from tests.gateway.conftest import started_stack
from tests.gateway.fake_worker import MODEL


def test_a_probe_is_due_at_most_once_an_interval() -> None:
    now = [100.0]
    status = CacheStatus(grace_s=2.0, clock=lambda: now[0])
    status.failed("refused")
    now[0] += 3
    assert status.down and status.probe_due() and not status.probe_due()
    now[0] += cache_status.PROBE_INTERVAL_S
    assert status.probe_due()
    status.ok()
    assert not status.down and status.down_for() == 0.0


async def test_a_request_finds_the_service_back_before_the_poller_does(
    cache: RunningService, tokenizer: Tokenizer
) -> None:
    """The poller's last word was a failure (the service restarted; its next poll is a minute
    away here, so only the request can find out): the request asks the service itself, finds
    it answering, and is served."""
    async with started_stack(cache, tokenizer, poll_interval_s=60.0) as stack:
        await stack.poll()  # the workers known, as before the outage
        status = stack.gateway.gateway.dispatcher.cache_status
        status.failed("connection refused")
        status.down_since = status.clock() - 60  # believed down for a minute
        assert status.down
        body = {"model": MODEL, "messages": [{"role": "user", "content": "back?"}], "max_tokens": 2}
        r = await stack.http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        assert not status.down and status.down_since is None
        assert (await stack.http.get("/health")).status_code == 200
