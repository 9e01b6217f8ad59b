"""The one-command launcher: its commands against the services' real parsers, the child
process handling, the health check, and `python -m kvserve_launch` run for real."""

from __future__ import annotations

import contextlib
import http.server
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.config import GatewayConfig
from kvcache_service.config import ServiceConfig
from kvserve_launch import healthcheck
from kvserve_launch.__main__ import banner
from kvserve_launch.config import LaunchConfig
from kvserve_launch.process import Child, ChildFailed
from kvserve_launch.system import (
    System,
    cache_command,
    gateway_command,
    secret_env,
    worker_command,
)
from worker.config import WorkerConfig

CFG = LaunchConfig(
    workers=3,
    http_port=9000,
    grpc_port=9001,
    cache_port=9002,
    worker_base_port=9100,
    admin_token="tok",
    num_blocks=128,
    block_size=16,
    host="0.0.0.0",
    model="kvserve-tiny-llama",
)


def test_commands_parse_with_the_services_own_flags(monkeypatch):
    for key, value in secret_env(CFG).items():
        monkeypatch.setenv(key, value)
    assert not any("tok" in arg for arg in cache_command(CFG) + gateway_command(CFG, "c:1"))
    cache = ServiceConfig.from_args(cache_command(CFG)[3:])
    assert (cache.host, cache.port, cache.admin_token) == ("127.0.0.1", 9002, "tok")

    argv = worker_command(CFG, 2, "127.0.0.1:9002")
    assert argv[1:3] == ["-m", "worker"]
    w = WorkerConfig.from_args(argv[3:])
    assert (w.cache_service, w.host, w.port, w.worker_id) == (
        "127.0.0.1:9002",
        "127.0.0.1",
        9102,
        "worker-2",
    )
    assert (w.model, w.num_blocks, w.block_size) == ("kvserve-tiny-llama", 128, 16)
    assert WorkerConfig.from_args(worker_command(LaunchConfig(), 0, "c:1")[3:]).port == 0

    g = GatewayConfig.from_args(gateway_command(CFG, "127.0.0.1:9002")[3:])
    assert (g.cache_service, g.host, g.http_port, g.grpc_port) == (
        "127.0.0.1:9002",
        "0.0.0.0",
        9000,
        9001,
    )
    assert (g.model, g.admin_token) == ("kvserve-tiny-llama", "tok")


def test_config_from_flags_and_environment(monkeypatch):
    monkeypatch.setenv("KVSERVE_WORKERS", "4")
    monkeypatch.setenv("KVSERVE_ADMIN_TOKEN", "from-env")
    cfg = LaunchConfig.from_args(["--http-port", "0"])
    assert (cfg.workers, cfg.admin_token, cfg.http_port) == (4, "from-env", 0)
    assert LaunchConfig.from_args(["--workers", "2"]).workers == 2
    with pytest.raises(SystemExit):
        LaunchConfig.from_args(["--workers", "0"])
    assert LaunchConfig().with_admin_token().admin_token  # generated when not given
    # Generated tokens never start with "-": `--token <it>` must not read as an option.
    tokens = [LaunchConfig().with_admin_token().admin_token for _ in range(300)]
    tokens += [LaunchConfig().with_service_token().service_token for _ in range(300)]
    assert not any(t.startswith("-") for t in tokens) and len(set(tokens)) == 600


def python_child(code: str, ready: str = "READY", **kw) -> Child:
    lines: list[str] = []
    child = Child(
        "test",
        [sys.executable, "-c", code],
        ready_prefix=ready,
        sink=lambda name, line: lines.append(line),
        **kw,
    )
    child.lines = lines  # type: ignore[attr-defined]
    return child


def test_child_ready_line_logs_and_stop():
    code = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(3))\n"
        "print('starting', flush=True)\n"
        "print('on stderr', file=sys.stderr, flush=True)\n"
        "print('READY 127.0.0.1:1234', flush=True)\n"
        "time.sleep(60)\n"
    )
    child = python_child(code).start()
    assert child.wait_ready(30) == "127.0.0.1:1234"
    assert child.running
    assert child.stop(grace_s=10) == 3  # SIGTERM reached its handler
    assert {"starting\n", "on stderr\n"} <= set(child.lines)  # type: ignore[attr-defined]


def test_child_that_exits_before_ready_reports_its_output():
    child = python_child("import sys; print('boom: bad flag', file=sys.stderr); sys.exit(2)")
    child.start()
    with pytest.raises(ChildFailed, match="exited with status 2") as e:
        child.wait_ready(30)
    assert "boom: bad flag" in str(e.value)


def test_child_that_ignores_sigterm_is_killed():
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('READY', flush=True); time.sleep(60)"
    child = python_child(code).start()
    child.wait_ready(30)
    assert child.stop(grace_s=0.5) == -signal.SIGKILL


def test_child_ready_timeout():
    child = python_child("import time; time.sleep(60)").start()
    try:
        with pytest.raises(ChildFailed, match="not ready"):
            child.wait_ready(0.5)
    finally:
        child.kill()


def test_banner_shows_where_to_send_requests():
    system = System(
        LaunchConfig(admin_token="tok"), None, [None], None,  # type: ignore[arg-type]
        "127.0.0.1:50051", ["127.0.0.1:4000"], "127.0.0.1:8000", "127.0.0.1:50050",
    )  # fmt: skip
    text = banner(system)
    assert "curl http://127.0.0.1:8000/v1/chat/completions" in text
    assert "1 worker serving SmolLM2-135M-Instruct" in text
    assert "--token=tok stats" in text and "127.0.0.1:50050" in text


@pytest.fixture
def http_server() -> Iterator[str]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/ok" else 503)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_healthcheck(http_server):
    assert healthcheck.main(["http", f"{http_server}/ok"]) == 0
    assert healthcheck.main(["http", f"{http_server}/bad"]) == 1
    assert healthcheck.main(["http", f"http://127.0.0.1:{free_port()}/"]) == 1
    assert healthcheck.main(["grpc", f"127.0.0.1:{free_port()}", "--timeout-s", "0.5"]) == 1


async def test_healthcheck_grpc_serving():
    from kvcache_service.server import running

    async with running(ServiceConfig(host="127.0.0.1", port=0, admin_token="t")) as svc:
        import asyncio

        assert await asyncio.to_thread(healthcheck.check_grpc, svc.address, 5.0) is None


@pytest.mark.e2e
@pytest.mark.timeout(400)
def test_make_run_starts_serves_and_stops_cleanly(tmp_path: Path):
    """`python -m kvserve_launch` (what `make run` runs) on the default model, converted from
    its GGUF on this first start: a real answer, then Ctrl-C."""
    argv = [
        sys.executable, "-m", "kvserve_launch", "--workers", "1", "--http-port", "0",
        "--grpc-port", "0", "--cache-port", "0", "--num-blocks", "64",
    ]  # fmt: skip
    log = (tmp_path / "launch.log").open("w")
    env = {**os.environ, "KVSERVE_MODEL_DIR": str(tmp_path / "models")}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()  # type: ignore[union-attr]
    out: list[str] = []
    try:
        deadline = time.monotonic() + 300
        while not (out and out[-1].startswith("KVSERVE_READY")):
            assert proc.poll() is None, (tmp_path / "launch.log").read_text()
            assert time.monotonic() < deadline, "no ready line"
            with contextlib.suppress(queue.Empty):
                out.append(lines.get(timeout=1))
        text = "".join(out)
        assert "curl http://" in text and "admin token:" in text
        ready = dict(part.split("=", 1) for part in out[-1].split()[1:])
        pids = [int(p) for p in ready["pids"].split(",")]
        assert len(pids) == 3  # gateway, one worker, cache service

        base = f"http://{ready['http']}"
        question = {"role": "user", "content": "What is the capital of France?"}
        resp = httpx.post(
            f"{base}/v1/chat/completions",
            json={"messages": [question], "max_tokens": 16, "temperature": 0},
            timeout=120,
        )
        assert resp.status_code == 200, resp.text
        answer = resp.json()["choices"][0]["message"]
        assert answer["role"] == "assistant" and "Paris" in answer["content"], answer
        assert resp.json()["model"] == "SmolLM2-135M-Instruct"

        proc.send_signal(signal.SIGINT)  # Ctrl-C
        assert proc.wait(timeout=60) == 0
        for pid in pids:  # every child is gone too
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{base}/health", timeout=5)
        logs = (tmp_path / "launch.log").read_text()
        assert "kvserve: stopped" in logs
    finally:
        if proc.poll() is None:
            proc.kill()
        for line in out:
            if line.startswith("KVSERVE_READY") and "pids=" in line:
                for pid in line.split("pids=")[1].split(","):
                    with contextlib.suppress(ProcessLookupError, ValueError):
                        os.kill(int(pid), signal.SIGKILL)


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_children_stop_when_the_launcher_is_killed(tmp_path: Path):
    """``kill -9`` of the launcher (or the OOM killer's): its children see it gone and stop,
    and their ports are free again. They kept serving, reparented, and the next launch found
    its ports taken."""
    argv = [
        sys.executable, "-m", "kvserve_launch", "--model", "kvserve-tiny-llama",
        "--http-port", "0", "--grpc-port", "0", "--cache-port", "0", "--num-blocks", "64",
    ]  # fmt: skip
    log = (tmp_path / "launch.log").open("w")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, text=True)
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 240
        for line in proc.stdout:  # type: ignore[union-attr]
            if line.startswith("KVSERVE_READY"):
                pids = [int(p) for p in line.split("pids=")[1].split(",")]
                break
            assert time.monotonic() < deadline, "no ready line"
        assert len(pids) == 3, (tmp_path / "launch.log").read_text()
        proc.kill()
        proc.wait(timeout=30)
        deadline = time.monotonic() + 60
        alive = list(pids)
        while alive and time.monotonic() < deadline:
            time.sleep(0.2)
            alive = [pid for pid in alive if _running(pid)]
        assert not alive, f"still running after the launcher's kill -9: {alive}"
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not: reaped by whoever adopted it, or not yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
