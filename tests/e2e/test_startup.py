"""Starting up, as real processes: the gateway serves before any worker is ready (503 with
Retry-After, /health "starting"), and answers within a second of the first worker's ready line;
``kvserve`` on PATH."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from kvserve_launch.process import Child, KeptLines
from kvserve_model.default_model import DEFAULT_MODEL_NAME
from kvserve_model.tiny_model import TINY_MODEL_NAME, ensure_tiny_model

pytestmark = pytest.mark.e2e


def _child(name: str, argv: list[str], ready: str, logs: KeptLines) -> Child:
    return Child(name, [sys.executable, "-m", *argv], ready_prefix=ready, sink=logs).start()


@pytest.mark.timeout(300)
def test_the_gateway_answers_503_until_a_worker_is_ready_then_serves():
    logs = KeptLines()
    ensure_tiny_model()
    started: list[Child] = []
    try:
        cache = _child("cache", ["kvcache_service", "--port", "0"], "KVCACHE_READY", logs)
        started.append(cache)
        address = cache.wait_ready(60)
        gateway = _child(
            "gateway",
            ["gateway", "--cache-service", address, "--http-port", "0", "--grpc-port", "0",
             "--model", TINY_MODEL_NAME],
            "GATEWAY_READY",
            logs,
        )  # fmt: skip
        started.append(gateway)
        http = dict(p.split("=", 1) for p in gateway.wait_ready(60).split())["http"]
        base = f"http://{http}"
        chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}

        health = httpx.get(f"{base}/health", timeout=10)
        assert health.status_code == 503, health.text
        assert health.json()["status"] == "starting" and health.headers["retry-after"] == "2"
        early = httpx.post(f"{base}/v1/chat/completions", json=chat, timeout=10)
        assert early.status_code == 503 and early.headers["retry-after"] == "2"
        assert early.json()["error"]["type"] == "service_unavailable"

        worker = _child(
            "worker",
            ["worker", "--cache-service", address, "--port", "0", "--model", TINY_MODEL_NAME,
             "--num-blocks", "64"],
            "WORKER_READY",
            logs,
        )  # fmt: skip
        started.append(worker)
        worker.wait_ready(240)
        # The gateway polls every 0.25 s while it knows no worker: found within seconds.
        deadline = time.monotonic() + 10
        while (health := httpx.get(f"{base}/health", timeout=10)).status_code != 200:
            assert time.monotonic() < deadline, (health.text, logs.dump())
            time.sleep(0.1)
        assert health.json()["status"] == "ok"
        resp = httpx.post(f"{base}/v1/chat/completions", json=chat, timeout=60)
        assert resp.status_code == 200, resp.text
    finally:
        for child in reversed(started):
            child.stop(10)


def _kvserve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).parent / "kvserve"
    if not script.exists():
        pytest.skip("the kvserve script is not installed next to this interpreter")
    return subprocess.run(
        [str(script), *args], capture_output=True, text=True, timeout=120, env=env
    )


def test_kvserve_on_path_serves_converts_and_administers(tmp_path):
    usage = _kvserve("--help")
    assert usage.returncode == 0 and "kvserve serve [MODEL]" in usage.stdout
    serve = _kvserve("serve", "--help")
    assert serve.returncode == 0
    for flag in ("--workers", "--model", "--http-port", "--cache-shards", "--tls-cert"):
        assert flag in serve.stdout, flag
    assert "admin" in _kvserve("admin", "--help").stdout
    env = {**os.environ, "KVSERVE_MODEL_DIR": str(tmp_path)}
    converted = _kvserve("convert", DEFAULT_MODEL_NAME, env=env)
    assert converted.returncode == 0, converted.stderr
    directory = Path(converted.stdout.strip())
    assert directory.parent == tmp_path and (directory / "config.json").exists()
    missing = _kvserve("convert", str(tmp_path / "nothing.gguf"))
    assert missing.returncode == 1 and "does not exist" in missing.stderr
    assert _kvserve("bogus").returncode == 2
