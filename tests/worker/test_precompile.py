"""The kernel precompile children (``worker.precompile``): each builds the model as the worker
does, without importing transformers, runs the self-check's dense forwards in its own order and
publishes its cache after each so that no reader sees a partial module; the worker stops them
once its self-check is over. They run on CUDA only; their mechanics are tested here on the
CPU."""

from __future__ import annotations

import os
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


@pytest.mark.parametrize("role", precompile.ROLES)
def test_a_child_runs_the_dense_forwards_without_importing_transformers(role, tmp_path):
    model = ensure_tiny_model()
    own, target = tmp_path / "own", tmp_path / "target"
    own.mkdir()
    target.mkdir()
    (target / "seeded.ptx").write_text("from the worker")
    env = {**os.environ, precompile.PTX_CACHE_ENV: str(own), precompile.TARGET_ENV: str(target)}
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(model), "8", role],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", "False", "True"]  # mlx_lm.utils, not transformers
    published = [line for line in done.stderr.splitlines() if line.startswith(precompile.DONE)]
    assert len(published) == 4  # three prompts and the one-token forwards, each published
    first = "one-token" if role == "steps-first" else "prompt of"
    assert first in published[0]
    assert (own / "seeded.ptx").read_text() == "from the worker"  # seeded: never compiled again


def test_an_unknown_role_is_refused():
    assert precompile.main([str(ensure_tiny_model()), "8", "everything"]) == 2


def test_finish_stops_the_children_and_leaves_no_partial_file(tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    children = []
    for role in precompile.ROLES:
        cache = tmp_path / role
        cache.mkdir()
        log = tmp_path / f"{role}.log"
        log.write_text(f"{precompile.DONE} prompt of 12: 1 new modules in 0.1 s\n")
        process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        (target / f".module.{process.pid}.ptx").write_text("half")  # stopped mid-publish
        children.append(precompile.Child(role, process, cache, log))
    (target / "whole.ptx").write_text("kept")
    pre = precompile.Precompile(children, target, 0.0)
    precompile.finish(pre)
    assert all(c.process.returncode is not None and c.process.returncode < 0 for c in children)
    assert [p.name for p in target.iterdir()] == ["whole.ptx"]
    assert not any(c.cache.exists() or c.log.exists() for c in children)
    precompile.finish(pre)  # idempotent


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
