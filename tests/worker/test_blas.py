"""The OpenBLAS preload: found, loadable, numerically right, and picked up by a re-exec."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from worker.blas import REEXEC_MARKER, fast_blas_env, find_fast_blas, measure_gflops

ROOT = Path(__file__).resolve().parents[2]
linux_with_openblas = pytest.mark.skipif(
    find_fast_blas() is None, reason="Linux with a preloadable OpenBLAS only"
)


def _clean_env(**extra: str) -> dict[str, str]:
    drop = ("LD_PRELOAD", REEXEC_MARKER, "OPENBLAS_NUM_THREADS", "KVSERVE_BLAS_THREADS")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PYTHONPATH"] = str(ROOT)
    return env | extra


def _python(code: str, env: dict[str, str]) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@linux_with_openblas
def test_preloaded_openblas_is_used_and_correct():
    code = (
        "import numpy as np, mlx.core as mx\n"
        "from worker.blas import loaded_openblas\n"
        "a = np.random.default_rng(0).standard_normal((300, 200)).astype(np.float32)\n"
        "b = np.random.default_rng(1).standard_normal((200, 100)).astype(np.float32)\n"
        "got = np.array(mx.array(a) @ mx.array(b))\n"
        "print(loaded_openblas() is not None, np.abs(got - a @ b).max() < 1e-3)\n"
    )
    assert _python(code, fast_blas_env(_clean_env())) == "True True"


@linux_with_openblas
def test_thread_count_setting():
    env = fast_blas_env(_clean_env(KVSERVE_BLAS_THREADS="1"))
    assert env["OPENBLAS_NUM_THREADS"] == "1"
    env = fast_blas_env(_clean_env(KVSERVE_BLAS_THREADS="1", OPENBLAS_NUM_THREADS="2"))
    assert env["OPENBLAS_NUM_THREADS"] == "2"  # an explicit OpenBLAS setting wins


@linux_with_openblas
def test_ensure_fast_blas_reexecutes_once():
    code = "from worker.blas import ensure_fast_blas; print(ensure_fast_blas().fast)"
    assert _python(code, _clean_env()) == "True"


def test_disabled_or_looping_falls_back_with_a_warning():
    code = (
        "from worker.blas import ensure_fast_blas; s = ensure_fast_blas(); print(s.fast, s.detail)"
    )
    out = _python(code, _clean_env(KVSERVE_FAST_BLAS="0"))
    assert out.startswith("False disabled")
    if sys.platform.startswith("linux") and find_fast_blas() is not None:
        looped = _python(code, _clean_env(**{REEXEC_MARKER: "1"}))  # marker but no preload
        assert looped.startswith("False")


@linux_with_openblas
def test_module_launcher_keeps_python_dash_m():
    done = subprocess.run(
        [sys.executable, "-m", "worker.blas"],
        env=_clean_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "OpenBLAS preloaded" in done.stdout and "GFLOPS" in done.stdout


def test_measure_gflops_is_positive():
    assert measure_gflops(n=64, repeats=1) > 0
