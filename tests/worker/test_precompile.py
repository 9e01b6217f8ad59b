"""The kernel precompile child (``worker.precompile``): it builds the model as mlx-lm does and
runs the worker's self-check without importing transformers, and its cache is published so
that no reader sees a partial module. It runs on CUDA only; its mechanics are tested here on
the CPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvserve_model.tiny_model import ensure_tiny_model
from worker import precompile
from worker.model.device import cuda_available

ROOT = Path(__file__).resolve().parents[2]

_CHILD = """
import sys
from worker import precompile
code = precompile.main(sys.argv[1:])
print(code, "transformers" in sys.modules, "mlx_lm.utils" in sys.modules)
"""


def test_the_child_checks_the_model_without_importing_transformers():
    model = ensure_tiny_model()
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(model), "8"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", "False", "True"]  # mlx_lm.utils, not transformers
    assert "self-check passed" in done.stderr


def test_publish_copies_whole_modules_and_keeps_what_is_there(tmp_path):
    source, target = tmp_path / "child", tmp_path / "worker"
    for name in ("a", "sub/b", "c"):
        for suffix, text in ((".ptx", f"ptx {name}"), (".txt", f"k\t{name}\n"), (".cu", "src")):
            path = (source / name).with_suffix(suffix)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    (target).mkdir()
    (target / "c.ptx").write_text("mine")
    assert precompile.publish(source, target) == 2
    assert (target / "a.ptx").read_text() == "ptx a" and (target / "a.txt").read_text() == "k\ta\n"
    assert (target / "sub" / "b.ptx").read_text() == "ptx sub/b"
    assert (target / "c.ptx").read_text() == "mine"  # kept
    leftovers = [p.name for p in target.rglob(".*")]
    assert leftovers == []  # no temporary file left
    assert precompile.publish(source, target) == 0  # idempotent


@pytest.mark.skipif(cuda_available(), reason="CUDA is here: the child starts")
def test_off_cuda_nothing_starts(tmp_path):
    assert precompile.start(tmp_path, 32) is None
    precompile.finish(None)  # nothing to wait for
