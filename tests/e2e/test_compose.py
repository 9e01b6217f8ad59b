"""compose.yaml and the Dockerfile, checked against the code's real flags.

No Docker engine here: the file is parsed, its ${VAR:-default} values resolved as compose
would, and every environment variable and command-line flag is fed to the real config
parser of the service it belongs to, which must take it and end up with that value (an
unknown KVWORKER_* variable would otherwise be silently ignored). Ports, addresses and
health checks must agree with each other. Where a docker binary exists, ``docker compose
config`` gets the last word.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.config import GatewayConfig
from kvcache_service.config import ServiceConfig
from worker.config import WorkerConfig

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose.yaml"
DOCKERFILE = ROOT / "Dockerfile"

# service name -> (module its command runs, env prefix, the config parser of that module)
SERVICES: dict[str, tuple[str, str, Callable[[list[str]], Any]]] = {
    "kvcache": ("kvcache_service", "KVCACHE_", ServiceConfig.from_args),
    "worker": ("worker", "KVWORKER_", WorkerConfig.from_args),
    "gateway": ("gateway", "KVGATEWAY_", GatewayConfig.from_args),
}
# Flags whose config field has another name.
FIELD_OF = {"KVWORKER_PREFIX_CACHING": "prefix_caching"}
INTERPOLATION = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def interpolate(value: object) -> object:
    """Resolve ${VAR:-default} with every VAR unset, and $$ to $, as compose does."""
    if isinstance(value, str):
        return INTERPOLATION.sub(lambda m: m.group(2) or "", value).replace("$$", "$")
    if isinstance(value, list):
        return [interpolate(v) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v) for k, v in value.items()}
    return value


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    raw = yaml.safe_load(COMPOSE.read_text())
    return interpolate(raw)  # type: ignore[return-value]


def argv_of(service: dict[str, Any], module: str) -> list[str]:
    """The arguments after `python -m <module>` in a service's command (exec form or sh -c);
    a shell command substitution stands in as a placeholder value."""
    command = service["command"]
    if command[:2] == ["sh", "-c"]:
        text = re.sub(r"\$\((?:[^()]|\([^()]*\))*\)", "SUBST", command[2])
        command = shlex.split(text)
        command = command[command.index("python") :]
    assert command[:3] == ["python", "-m", module], command
    return command[3:]


def env_of(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    assert isinstance(env, dict), "use the mapping form of environment"
    return {k: str(v) for k, v in env.items()}


def test_services(compose):
    assert set(compose["services"]) == set(SERVICES)


@pytest.mark.parametrize("name", list(SERVICES))
def test_commands_and_environment_match_the_real_flags(compose, name, monkeypatch):
    module, prefix, parse = SERVICES[name]
    service = compose["services"][name]
    argv = argv_of(service, module)
    env = env_of(service)
    for key in env:
        assert key.startswith(prefix), f"{name}: {key} is not read by {module}"
    for key in list(__import__("os").environ):
        if key.startswith(prefix):
            monkeypatch.delenv(key)
    default = parse([])
    for key, value in env.items():  # each variable alone must land in its field
        monkeypatch.setenv(key, value)
        config = parse([])
        field = FIELD_OF.get(key, key[len(prefix) :].lower())
        assert field in {f.name for f in fields(config)}, f"{name}: no flag for {key}"
        got = getattr(config, field)
        assert str(got) == value or got == type(getattr(default, field))(value), (key, got)
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    parse(argv)  # the command's own flags parse (argparse exits on an unknown one)


def test_ports_addresses_and_health_checks_agree(compose):
    s = compose["services"]
    cache_env, worker_env, gw_env = (env_of(s[n]) for n in ("kvcache", "worker", "gateway"))
    cache_port = cache_env["KVCACHE_PORT"]
    assert worker_env["KVWORKER_CACHE_SERVICE"] == f"kvcache:{cache_port}"
    assert gw_env["KVGATEWAY_CACHE_SERVICE"] == f"kvcache:{cache_port}"
    for env, key in ((cache_env, "KVCACHE_HOST"), (worker_env, "KVWORKER_HOST")):
        assert env[key] == "0.0.0.0"  # reachable from the other containers
    assert gw_env["KVGATEWAY_HOST"] == "0.0.0.0"

    def container_ports(service: dict[str, Any]) -> set[str]:
        return {str(p).rsplit(":", 1)[-1] for p in service.get("ports", [])}

    assert container_ports(s["kvcache"]) == {cache_port}
    assert container_ports(s["gateway"]) == {
        gw_env["KVGATEWAY_HTTP_PORT"],
        gw_env["KVGATEWAY_GRPC_PORT"],
    }
    # Workers publish nothing (replicas would collide) and advertise their own port.
    assert "ports" not in s["worker"]
    advertise = argv_of(s["worker"], "worker")
    assert advertise[advertise.index("--advertise-address") + 1].endswith(
        ":" + worker_env["KVWORKER_PORT"]
    )

    checks = {n: s[n]["healthcheck"]["test"] for n in SERVICES}
    assert checks["kvcache"][-2:] == ["grpc", f"localhost:{cache_port}"]
    assert checks["worker"][-2:] == ["grpc", f"localhost:{worker_env['KVWORKER_PORT']}"]
    assert checks["gateway"][-2:] == [
        "http",
        f"http://localhost:{gw_env['KVGATEWAY_HTTP_PORT']}/health",
    ]
    for test in checks.values():
        assert test[:4] == ["CMD", "python", "-m", "kvserve_launch.healthcheck"]
    assert importlib.util.find_spec("kvserve_launch.healthcheck") is not None


def test_one_configuration_for_the_whole_system(compose):
    s = compose["services"]
    worker_env, gw_env = env_of(s["worker"]), env_of(s["gateway"])
    assert worker_env["KVWORKER_MODEL"] == gw_env["KVGATEWAY_MODEL"] == "SmolLM2-135M-Instruct"
    assert env_of(s["kvcache"])["KVCACHE_ADMIN_TOKEN"] == gw_env["KVGATEWAY_ADMIN_TOKEN"]
    # One data-plane token, shared by the cache service and every client of it.
    service_token = env_of(s["kvcache"])["KVCACHE_SERVICE_TOKEN"]
    assert service_token == worker_env["KVWORKER_CACHE_TOKEN"] == gw_env["KVGATEWAY_CACHE_TOKEN"]
    raw = yaml.safe_load(COMPOSE.read_text())["services"]
    # One setting each, so `KVSERVE_MODEL=... docker compose up` changes every service.
    assert (
        raw["worker"]["environment"]["KVWORKER_MODEL"]
        == raw["gateway"]["environment"]["KVGATEWAY_MODEL"]
    )
    assert "KVSERVE_ADMIN_TOKEN" in raw["kvcache"]["environment"]["KVCACHE_ADMIN_TOKEN"]
    # The number of workers is a scale setting.
    assert raw["worker"]["deploy"]["replicas"] == "${KVSERVE_WORKERS:-2}"
    assert compose["services"]["worker"]["deploy"]["replicas"] == "2"
    for name in ("worker", "gateway"):
        assert s[name]["depends_on"]["kvcache"]["condition"] == "service_healthy"


def test_the_tls_comment_names_real_variables(monkeypatch):
    """compose.yaml turns TLS on only in a comment: each variable it names must still be one
    its service reads."""
    comment = "\n".join(line for line in COMPOSE.read_text().splitlines() if line.startswith("#"))
    names = set(re.findall(r"\b(KV(?:CACHE|WORKER|GATEWAY)_TLS_\w+)", comment))
    assert len(names) >= 10
    for name in names:
        module, prefix, parse = next(v for v in SERVICES.values() if name.startswith(v[1]))
        for key in (prefix + "TLS_CERT", prefix + "TLS_KEY", name):  # a pair, or refused
            monkeypatch.setenv(key, "x")
        assert getattr(parse([]), name[len(prefix) :].lower()) == "x", (module, name)
        for key in (name, prefix + "TLS_CERT", prefix + "TLS_KEY"):
            monkeypatch.delenv(key, raising=False)


def test_dockerfile():
    text = DOCKERFILE.read_text()
    assert re.search(r"^FROM python:3\.11-slim$", text, re.M)
    assert "pip install" in text
    exposed = set(re.search(r"^EXPOSE (.+)$", text, re.M).group(1).split())  # type: ignore[union-attr]
    assert {"50051", "50061", "8000", "50050"} <= exposed
    cmd = re.search(r"^CMD (\[.+\])$", text, re.M)
    assert cmd is not None
    assert yaml.safe_load(cmd.group(1))[:3] == ["python", "-m", "kvserve_launch"]
    ignore = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignore and ".git" in ignore


def has_docker_compose() -> bool:
    if shutil.which("docker") is None:
        return False
    probe = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30)
    return probe.returncode == 0


@pytest.mark.skipif(not has_docker_compose(), reason="no `docker compose` on this machine")
def test_docker_compose_config_accepts_the_file():
    out = subprocess.run(
        ["docker", "compose", "-f", str(COMPOSE), "config", "--quiet"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
