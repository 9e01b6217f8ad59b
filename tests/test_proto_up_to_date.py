"""The committed kvserve_proto/ must be exactly what `make proto` generates from proto/."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def load_protogen():
    spec = importlib.util.spec_from_file_location("protogen", ROOT / "scripts" / "protogen.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_code_matches_proto_sources(tmp_path: Path) -> None:
    protogen = load_protogen()
    fresh = {p.relative_to(tmp_path) for p in protogen.generate(tmp_path)}
    committed = {
        p.relative_to(ROOT)
        for p in (ROOT / "kvserve_proto").rglob("*")
        if p.is_file()
        and "__pycache__" not in p.parts
        and p.relative_to(ROOT / "kvserve_proto").as_posix() not in protogen.HAND_WRITTEN
    }
    assert fresh == committed, "run `make proto`: generated files differ in name"
    stale = [str(p) for p in fresh if (tmp_path / p).read_bytes() != (ROOT / p).read_bytes()]
    assert not stale, f"run `make proto`: out of date with proto/: {stale}"
