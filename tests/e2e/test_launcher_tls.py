"""The launcher's TLS settings: checked by its parser, handed to every child as flags their own
parsers take, and `python -m kvserve_launch` run for real over mutual TLS."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from gateway.config import GatewayConfig
from kvcache_service import admin_cli
from kvcache_service.config import ServiceConfig
from kvserve_launch.__main__ import banner
from kvserve_launch.config import LaunchConfig
from kvserve_launch.system import System, cache_command, gateway_command, worker_command
from tests.tls_certs import make_certs, needs_openssl
from worker.config import WorkerConfig

TLS = {"tls_cert": "s.pem", "tls_key": "s.key", "tls_ca": "ca.pem"}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tls-cert", "s.pem"], "--tls-cert and --tls-key go together"),
        (["--tls-key", "s.key"], "--tls-cert and --tls-key go together"),
        (["--tls-cert", "s.pem", "--tls-key", "s.key"], "--tls-cert needs --tls-ca"),
        (["--tls-ca", "ca.pem"], "need --tls-cert and --tls-key"),
        (["--tls-server-name", "kvserve"], "need --tls-cert and --tls-key"),
        (["--tls-client-ca", "ca.pem"], "--tls-client-ca verifies"),
    ],
)
def test_incomplete_tls_settings_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as exit:
        LaunchConfig.from_args(argv)
    assert exit.value.code == 2
    assert message in capsys.readouterr().err


def test_tls_settings_from_the_environment(monkeypatch):
    for name, value in {**TLS, "tls_client_ca": "clients.pem"}.items():
        monkeypatch.setenv(f"KVSERVE_{name.upper()}", value)
    cfg = LaunchConfig.from_args([])
    assert (cfg.tls_cert, cfg.tls_key, cfg.tls_ca, cfg.tls_client_ca) == (
        "s.pem",
        "s.key",
        "ca.pem",
        "clients.pem",
    )
    assert cfg.tls and not LaunchConfig().tls


def test_every_child_gets_the_tls_flags_its_own_parser_takes(monkeypatch):
    for key in list(os.environ):
        if "_TLS_" in key:
            monkeypatch.delenv(key)
    cfg = LaunchConfig(**TLS, tls_server_name="kvserve", tls_client_ca="clients.pem")
    cache = ServiceConfig.from_args(cache_command(cfg)[3:])
    assert (cache.tls_cert, cache.tls_key, cache.tls_client_ca) == ("s.pem", "s.key", "clients.pem")
    w = WorkerConfig.from_args(worker_command(cfg, 0, "127.0.0.1:1")[3:])
    assert (w.tls_cert, w.tls_key, w.tls_ca, w.tls_server_name, w.tls_client_ca) == (
        "s.pem",
        "s.key",
        "ca.pem",
        "kvserve",
        "clients.pem",
    )
    g = GatewayConfig.from_args(gateway_command(cfg, "127.0.0.1:1")[3:])
    assert (g.tls_cert, g.tls_key, g.tls_ca, g.tls_server_name) == (
        "s.pem",
        "s.key",
        "ca.pem",
        "kvserve",
    )
    assert g.tls_client_ca == ""  # the public edge asks no client certificate unless told
    plain = LaunchConfig()
    for argv in (
        cache_command(plain),
        worker_command(plain, 0, "c:1"),
        gateway_command(plain, "c:1"),
    ):
        assert not any(arg.startswith("--tls") for arg in argv)


def test_banner_over_tls():
    cfg = LaunchConfig(admin_token="tok", **TLS, tls_client_ca="ca.pem")
    system = System(
        cfg, None, [None], None,  # type: ignore[arg-type]
        "127.0.0.1:50051", ["127.0.0.1:4000"], "127.0.0.1:8000", "127.0.0.1:50050",
    )  # fmt: skip
    text = banner(system)
    assert "curl --cacert ca.pem https://127.0.0.1:8000/v1/chat/completions" in text
    assert "--tls-ca ca.pem --tls-cert s.pem --tls-key s.key stats" in text


@needs_openssl
@pytest.mark.e2e
@pytest.mark.timeout(400)
def test_make_run_over_mutual_tls(tmp_path: Path, capsys):
    """`make run` with KVSERVE_TLS_* set: every internal channel over mutual TLS, the gateway
    over HTTPS; a completion and an admin CLI call go through, plaintext does not."""
    certs = make_certs(tmp_path)
    env = {
        **os.environ,
        "KVSERVE_TLS_CERT": certs.cert,
        "KVSERVE_TLS_KEY": certs.key,
        "KVSERVE_TLS_CA": certs.ca,
        "KVSERVE_TLS_CLIENT_CA": certs.ca,
        "KVSERVE_ADMIN_TOKEN": "tls-admin",
    }
    argv = [
        sys.executable, "-m", "kvserve_launch", "--workers", "1", "--http-port", "0",
        "--grpc-port", "0", "--cache-port", "0", "--num-blocks", "64",
    ]  # fmt: skip
    log = tmp_path / "launch.log"
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log.open("w"), text=True, env=env)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()  # type: ignore[union-attr]
    pids: list[int] = []
    try:
        ready, deadline = "", time.monotonic() + 300
        while not ready.startswith("KVSERVE_READY"):
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "no ready line"
            with contextlib.suppress(queue.Empty):
                ready = lines.get(timeout=1)
        fields = dict(part.split("=", 1) for part in ready.split()[1:])
        pids = [int(p) for p in fields["pids"].split(",")]

        trusted = ssl.create_default_context(cafile=certs.ca)
        resp = httpx.post(
            f"https://{fields['http']}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 4},
            verify=trusted,
            timeout=120,
        )
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] > 0
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://{fields['http']}/health", timeout=5)

        base = ["--address", fields["cache"], "--token", "tls-admin", "--tls-ca", certs.ca]
        identity = ["--tls-cert", certs.client_cert, "--tls-key", certs.client_key]
        assert admin_cli.main([*base, *identity, "stats"]) == 0
        assert "worker-0" in capsys.readouterr().out
        assert admin_cli.main([*base, "stats"]) == 1  # no client certificate: refused

        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
