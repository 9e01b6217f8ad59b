"""The full family sweep runs only when asked for: ``pytest -m sweep``."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "sweep" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="full family sweep: run with -m sweep")
    for item in items:
        if item.get_closest_marker("sweep"):
            item.add_marker(skip)
