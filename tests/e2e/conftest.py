"""The real system as processes on loopback: cache service, two workers, gateway.

Started once per test module through the launcher's own code (``kvserve_launch.system``),
so these tests also prove the commands ``make run`` uses. Child logs are kept, not printed,
and shown when a test fails; every process is stopped in teardown, whatever happened.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kvserve_launch.config import LaunchConfig
from kvserve_launch.process import KeptLines as LogSink
from kvserve_launch.system import System, launch
from kvserve_model.tiny_model import TINY_MODEL_NAME

ADMIN_TOKEN = "e2e-admin-token"
STARTUP_TIMEOUT_S = 240.0


@pytest.fixture(scope="module")
def logs() -> LogSink:
    return LogSink()


def started_system(logs: LogSink, **overrides: Any) -> Iterator[System]:
    """The whole system on loopback (two workers, any free ports; ``overrides`` change the
    launch config), stopped when the fixture that yields from it ends."""
    fields: dict[str, Any] = dict(
        workers=2,
        model=TINY_MODEL_NAME,
        host="127.0.0.1",
        http_port=0,
        grpc_port=0,
        cache_port=0,
        admin_token=ADMIN_TOKEN,
        num_blocks=256,
        startup_timeout_s=STARTUP_TIMEOUT_S,
    )
    config = LaunchConfig(**(fields | overrides))
    try:
        running = launch(config, sink=logs)
    except Exception as e:
        pytest.fail(f"the system did not start: {e}\n{logs.dump()}")
    try:
        yield running
    finally:
        running.stop(grace_s=10.0)


@pytest.fixture(scope="module")
def system(logs: LogSink) -> Iterator[System]:
    yield from started_system(logs)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):  # type: ignore[no-untyped-def]
    """Attach the processes' logs to a failing e2e test's report."""
    report = yield
    if report.failed and "logs" in getattr(item, "funcargs", {}):
        report.sections.append(("kvserve process logs", item.funcargs["logs"].dump()))
    return report
