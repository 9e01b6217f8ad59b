"""Session-wide test hooks."""

from __future__ import annotations

import os
import sys

import pytest

_EXIT_STATUS = pytest.StashKey[int]()

# On an NVIDIA GPU MLX runs float32 matmuls as TF32 by default: paged and dense paths then
# differ by ~1e-2 in their logits (their matmuls have other shapes, so other roundings), above
# the suite's float32 tolerance, and greedy ties can flip. The suite compares float32 as
# float32 (the GPU kernels' own tolerances are per dtype: docs/gpu-attention.md). Set before
# MLX is imported; the CPU ignores it; a value given in the environment wins.
os.environ.setdefault("MLX_ENABLE_TF32", "0")


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    session.config.stash[_EXIT_STATUS] = int(session.exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """Leave without running C++ static destructors.

    MLX 0.32 sometimes aborts the process at exit ("terminate called without an active
    exception", status 134) once it has run on a thread other than the main one, as the
    in-process workers here do. Everything pytest reports is written by now; os._exit keeps
    the real exit status instead of that abort.
    """
    status = config.stash.get(_EXIT_STATUS, None)
    if status is None or "mlx.core" not in sys.modules:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


# Markers whose tests run only when selected (`pytest -m sweep`, `pytest -m long`): the full
# model-family sweep, and fuzz runs tens of thousands of inputs long (24 GB and counting, once).
OPT_IN = ("sweep", "long")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    selected = config.getoption("markexpr") or ""
    for marker in OPT_IN:
        if marker in selected:
            continue
        skip = pytest.mark.skip(reason=f"opt-in: run with -m {marker}")
        for item in items:
            if item.get_closest_marker(marker):
                item.add_marker(skip)
