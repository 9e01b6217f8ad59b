"""Startup failures say what happened: the launcher names the signal or the failure, shows the
child's last lines and what to try; each service says what it expected to go wrong in one line,
with no traceback, and exits with the status the launcher reads (kvserve_launch.startup)."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from gateway.config import GatewayConfig
from gateway.server import running as gateway_running
from kvcache_service.config import ServiceConfig
from kvcache_service.server import running as cache_running
from kvserve_launch.config import ENV_PREFIX, LaunchConfig
from kvserve_launch.diagnosis import describe_exit, hint
from kvserve_launch.process import TAIL_LINES, Child, ChildFailed
from kvserve_launch.startup import (
    EXCLUSIVE_PORT,
    Failure,
    ModelUnavailable,
    PortInUse,
    StartupError,
    setting,
)
from kvserve_launch.system import launch
from kvserve_model.tiny_model import TINY_MODEL_NAME
from worker.config import WorkerConfig

# --- what the launcher says ---------------------------------------------------------------


def test_exit_statuses_are_named():
    assert describe_exit(-signal.SIGILL) == "killed by SIGILL (illegal instruction)"
    assert describe_exit(-signal.SIGSEGV) == "killed by SIGSEGV (invalid memory access)"
    assert describe_exit(-signal.SIGKILL).startswith("killed by SIGKILL (")
    assert describe_exit(-signal.SIGABRT) == "killed by SIGABRT (aborted)"
    assert describe_exit(-signal.SIGBUS) == "killed by SIGBUS (bus error)"
    assert describe_exit(-signal.SIGUSR1).startswith("killed by SIGUSR1")  # strsignal's words
    assert describe_exit(-200) == "killed by signal 200"
    assert describe_exit(2) == "exited with status 2"
    assert describe_exit(Failure.PORT_IN_USE) == "exited with status 69 (port in use)"
    assert describe_exit(Failure.MODEL) == "exited with status 66 (model unavailable)"


def test_hints_for_known_failures():
    sigill = hint(-signal.SIGILL) or ""
    assert "CPU lacks an instruction" in sigill
    assert "KVSERVE_FAST_BLAS=0" in sigill and "KVSERVE_BLAS_LIB=" in sigill
    oom = hint(-signal.SIGKILL, oom=True) or ""
    assert "out-of-memory" in oom and "KVWORKER_KV_MEMORY_MB" in oom
    assert "--num-blocks or KVSERVE_NUM_BLOCKS" in oom
    # Without the kernel's word a SIGKILL is not called out of memory: kill -9 is one too.
    killed = hint(-signal.SIGKILL) or ""
    assert "another process" in killed and "KVWORKER_KV_MEMORY_MB" not in killed
    port = hint(Failure.PORT_IN_USE, setting(ENV_PREFIX, "cache_port")) or ""
    assert "--cache-port or KVSERVE_CACHE_PORT" in port
    assert "--model or KVSERVE_MODEL" in (hint(Failure.MODEL) or "")
    for code in (0, 1, 2, -signal.SIGTERM, Failure.OTHER):
        assert hint(code) is None, code


@pytest.mark.parametrize(
    ("from_args", "prefix", "names"),
    [
        (LaunchConfig.from_args, ENV_PREFIX, ("cache_port", "worker_base_port", "num_blocks")),
        (LaunchConfig.from_args, ENV_PREFIX, ("http_port", "grpc_port")),
        (WorkerConfig.from_args, "KVWORKER_", ("port", "kv_memory_mb")),
        (ServiceConfig.from_args, "KVCACHE_", ("port",)),
        (GatewayConfig.from_args, "KVGATEWAY_", ("http_port", "grpc_port")),
    ],
)
def test_hints_name_real_flags_and_variables(from_args, prefix, names, monkeypatch):
    for i, name in enumerate(names):
        flag, _, env = setting(prefix, name).split()
        assert getattr(from_args([flag, str(7 + i)]), name) == 7 + i
        monkeypatch.setenv(env, str(17 + i))
        assert getattr(from_args([]), name) == 17 + i


def test_child_failed_shows_the_last_lines_indented_and_no_blank_ones():
    output = [f"line {i}\n" for i in range(30)] + ["\n", "   \n"]
    e = ChildFailed("worker-0", "failed before it was ready: x", output, "try this")
    lines = str(e).splitlines()
    assert lines[0] == "worker-0 failed before it was ready: x. Its last output:"
    assert lines[1:-1] == [f"    line {i}" for i in range(30 - TAIL_LINES, 30)]
    assert lines[-1] == "  hint: try this"
    assert str(ChildFailed("cache", "failed", [])) == "cache failed, and printed nothing."


def python_child(name: str, code: str) -> Child:
    # No core file: the kernel may hand it to a slow core-dump helper.
    prelude = "import os, resource, signal, sys\nresource.setrlimit(resource.RLIMIT_CORE, (0, 0))\n"
    argv = [sys.executable, "-c", prelude + code]
    return Child(name, argv, ready_prefix="READY", sink=lambda name, line: None).start()


def test_a_child_killed_by_sigill_is_named_with_its_output_and_the_fix():
    code = (
        "print('loading the model', flush=True)\n"
        "print('BLAS: libopenblas.so.0', file=sys.stderr, flush=True)\n"
        "print('running a matmul', flush=True)\n"
        "os.kill(os.getpid(), signal.SIGILL)\n"
    )
    child = python_child("worker-0", code)
    with pytest.raises(ChildFailed) as e:
        child.wait_ready(30)
    text = str(e.value)
    assert text.startswith(
        "worker-0 failed before it was ready: killed by SIGILL (illegal instruction). "
    )
    for line in ("loading the model", "BLAS: libopenblas.so.0", "running a matmul"):
        assert f"\n    {line}\n" in text
    assert "  hint: the CPU lacks an instruction" in text and "KVSERVE_FAST_BLAS=0" in text
    assert all(line.strip() for line in text.splitlines())


def test_a_silent_child_killed_by_sigkill_is_named_with_both_causes():
    child = python_child("worker-1", "os.kill(os.getpid(), signal.SIGKILL)\n")
    with pytest.raises(ChildFailed) as e:
        child.wait_ready(30)
    text = str(e.value)
    assert "worker-1 failed before it was ready: killed by SIGKILL" in text
    assert "printed nothing" in text and "out-of-memory killer" in text


# --- what the services say ----------------------------------------------------------------


def test_a_startup_error_is_one_line():
    e = PortInUse("port 1 is\n  in use", "set --port")
    assert e.line("worker") == "worker: cannot start: port 1 is in use (set --port)"
    assert StartupError("no").line("gateway") == "gateway: cannot start: no"


def run_module(module: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )


@pytest.mark.e2e
def test_a_worker_without_its_model_says_so_in_one_line(tmp_path: Path):
    missing = tmp_path / "no-such-model"
    proc = run_module(
        "worker", "--model", str(missing), "--port", "0", "--log-level", "ERROR",
        KVSERVE_FAST_BLAS="0",
    )  # fmt: skip
    assert proc.returncode == Failure.MODEL, proc.stderr
    assert proc.stderr.splitlines() == [
        f"worker: cannot start: model directory {missing} does not exist "
        "(set --model or KVWORKER_MODEL)"
    ]
    assert "WORKER_READY" not in proc.stdout


@pytest.mark.e2e
async def test_a_cache_service_on_a_taken_port_says_so_in_one_line():
    async with cache_running(ServiceConfig(port=0, admin_token="t")) as held:
        proc = await asyncio.to_thread(run_module, "kvcache_service", "--port", str(held.port))
    assert proc.returncode == Failure.PORT_IN_USE, proc.stderr
    assert proc.stderr.splitlines() == [
        f"kvcache_service: cannot start: port {held.port} is in use (set --port or KVCACHE_PORT)"
    ]
    assert "KVCACHE_READY" not in proc.stdout


@pytest.mark.e2e
async def test_a_worker_on_a_taken_port_says_so_before_loading(tmp_path: Path):
    """A worker's taken port is its first check: said at once (here its model does not even
    exist), where it was found after seconds of loading and self-checking the model."""
    async with cache_running(ServiceConfig(port=0, admin_token="t")) as held:
        proc = await asyncio.to_thread(
            run_module, "worker", "--model", str(tmp_path / "none"), "--port", str(held.port),
            "--log-level", "ERROR", KVSERVE_FAST_BLAS="0",
        )  # fmt: skip
    assert proc.returncode == Failure.PORT_IN_USE, proc.stderr
    assert proc.stderr.splitlines() == [
        f"worker: cannot start: port {held.port} is in use (set --port or KVWORKER_PORT)"
    ]


async def test_the_gateway_names_its_taken_http_port():
    async with cache_running(ServiceConfig(port=0, admin_token="t")) as held:
        config = GatewayConfig(http_port=held.port, grpc_port=0)
        with pytest.raises(PortInUse, match=f"port {held.port} is in use") as e:
            async with gateway_running(config):
                pass
    assert "--http-port or KVGATEWAY_HTTP_PORT" in e.value.hint


async def test_grpc_servers_do_not_share_a_port():
    """gRPC's default SO_REUSEPORT would let a second server bind a held port."""
    async with cache_running(ServiceConfig(port=0, admin_token="t")) as held:
        server = grpc.aio.server(options=[EXCLUSIVE_PORT])
        with pytest.raises(RuntimeError, match="Failed to bind"):
            server.add_insecure_port(f"127.0.0.1:{held.port}")


async def test_a_worker_with_an_unsupported_model_type_names_it(tmp_path: Path):
    from kvserve_model.tiny_model import ensure_tiny_model
    from worker.server import running as worker_running

    model = tmp_path / "odd-model"
    shutil.copytree(ensure_tiny_model(), model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "model_type": "no_such_arch"}))
    with pytest.raises(ModelUnavailable, match="Model type no_such_arch not supported") as e:
        async with worker_running(WorkerConfig(model=str(model), port=0)):
            pass
    assert e.value.status == Failure.MODEL
    assert e.value.hint == "set --model or KVWORKER_MODEL"


@pytest.mark.e2e
def test_the_launcher_hints_at_its_own_model_flag(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("KVSERVE_FAST_BLAS", "0")  # no BLAS probing: the model check comes first
    config = LaunchConfig(
        model=str(tmp_path / "missing"),
        cache_port=0,
        http_port=0,
        grpc_port=0,
        startup_timeout_s=120,
    )
    with pytest.raises(ChildFailed) as e:
        launch(config, sink=lambda name, line: None)
    text = str(e.value)
    # The worker and the gateway start together and both need the model: either says so.
    child = e.value.name
    assert child in ("worker-0", "gateway"), text
    assert text.startswith(
        f"{child} failed before it was ready: exited with status 66 (model unavailable). "
    )
    service = "worker" if child == "worker-0" else "gateway"
    assert f"    {service}: cannot start: " in text
    assert f"model directory {tmp_path / 'missing'} does not exist" in text
    assert "  hint: --model or KVSERVE_MODEL takes SmolLM2-135M-Instruct" in text


@pytest.mark.e2e
def test_the_launcher_refuses_a_model_file_it_cannot_serve_in_one_line(tmp_path: Path):
    """A --model that is a file but no GGUF (or a truncated one): one line and status 1, where
    the launcher ended with a traceback (ModelLoadError from preparing the model)."""
    not_gguf = tmp_path / "model.bin"
    not_gguf.write_bytes(b"\0" * 64)
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\0" * 8)
    for path in (not_gguf, truncated):
        proc = run_module(
            "kvserve_launch", "--model", str(path), "--http-port", "0", "--grpc-port", "0",
            "--cache-port", "0", KVSERVE_FAST_BLAS="0",
        )  # fmt: skip
        assert proc.returncode == 1, proc.stderr
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("kvserve: cannot start: "), proc.stderr
        assert str(path) in lines[0] and "Traceback" not in proc.stderr


def test_models_go_to_a_temporary_directory_where_the_cache_cannot_be_written(
    tmp_path: Path, monkeypatch
):
    """A read-only home (a container's): the default model is converted into a per-user
    temporary directory, where the start died of a traceback (the cache could not be made)."""
    from kvserve_model.model_cache import MODEL_DIR_ENV, models_dir, user_cache_dir

    monkeypatch.delenv(MODEL_DIR_ENV, raising=False)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    fallback = tmp_path / "tmp" / f"kvserve-models-{os.getuid()}"
    monkeypatch.setenv("XDG_CACHE_HOME", "/dev/null")  # not a directory: no one can write it
    assert models_dir() == fallback and fallback.is_dir()
    assert user_cache_dir("blas") == tmp_path / "tmp" / f"kvserve-blas-{os.getuid()}"
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("XDG_CACHE_HOME", str(home / ".cache"))
    assert models_dir() == home / ".cache" / "kvserve" / "models"  # writable: the cache
    home.chmod(0o500)
    try:
        if os.access(home, os.W_OK):
            return  # root writes anywhere: a read-only mode is no read-only home for it
        assert models_dir() == fallback
    finally:
        home.chmod(0o700)


@pytest.mark.e2e
def test_a_worker_with_an_unwritable_offload_dir_says_so_before_loading(tmp_path: Path):
    """--offload-dir where nothing can be written (here below a file; a read-only mount is the
    same error): one line naming it, before the model loads, where the worker crashed with a
    traceback and SIGABRT after seconds of loading and its self-check."""
    in_the_way = tmp_path / "a-file"
    in_the_way.write_text("")
    proc = run_module(
        "worker", "--model", str(tmp_path / "no-model-needed"), "--port", "0",
        "--offload-dir", str(in_the_way / "tier"), "--log-level", "ERROR", KVSERVE_FAST_BLAS="0",
    )  # fmt: skip
    assert proc.returncode == Failure.OTHER, proc.stderr
    assert proc.stderr.splitlines() == [
        f"worker: cannot start: --offload-dir {in_the_way / 'tier'} cannot hold the disk tier: "
        "Not a directory (give a writable directory, or leave the disk tier off)"
    ]


@pytest.mark.e2e
def test_a_worker_refuses_an_offload_dir_another_worker_holds(tmp_path: Path):
    """Two systems given one --offload-dir each ran a worker-0 on the same directory, and one's
    flush deleted the other's blocks (an outside probe). The directory is locked: the second
    worker says so in one line, before loading its model."""
    tier = tmp_path / "tier"
    tier.mkdir()
    with open(tier / ".kvserve.lock", "a+") as held:  # as a running worker holds it
        fcntl.flock(held.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        proc = run_module(
            "worker", "--model", str(tmp_path / "no-model-needed"), "--port", "0",
            "--offload-dir", str(tier), "--log-level", "ERROR", KVSERVE_FAST_BLAS="0",
        )  # fmt: skip
    assert proc.returncode == Failure.OTHER, proc.stderr
    assert proc.stderr.splitlines() == [
        f"worker: cannot start: --offload-dir {tier} is in use by another worker (it holds "
        ".kvserve.lock there) (give each worker a directory of its own; two systems need two "
        "--offload-dir)"
    ]


@pytest.mark.e2e
def test_a_pool_larger_than_the_machine_is_refused_in_one_line():
    """--num-blocks past all of the device's memory: one line with both sizes, where the
    worker tried to make a 1.4 PB pool and died of SIGSEGV."""
    proc = run_module(
        "worker", "--model", TINY_MODEL_NAME, "--port", "0", "--num-blocks", "1000000000",
        "--log-level", "ERROR", KVSERVE_FAST_BLAS="0",
    )  # fmt: skip
    assert proc.returncode == Failure.OTHER, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("worker: cannot start: a KV pool of 1000000000 blocks")
    assert "GiB of memory (set a smaller --num-blocks or --kv-memory-mb" in lines[0]
