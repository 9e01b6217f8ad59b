"""docs/configuration.md documents every flag and variable the processes really have, and every
link to a section of the README or docs/ finds its heading."""

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


def heading_anchors(md: Path) -> set[str]:
    """The anchors GitHub gives ``md``'s headings: lowercased, punctuation but ``-`` and ``_``
    dropped, spaces to ``-``, a repeated one suffixed ``-1``, ``-2``..."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in md.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        m = None if fenced else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m is None:
            continue
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1).replace("`", ""))
        slug = re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def test_every_link_to_a_section_finds_its_heading():
    """A link to ``file.md#section`` (or ``#section``) in the README or docs/ names a heading
    that exists: a renamed section breaks the test, not the reader's click."""
    pages = [DOCS.parent / "README.md", *sorted(DOCS.glob("*.md"))]
    checked, broken = 0, []
    for page in pages:
        for target, anchor in re.findall(r"\]\(([^)\s]*?)#([^)\s]+)\)", page.read_text()):
            path = page.parent / target if target else page
            if path.suffix != ".md" or not path.exists():
                continue
            checked += 1
            if anchor not in heading_anchors(path):
                broken.append(f"{page.name}: {target}#{anchor}")
    assert checked > 10
    assert not broken, broken


def test_heading_anchors_follow_github(tmp_path):
    page = tmp_path / "p.md"
    page.write_text(
        "# Launching a step: MLX's CUDA graphs off\n"
        "## Compiled decode forwards (`mx.compile`)\n"
        "```\n# not a heading\n```\n"
        "## Notes\n## Notes\n"
    )
    assert heading_anchors(page) == {
        "launching-a-step-mlxs-cuda-graphs-off",
        "compiled-decode-forwards-mxcompile",
        "notes",
        "notes-1",
    }
