"""Device-aware defaults: the pure policy for CPU and GPU inputs (no GPU needed), the memory
probe against MLX modules that lack functions, and the worker flags that feed them."""

from __future__ import annotations

import types

import pytest

from worker import device_defaults as dd
from worker.config import WorkerConfig
from worker.device_defaults import GIB, MIB, choose_limits, free_memory

PER_BLOCK = 128 * 1024  # bytes of K and V for one block (4 layers, 4 heads, 32 dims, fp32 ...)


def test_cpu_keeps_the_cpu_defaults() -> None:
    limits = choose_limits("cpu", 20 * GIB, PER_BLOCK, WorkerConfig())
    assert limits.num_blocks == 256 * MIB // PER_BLOCK
    assert (limits.max_batch_size, limits.max_step_tokens) == (32, 256)
    assert limits.pool_source == "256 MiB default"


def test_gpu_takes_a_fraction_of_free_memory_and_raises_the_step_limits() -> None:
    limits = choose_limits("gpu", 100 * GIB, PER_BLOCK, WorkerConfig())
    assert limits.num_blocks == 50 * GIB // PER_BLOCK
    assert (limits.max_batch_size, limits.max_step_tokens) == (32, 2048)
    assert limits.pool_source == "0.5 of 100.0 GiB free"


def test_gpu_with_unknown_free_memory_falls_back_to_a_fixed_budget() -> None:
    limits = choose_limits("gpu", None, PER_BLOCK, WorkerConfig())
    assert limits.num_blocks == 256 * MIB // PER_BLOCK
    assert "unknown" in limits.pool_source
    assert limits.max_batch_size == 32


@pytest.mark.parametrize("device", ["cpu", "gpu"])
def test_explicit_settings_win_over_the_device(device) -> None:
    free = 100 * GIB
    cfg = WorkerConfig(max_batch_size=3, max_step_tokens=77)
    limits = choose_limits(device, free, PER_BLOCK, cfg)
    assert (limits.max_batch_size, limits.max_step_tokens) == (3, 77)
    # Pool: num_blocks, then kv_memory_mb, then kv_memory_fraction.
    both = WorkerConfig(num_blocks=10, kv_memory_mb=64, kv_memory_fraction=0.9)
    assert choose_limits(device, free, PER_BLOCK, both).num_blocks == 10
    mb = WorkerConfig(kv_memory_mb=64, kv_memory_fraction=0.9)
    assert choose_limits(device, free, PER_BLOCK, mb).num_blocks == 64 * MIB // PER_BLOCK
    frac = WorkerConfig(kv_memory_fraction=0.25)
    limits = choose_limits(device, free, PER_BLOCK, frac)
    assert limits.num_blocks == 25 * GIB // PER_BLOCK
    assert limits.pool_source == "0.25 of 100.0 GiB free"


def test_the_request_limit_scales_with_the_batch_unless_set() -> None:
    """--max-pending-requests: unset, 8 requests per batch slot (running + waiting); a value
    wins, 0 included (no limit)."""
    assert choose_limits("cpu", None, PER_BLOCK, WorkerConfig()).max_pending_requests == 256
    assert choose_limits("gpu", None, PER_BLOCK, WorkerConfig()).max_pending_requests == 256
    cfg = WorkerConfig(max_batch_size=3)
    assert choose_limits("cpu", None, PER_BLOCK, cfg).max_pending_requests == 24
    for value in (0, 5):
        cfg = WorkerConfig(max_batch_size=3, max_pending_requests=value)
        assert choose_limits("gpu", None, PER_BLOCK, cfg).max_pending_requests == value


def test_a_pool_has_at_least_one_block() -> None:
    assert choose_limits("gpu", 1000, PER_BLOCK, WorkerConfig()).num_blocks == 1
    assert choose_limits("cpu", None, 10 * GIB, WorkerConfig()).num_blocks == 1


def test_the_log_line_names_device_pool_and_limits() -> None:
    limits = choose_limits("gpu", 4 * GIB, MIB, WorkerConfig(block_size=16))
    line = limits.describe(16, MIB)
    assert "device gpu" in line
    assert "2048 blocks x 16 = 32768 tokens (2048 MiB, 0.5 of 4.0 GiB free)" in line
    assert "batch 32 sequences, step 2048 tokens, up to 256 requests" in line


# -- the memory probe -------------------------------------------------------------------------


def fake_mx(info=None, *, active=None, cache=None, limit=None, metal=None):
    """An ``mlx.core`` stand-in with only the functions given (None: missing)."""
    mod = types.SimpleNamespace()
    if info is not None:
        mod.device_info = info if callable(info) else (lambda: info)
    for name, value in (
        ("get_active_memory", active),
        ("get_cache_memory", cache),
        ("get_memory_limit", limit),
    ):
        if value is not None:
            setattr(mod, name, lambda v=value: v)
    if metal is not None:
        mod.metal = metal
    return mod


def test_cuda_free_memory_counts_mlx_cache_and_respects_the_memory_limit(monkeypatch) -> None:
    info = {"free_memory": 60 * GIB, "total_memory": 80 * GIB, "device_name": "NVIDIA H100"}
    monkeypatch.setattr(dd, "mx", fake_mx(info, active=4 * GIB, cache=2 * GIB, limit=64 * GIB))
    assert free_memory("gpu") == 60 * GIB  # min(60 + 2, 64 - 4)
    monkeypatch.setattr(dd, "mx", fake_mx(info, active=4 * GIB, cache=2 * GIB, limit=80 * GIB))
    assert free_memory("gpu") == 62 * GIB


def test_metal_free_memory_is_the_working_set_less_what_mlx_holds(monkeypatch) -> None:
    info = {"memory_size": 64 * GIB, "max_recommended_working_set_size": 48 * GIB}
    monkeypatch.setattr(dd, "mx", fake_mx(info, active=8 * GIB))
    assert free_memory("gpu") == 40 * GIB


def test_old_mlx_with_only_the_metal_module(monkeypatch) -> None:
    metal = types.SimpleNamespace(
        is_available=lambda: True,
        device_info=lambda: {"memory_size": 16 * GIB},
        get_active_memory=lambda: GIB,
    )
    monkeypatch.setattr(dd, "mx", fake_mx(metal=metal))
    assert free_memory("gpu") == 15 * GIB


def test_missing_or_failing_memory_functions_mean_unknown(monkeypatch) -> None:
    monkeypatch.setattr(dd, "mx", fake_mx())
    assert free_memory("gpu") is None

    def broken():
        raise RuntimeError("no backend")

    monkeypatch.setattr(dd, "mx", fake_mx(broken, active=GIB))
    assert free_memory("gpu") is None
    monkeypatch.setattr(dd, "mx", fake_mx({"device_name": "x"}, limit=10 * GIB, active=GIB))
    assert free_memory("gpu") == 9 * GIB  # only MLX's own limit is known


def test_the_real_mlx_answers_without_raising() -> None:
    assert dd.device_kind() in ("cpu", "gpu")
    free = free_memory(dd.device_kind())
    assert free is None or free >= 0
    cpu = free_memory("cpu")
    assert cpu is None or cpu > 0


# -- MLX settings ---------------------------------------------------------------------------------


def test_mlx_settings_fill_in_only_what_the_operator_left_unset() -> None:
    env = {"PATH": "/bin"}
    assert dd.apply_mlx_env(env) == {"MLX_USE_CUDA_GRAPHS": "0"}
    assert env == {"PATH": "/bin", "MLX_USE_CUDA_GRAPHS": "0"}
    assert dd.apply_mlx_env(env) == {}  # a second call (a re-exec'd worker) sets nothing
    mine = {"MLX_USE_CUDA_GRAPHS": "1"}
    assert dd.apply_mlx_env(mine) == {}
    assert mine == {"MLX_USE_CUDA_GRAPHS": "1"}


def test_the_worker_process_sets_them_before_anything_else_runs(monkeypatch) -> None:
    """``python -m worker`` sets them before the BLAS choice (which may re-exec the process,
    keeping its environment) and before the model loads (MLX reads them once)."""
    import os

    import worker.__main__ as entry

    monkeypatch.setenv("MLX_USE_CUDA_GRAPHS", "")  # restored (unset) after the test
    monkeypatch.delenv("MLX_USE_CUDA_GRAPHS")
    seen = {}

    class Stop(Exception):
        pass

    def first_step():  # type: ignore[no-untyped-def]
        seen.update(os.environ)
        raise Stop

    monkeypatch.setattr(entry, "ensure_fast_blas", first_step)
    with pytest.raises(Stop):
        entry.start(WorkerConfig.from_args([]))
    assert seen["MLX_USE_CUDA_GRAPHS"] == "0"
    monkeypatch.setenv("MLX_USE_CUDA_GRAPHS", "1")
    with pytest.raises(Stop):
        entry.start(WorkerConfig.from_args([]))
    assert seen["MLX_USE_CUDA_GRAPHS"] == "1"


# -- flags --------------------------------------------------------------------------------------


@pytest.fixture
def clean_env(monkeypatch):
    import os

    for name in list(os.environ):
        if name.startswith("KVWORKER_"):
            monkeypatch.delenv(name)
    return monkeypatch


def test_unset_flags_mean_the_device_default(clean_env) -> None:
    cfg = WorkerConfig.from_args([])
    assert (cfg.num_blocks, cfg.kv_memory_mb, cfg.kv_memory_fraction) == (0, 0, 0.0)
    assert (cfg.max_batch_size, cfg.max_step_tokens) == (0, 0)
    assert cfg.warmup is True
    assert cfg.max_pending_requests is None


def test_flags_and_variables_parse(clean_env) -> None:
    cfg = WorkerConfig.from_args(
        ["--kv-memory-fraction", "0.3", "--max-batch-size", "8", "--max-step-tokens", "512"]
    )
    assert (cfg.kv_memory_fraction, cfg.max_batch_size, cfg.max_step_tokens) == (0.3, 8, 512)
    assert WorkerConfig.from_args(["--no-warmup"]).warmup is False
    clean_env.setenv("KVWORKER_WARMUP", "off")
    clean_env.setenv("KVWORKER_KV_MEMORY_FRACTION", "0.7")
    clean_env.setenv("KVWORKER_KV_MEMORY_MB", "1024")
    cfg = WorkerConfig.from_args([])
    assert (cfg.warmup, cfg.kv_memory_fraction, cfg.kv_memory_mb) == (False, 0.7, 1024)
    assert WorkerConfig.from_args(["--warmup"]).warmup is True  # the flag wins
    assert WorkerConfig.from_args(["--max-pending-requests", "0"]).max_pending_requests == 0
    clean_env.setenv("KVWORKER_MAX_PENDING_REQUESTS", "12")
    assert WorkerConfig.from_args([]).max_pending_requests == 12


@pytest.mark.parametrize(
    "argv",
    [
        ["--kv-memory-fraction", "1.5"],
        ["--kv-memory-fraction", "-0.1"],
        ["--max-batch-size", "-1"],
        ["--max-pending-requests", "-1"],
        ["--kv-memory-mb", "-5"],
        ["--block-size", "0"],
    ],
)
def test_bad_values_are_refused(clean_env, argv) -> None:
    with pytest.raises(SystemExit):
        WorkerConfig.from_args(argv)
