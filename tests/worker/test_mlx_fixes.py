"""The workaround for MLX's sorted ``gather_mm`` / ``gather_qmm`` on CUDA
(``worker.model.mlx_fixes``), and the start-up checks' dirty memory.

On the CPU: which calls the wrapper sends unsorted, that dropping the sort hint leaves an MoE
layer's result unchanged (plain and quantized experts), that every runner installs it where
CUDA is, and that both start-up parity checks run on a dirtied buffer cache. The ``cuda`` tests
check the worker's call against the CPU on dirty memory, and gpt_oss and phixtral against
dense mlx-lm on dirty memory, which failed before the workaround.
"""

from __future__ import annotations

from unittest import mock

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

from tests.worker import families, sweep
from tests.worker.helpers import tiny_model
from worker.model import device as devices
from worker.model import mlx_fixes
from worker.model.dense_runner import DenseRunner, check_dense_parity, estimate_state
from worker.model.runner import ModelRunner
from worker.model.self_check import check_paged_parity

cuda = pytest.mark.skipif(
    not devices.cuda_available(), reason="needs an NVIDIA GPU (MLX's CUDA backend)"
)


@pytest.fixture(autouse=True)
def _restore():
    was = mlx_fixes.installed()
    yield
    if was:
        mlx_fixes.install()  # as a runner of this process left it (a CUDA machine)
    else:
        mlx_fixes.uninstall()


def _recorder():
    calls = []

    def op(*args, **kw):
        calls.append(kw)
        return mx.zeros((1,))

    return op, calls


@pytest.mark.parametrize("on_cuda", [True, False])
def test_sorted_calls_run_unsorted_only_on_cuda(on_cuda):
    op, calls = _recorder()
    wrapped = mlx_fixes.unsorted_on_cuda(op)
    with mock.patch.object(mlx_fixes, "_on_cuda", lambda stream: on_cuda):
        wrapped(1, 2, rhs_indices=3, sorted_indices=True)
        wrapped(1, 2, rhs_indices=3)
    assert [c["sorted_indices"] for c in calls] == [not on_cuda, False]
    assert all(c["rhs_indices"] == 3 for c in calls)


def test_the_device_a_call_runs_on():
    with mock.patch.object(devices, "cuda_available", lambda: True):
        assert mlx_fixes._on_cuda(None) == (mx.default_device() == mx.gpu)
        assert not mlx_fixes._on_cuda(mx.cpu)
        assert not mlx_fixes._on_cuda(mx.default_stream(mx.cpu))
        assert mlx_fixes._on_cuda(mx.gpu)
        assert mlx_fixes._on_cuda(mx.Device(mx.gpu))
    with mock.patch.object(devices, "cuda_available", lambda: False):
        assert not mlx_fixes._on_cuda(mx.gpu)  # Metal: MLX's sorted kernel is kept


def test_install_is_once_per_process_and_only_with_cuda(monkeypatch):
    mlx_fixes.uninstall()
    originals = (mx.gather_mm, mx.gather_qmm)
    with mock.patch.object(devices, "cuda_available", lambda: False):
        assert not mlx_fixes.install()
        assert (mx.gather_mm, mx.gather_qmm) == originals
    with mock.patch.object(devices, "cuda_available", lambda: True):
        monkeypatch.setattr(mlx_fixes, "_kept_sorted", False)
        mlx_fixes.keep_sorted_gathers()  # --cuda-sorted-gather
        assert not mlx_fixes.install()
        assert (mx.gather_mm, mx.gather_qmm) == originals
        monkeypatch.setattr(mlx_fixes, "_kept_sorted", False)
        assert mlx_fixes.install()
        wrapped = (mx.gather_mm, mx.gather_qmm)
        assert wrapped[0] is not originals[0] and wrapped[1] is not originals[1]
        assert mlx_fixes.install() and (mx.gather_mm, mx.gather_qmm) == wrapped  # once
    mlx_fixes.uninstall()
    assert (mx.gather_mm, mx.gather_qmm) == originals


def test_every_runner_installs_it_where_cuda_is():
    mlx_fixes.uninstall()
    model = tiny_model("llama", 0)
    with mock.patch.object(devices, "cuda_available", lambda: True):
        ModelRunner.create(model, block_size=16, num_blocks=8)
    assert mlx_fixes.installed()


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("layer", ["glu", "mlp"])
def test_a_moe_layer_is_unchanged_when_its_sort_is_dropped(layer, quantized):
    """mlx-lm's MoE layers sort at 64+ (token, expert) pairs; the unsorted kernels (gather_mm,
    and gather_qmm for quantized experts) must give the same result, the premise of the
    workaround."""
    mx.random.seed(3)
    cls = SwitchGLU if layer == "glu" else SwitchMLP
    m = cls(64, 128, 4, bias=True)
    m.update(
        {k: mx.random.normal(v.shape) * 0.2 for k, v in _flat(m.parameters()).items()},
        strict=False,
    )
    if quantized:
        nn.quantize(m, group_size=32, bits=4)
    calls: list[bool] = []
    rng = np.random.default_rng(0)
    x = mx.array(rng.standard_normal((40, 64)).astype(np.float32))
    idx = mx.array(rng.integers(0, 4, (40, 2)).astype(np.uint32))  # 80 pairs: sorted
    sorted_out = m(x, idx)
    with (
        mock.patch.object(devices, "cuda_available", lambda: True),
        mock.patch.object(mlx_fixes, "_on_cuda", lambda stream: calls.append(True) or True),
    ):
        mlx_fixes.uninstall()
        assert mlx_fixes.install()
        unsorted_out = m(x, idx)
    assert len(calls) == (3 if layer == "glu" else 2)  # every projection went unsorted
    assert float(mx.max(mx.abs(sorted_out - unsorted_out))) < 1e-5


def _flat(params, prefix=""):
    out = {}
    for k, v in params.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


@cuda
@pytest.mark.parametrize("shape", [(4, 81, 256, 64), (4, 81, 128, 64), (8, 150, 1024, 512)])
def test_the_workers_gather_is_right_on_cuda(shape):
    """The worker's call, through the workaround, matches the CPU on dirty memory. (MLX's
    sorted call was right here too when run alone: the wrong results needed other MoE work in
    the process first; the family test below reproduces them.)"""
    experts, tokens, k, n = shape
    rng = np.random.default_rng(1)
    idx = np.sort(rng.integers(0, experts, tokens * 2).astype(np.uint32))
    x = mx.array(rng.standard_normal((tokens * 2, 1, k)).astype(np.float32))
    w = mx.array((rng.standard_normal((experts, n, k)) / np.sqrt(k)).astype(np.float32))
    rhs = mx.array(idx)
    with mx.stream(mx.cpu):
        ref = mx.gather_mm(x, w.swapaxes(-1, -2), rhs_indices=rhs)
        mx.eval(ref)
    assert mlx_fixes.install()
    for _ in range(3):
        mlx_fixes.dirty_buffer_cache()
        out = mx.gather_mm(x, w.swapaxes(-1, -2), rhs_indices=rhs, sorted_indices=True)
        assert float(mx.max(mx.abs(out - ref))) < 1e-4 * float(mx.max(mx.abs(ref)))


@cuda
def test_moe_families_match_dense_on_dirty_memory_on_cuda():
    """What failed before the workaround (H100, mlx-cuda 0.32.4): gpt_oss, then phixtral with
    the buffer cache dirtied, phixtral's three-sequence prefill 4.7 off in the logits. With
    the workaround (every runner installs it) both match dense mlx-lm."""
    for family in ("gpt_oss", "phixtral"):
        model = families.classify(family).model
        assert model is not None
        mlx_fixes.dirty_buffer_cache()
        parity = sweep.run_parity(model, sweep.FULL, 6)
        assert parity.passed, (family, parity.max_diff, parity.mismatches[:3], parity.error)


def test_the_start_up_checks_run_on_dirty_memory():
    """Both start-up parity checks dirty the buffer cache before their first forward, so a
    kernel of this device that reads memory it did not write fails them (the sorted
    gather_mm did, on the paged side's batched MoE rows), and give the memory back after."""
    events: list[str] = []
    real_dirty = mlx_fixes.dirty_buffer_cache

    def dirty(*args, **kw):
        events.append("dirty")
        real_dirty(*args, **kw)

    def spy(cls, name):
        real = getattr(cls, name)

        def call(self, *args, **kw):
            events.append(name)
            return real(self, *args, **kw)

        return mock.patch.object(cls, name, call)

    paged = tiny_model("llama", 0)
    recurrent = families.classify("mamba").model
    assert recurrent is not None
    with (
        mock.patch.object(mlx_fixes, "dirty_buffer_cache", dirty),
        mock.patch.object(mx, "clear_cache", lambda: events.append("clear")),
        spy(ModelRunner, "forward"),
        spy(DenseRunner, "forward"),
    ):
        assert check_paged_parity(paged).ok
        assert events[0] == "dirty" and events[1] == "forward" and events[-1] == "clear"
        events.clear()
        runner = DenseRunner(
            recurrent, estimate_state(recurrent), block_size=sweep.BS, num_blocks=8
        )
        assert check_dense_parity(recurrent, runner).ok
        assert events[0] == "dirty" and events[1] == "forward" and events[-1] == "clear"
