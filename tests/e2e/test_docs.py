"""docs/configuration.md documents every flag and variable the processes really have."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gateway.config import GatewayConfig
from kvcache_service.config import ServiceConfig
from kvserve_launch.config import LaunchConfig
from worker.config import WorkerConfig

DOCS = Path(__file__).resolve().parents[2] / "docs"


def flags_of(from_args, capsys) -> set[str]:  # type: ignore[no-untyped-def]
    """The long flags of a config's real parser, read from its --help."""
    with pytest.raises(SystemExit):
        from_args(["--help"])
    return set(re.findall(r"--[a-z][a-z0-9-]+", capsys.readouterr().out)) - {"--help"}


@pytest.mark.parametrize(
    ("from_args", "prefix"),
    [
        (ServiceConfig.from_args, "KVCACHE_"),
        (WorkerConfig.from_args, "KVWORKER_"),
        (GatewayConfig.from_args, "KVGATEWAY_"),
        (LaunchConfig.from_args, "KVSERVE_"),
    ],
)
def test_every_flag_is_documented(from_args, prefix, capsys):
    text = (DOCS / "configuration.md").read_text()
    flags = flags_of(from_args, capsys)
    assert flags
    for flag in flags:
        assert f"`{flag}`" in text, flag
        if flag.startswith("--no-"):
            continue
        assert f"`{prefix}{flag[2:].upper().replace('-', '_')}`" in text, flag


def test_docs_exist_and_link():
    for name in ("architecture.md", "configuration.md", "operations.md"):
        assert (DOCS / name).read_text().startswith("# ")
    assert "choose_worker" in (DOCS / "architecture.md").read_text()
    ops = (DOCS / "operations.md").read_text()
    for command in ("stats", "tree", "lookup", "evict", "flush", "pin", "unpin", "check"):
        assert f"`{command}" in ops, command
