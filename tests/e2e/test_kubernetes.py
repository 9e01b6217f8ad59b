"""deploy/kubernetes checked offline, as tests/e2e/test_compose.py checks compose.yaml.

No cluster here. Each kustomization (the base, the TLS overlay) is rendered as ``kubectl
kustomize`` renders it (and compared with it where kubectl exists), then:

- every object validates against the Kubernetes OpenAPI schemas of the oldest version the
  manifests promise and a recent one (``kubernetes-validate``, bundled schemas, strict: an
  unknown field is an error);
- every container's environment is resolved as the kubelet resolves it (envFrom, then env in
  order with ``$(VAR)`` expanded, ConfigMap keys and the downward API looked up, Secrets given
  stand-in values) and fed to the real config parser of its service, which must take each
  variable into the field it names; exec probes go to the real health check's parser;
- the objects agree with each other: Services select the pods and name their ports, the
  gateway and the workers point at the cache service's Service, each worker advertises its own
  name under the headless Service, probes ask the ports the services serve health on, every
  ConfigMap, Secret and key referenced exists (Secrets: as docs/deploy.md's commands make
  them), and TLS files are keys of the Secret mounted where they point;
- the cache service, started with its pod's environment, answers its own probes (the base's
  plaintext gRPC health check, the TLS overlay's exec probe with mutual TLS).

Each check returns the problems it finds, so that the mutations at the end show each kind of
mistake caught.
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager, redirect_stderr
from dataclasses import fields
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvcache_service.config import ServiceConfig
from kvcache_service.server import running
from kvserve_launch import healthcheck
from kvserve_launch.tls import Dialer
from tests.e2e.k8s_render import EXPANSION, Object, Pod, expand, find, get, pod_name, pod_of, render
from tests.e2e.test_compose import COMPOSE, FIELD_OF, SERVICES
from tests.tls_certs import _make_ca, _make_leaf

ROOT = Path(__file__).resolve().parents[2]
KUBE = ROOT / "deploy" / "kubernetes"
OVERLAYS = ("base", "tls", "tensor-parallel", "multi-host")
DEPLOY_DOC = ROOT / "docs" / "deploy.md"
# The oldest version the manifests promise (Kubernetes' own gRPC probes are GA from 1.27)
# and a recent one.
KUBERNETES_VERSIONS = ("1.27", "1.33")
# The workload of each service (SERVICES' keys), and the variable of the port where it
# serves grpc.health.v1.
WORKLOADS = {"kvcache": "Deployment", "worker": "StatefulSet", "gateway": "Deployment"}
HEALTH_PORT = {
    "kvcache": "KVCACHE_PORT",
    "worker": "KVWORKER_PORT",
    "gateway": "KVGATEWAY_GRPC_PORT",
}
# Variables a service reads besides its prefix's (docs/configuration.md, the worker's BLAS).
ALSO_READS = {"worker": ("KVSERVE_FAST_BLAS", "KVSERVE_BLAS_", "KVSERVE_MODEL_DIR", "MLX_")}
# Every --tls-server-name in the overlay: the name the shared certificate must carry.
TLS_NAME = "kvserve"


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request: pytest.FixtureRequest) -> list[Object]:
    """The rendered objects of one kustomization."""
    return render(KUBE / request.param)


def pods_of(objects: list[Object]) -> dict[str, Pod]:
    return {service: pod_of(objects, kind, service) for service, kind in WORKLOADS.items()}


# ---- what docs/deploy.md says to create by hand ----


def documented_secrets() -> dict[str, set[str]]:
    """Secret name -> its keys, from the `kubectl create secret generic` commands of the
    deploy docs and the kustomizations' comments (which must agree where both give one)."""
    secrets: dict[str, set[str]] = {}
    for path in (
        DEPLOY_DOC,
        KUBE / "base" / "kustomization.yaml",
        KUBE / "tls" / "kustomization.yaml",
    ):
        text = re.sub(r"\\\n[#\s]*", " ", path.read_text())  # join continued lines
        for name, flags in re.findall(r"create secret generic (\S+)(.*)", text):
            keys = set(re.findall(r"--from-(?:literal|file)=([\w.-]+)=", flags))
            assert secrets.setdefault(name, keys) == keys, f"{path}: {name} made with other keys"
    return secrets


def documented_files() -> dict[str, dict[str, str]]:
    """Secret name -> {key: the file it is made from}, for --from-file secrets."""
    text = re.sub(r"\\\n\s*", " ", DEPLOY_DOC.read_text())
    made: dict[str, dict[str, str]] = {}
    for name, flags in re.findall(r"create secret generic (\S+)(.*)", text):
        if files := dict(re.findall(r"--from-file=([\w.-]+)=(\S+)", flags)):
            made[name] = files
    return made


# ---- the checks; each returns what is wrong ----


def schema_problems(objects: list[Object], version: str) -> list[str]:
    problems = []
    for o in objects:
        try:
            kubernetes_validate.validate(o, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            where = ".".join(str(p) for p in e.path)
            problems.append(f"{o['kind']}/{o['metadata']['name']}: {where}: {e.message}")
        except kubernetes_validate.SchemaNotFoundError as e:
            problems.append(e.message)
    return problems


@contextmanager
def environment(prefix: str, values: dict[str, str]) -> Iterator[None]:
    """os.environ with no variable of ``prefix`` but ``values``; restored afterwards."""
    saved = {k: v for k, v in os.environ.items() if k.startswith(prefix)}
    for key in saved:
        del os.environ[key]
    os.environ.update(values)
    try:
        yield
    finally:
        for key in [k for k in os.environ if k.startswith(prefix)]:
            del os.environ[key]
        os.environ.update(saved)


def parse_or_why(parse: Callable[[list[str]], Any], argv: list[str]) -> tuple[Any, str]:
    """(the config, ""), or (None, why argparse refused it)."""
    stderr = io.StringIO()
    try:
        with redirect_stderr(stderr):
            return parse(argv), ""
    except SystemExit as e:
        return None, f"exit {e.code}: {stderr.getvalue().strip().splitlines()[-1:]}"


def same_value(got: object, default: Any, value: str) -> bool:
    try:
        return str(got) == value or got == type(default)(value)  # 30.0 == float("30")
    except (TypeError, ValueError):
        return False


def flag_problems(pod: Pod) -> list[str]:
    """The pod's variables and arguments, fed to its service's real parser."""
    module, prefix, parse = SERVICES[pod.name]
    problems = list(pod.problems)
    command = pod.container.get("command", [])
    if command[:3] != ["python", "-m", module]:
        return [*problems, f"{pod.name}: {command} is not python -m {module}"]
    argv = [expand(a, pod.env) for a in command[3:] + pod.container.get("args", [])]
    ours = {k: v for k, v in pod.env.items() if k.startswith(prefix)}
    expanded = set(EXPANSION.findall(str(pod.container)))
    for key in pod.env.keys() - ours.keys() - expanded:  # a helper must be used
        if not key.startswith(ALSO_READS.get(pod.name, ())):
            problems.append(f"{pod.name}: {key} is neither read by {module} nor expanded")
    with environment(prefix, {}):
        default = parse([])
    with environment(prefix, ours):
        config, why = parse_or_why(parse, [])
        _, why_argv = parse_or_why(parse, argv)
    if why or why_argv:
        return [
            *problems,
            f"{pod.name}: its variables, with arguments {argv}: {why or why_argv}",
        ]
    names = {f.name for f in fields(default)}
    for key, value in ours.items():  # each variable must land in the field it names
        name = FIELD_OF.get(key, key[len(prefix) :].lower())
        got = getattr(config, name, None)
        if name not in names:
            problems.append(f"{pod.name}: no flag of {module} reads {key}")
        elif not same_value(got, getattr(default, name), value):
            problems.append(f"{pod.name}: {key}={value!r} gave {name}={got!r}")
    return problems


def selects(service: Object, workload: Object) -> bool:
    labels = workload["spec"]["template"]["metadata"].get("labels", {})
    selector = service["spec"].get("selector", {})
    return bool(selector) and selector.items() <= labels.items()


def addresses(objects: list[Object], pod: Pod) -> dict[str, int]:
    """Each "<Service>:<port>" that reaches ``pod`` -> the container port it reaches (-1: none)."""
    ports = {p["name"]: p["containerPort"] for p in pod.container.get("ports", [])}
    found = {}
    for s in objects:
        if s["kind"] == "Service" and selects(s, pod.workload):
            for p in s["spec"]["ports"]:
                target = p.get("targetPort", p["port"])
                port = ports.get(target, target if target in ports.values() else -1)
                found[f"{s['metadata']['name']}:{p['port']}"] = port
    return found


def wiring_problems(objects: list[Object]) -> list[str]:
    """The objects agree with each other and with the services' own settings."""
    pods = pods_of(objects)
    cache, worker, gateway = pods["kvcache"], pods["worker"], pods["gateway"]
    problems = [p for pod in pods.values() for p in pod.problems]

    def expect(ok: bool, problem: str) -> None:
        if not ok:
            problems.append(problem)

    # One authority, never two at once (docs/deploy.md says why).
    spec = cache.workload["spec"]
    expect(spec.get("replicas", 1) == 1, "kvcache: more than one replica")
    expect(spec.get("strategy", {}).get("type") == "Recreate", "kvcache: rolls with two pods")

    image = yaml.safe_load(COMPOSE.read_text())["x-image"]["image"]
    for name, pod in pods.items():
        labels = pod.workload["spec"]["template"]["metadata"].get("labels", {})
        matched = pod.workload["spec"]["selector"]["matchLabels"].items() <= labels.items()
        expect(matched, f"{name}: its selector does not match its pods")
        expect(pod.container["image"] == image, f"{name}: image is not compose's {image}")
        host = pod.env.get(SERVICES[name][1] + "HOST")
        expect(host == "0.0.0.0", f"{name}: listens on {host}, not reachable from other pods")
        for address, port in addresses(objects, pod).items():
            expect(address.endswith(f":{port}"), f"{address} reaches {name}'s port {port}")

    # Where each service listens, and who dials it there.
    cache_port = int(cache.env.get("KVCACHE_PORT", "-1"))
    at_cache = {a for a, port in addresses(objects, cache).items() if port == cache_port}
    for pod, key in ((worker, "KVWORKER_CACHE_SERVICE"), (gateway, "KVGATEWAY_CACHE_SERVICE")):
        dialed = set(pod.env.get(key, "").split(","))
        expect(dialed <= at_cache, f"{pod.name}: {key} is {dialed}, not one of {at_cache}")
    for pod, key, port_name in (
        (cache, "KVCACHE_PORT", "grpc"),
        (worker, "KVWORKER_PORT", "grpc"),
        (gateway, "KVGATEWAY_HTTP_PORT", "http"),
        (gateway, "KVGATEWAY_GRPC_PORT", "grpc"),
    ):
        ports = {p["name"]: str(p["containerPort"]) for p in pod.container["ports"]}
        expect(
            ports.get(port_name) == pod.env.get(key),
            f"{pod.name}: {key} is not port {port_name}",
        )

    # A worker registers its pod's name under the headless Service, and is dialed there.
    headless = find(objects, "Service", worker.workload["spec"]["serviceName"]) or {"spec": {}}
    expect(headless["spec"].get("clusterIP") == "None", "worker: no headless Service")
    expect(headless["spec"].get("publishNotReadyAddresses") is True, "worker: named once ready")
    expect(
        worker.source.get("KVWORKER_WORKER_ID") == ("field", "metadata.name"),
        "worker: its pool id is not its pod's name",
    )
    namespace = worker.workload["metadata"].get("namespace", "default")
    own = f"{pod_name(worker.workload)}.{worker.workload['spec']['serviceName']}.{namespace}.svc"
    own += ":" + worker.env.get("KVWORKER_PORT", "")
    advertised = worker.env.get("KVWORKER_ADVERTISE_ADDRESS")
    expect(advertised == own, f"worker: advertises {advertised}, its name is {own}")

    # One model and two tokens, each set in one place.
    for keys in (
        ("KVWORKER_MODEL", "KVGATEWAY_MODEL"),
        ("KVCACHE_SERVICE_TOKEN", "KVWORKER_CACHE_TOKEN", "KVGATEWAY_CACHE_TOKEN"),
        ("KVCACHE_ADMIN_TOKEN", "KVGATEWAY_ADMIN_TOKEN"),
    ):
        sources = {
            p.source.get(k)
            for k in keys
            for p in pods.values()
            if k.startswith(SERVICES[p.name][1])
        }
        expect(len(sources) == 1 and None not in sources, f"{keys} come from {sources}")

    # Tokens only from Secrets, and only the Secrets and keys the docs make.
    secrets = documented_secrets()
    for pod in pods.values():
        for key, source in pod.source.items():
            if key.endswith(("_TOKEN", "_API_KEY")):
                expect(source[0] == "secret", f"{pod.name}: {key} is not from a Secret")
            if source[0] == "secret" and "optional" not in source:
                expect(
                    source[2] in secrets.get(source[1], ()),
                    f"{pod.name}: {key}: the docs make no key {source[2]} in {source[1]}",
                )
        for volume in pod.workload["spec"]["template"]["spec"].get("volumes", []):
            if secret := volume.get("secret", {}).get("secretName"):
                expect(secret in secrets, f"{pod.name}: the docs make no Secret {secret}")
    return problems


def tls_problems(objects: list[Object]) -> list[str]:
    """TLS one way or the other on every channel: a TLS port is dialed with a CA, a port that
    requires client certificates is dialed with one, and every PEM file is a key of the Secret
    mounted where its path points."""
    pods = pods_of(objects)
    on = {name: bool(pod.env.get(SERVICES[name][1] + "TLS_CERT")) for name, pod in pods.items()}
    mtls = {n: bool(p.env.get(SERVICES[n][1] + "TLS_CLIENT_CA")) for n, p in pods.items()}
    problems = []
    for client, server in (("worker", "kvcache"), ("gateway", "kvcache"), ("gateway", "worker")):
        env = pods[client].env
        prefix = SERVICES[client][1]
        if on[server] != bool(env.get(prefix + "TLS_CA")):
            problems.append(f"{client} dials {server} {'without' if on[server] else 'with'} TLS")
        if mtls[server] and not on[client]:
            problems.append(f"{server} requires client certificates; {client} has none")
        if on[server] and env.get(prefix + "TLS_SERVER_NAME") != TLS_NAME:
            problems.append(f"{client}: the server name is not {TLS_NAME!r}")
    secrets = documented_secrets()
    for pod in pods.values():
        spec = pod.workload["spec"]["template"]["spec"]
        mounts = {
            m["mountPath"]: secrets.get(v["secret"]["secretName"], set())
            for m in pod.container.get("volumeMounts", [])
            for v in spec.get("volumes", [])
            if v["name"] == m["name"] and "secret" in v
        }
        for key, value in pod.env.items():
            if not key.endswith(("_TLS_CERT", "_TLS_KEY", "_TLS_CA", "_TLS_CLIENT_CA")):
                continue
            mount, _, file = value.rpartition("/")
            if file not in mounts.get(mount, ()):
                problems.append(f"{pod.name}: {key}={value}: no Secret key mounted there")
    return problems


def probe_problems(pod: Pod, files: dict[str, Path]) -> list[str]:
    """Every probe asks for the health of the port its service serves it on; exec probes
    parse with the real health check. ``files``: a mount path -> a directory holding the
    mounted Secret's keys (the probes read the PEM files they name)."""
    c = pod.container
    health = int(pod.env.get(HEALTH_PORT[pod.name], "-1"))
    ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
    prefix = SERVICES[pod.name][1]
    problems = []
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe, where = c.get(kind), f"{pod.name} {kind}"
        if probe is None:
            if kind != "startupProbe":
                problems.append(f"{where}: missing")
        elif "grpc" in probe:
            port = probe["grpc"]["port"]
            if port != health or port not in ports.values() or pod.env.get(prefix + "TLS_CERT"):
                problems.append(f"{where}: a plaintext gRPC probe on {port}, health is on {health}")
        elif "httpGet" in probe:
            get = probe["httpGet"]
            http = int(pod.env.get("KVGATEWAY_HTTP_PORT", "-1"))
            scheme = "HTTPS" if pod.env.get("KVGATEWAY_TLS_CERT") else "HTTP"
            if (get["path"], ports.get(get["port"], get["port"]), get.get("scheme", "HTTP")) != (
                "/health",
                http,
                scheme,
            ):
                problems.append(f"{where}: {get} is not {scheme} /health on {http}")
        elif "exec" in probe:
            problems += exec_probe_problems(pod, where, probe["exec"]["command"], health, files)
        else:
            problems.append(f"{where}: neither grpc, httpGet nor exec")
    return problems


def remap(args: list[str], files: dict[str, Path]) -> list[str]:
    """Paths under a mount, pointed at the stand-in directory of that mount."""
    out = []
    for a in args:
        for mount, directory in files.items():
            if a.startswith(mount + "/"):
                a = str(directory / a[len(mount) + 1 :])
        out.append(a)
    return out


def exec_probe_problems(
    pod: Pod, where: str, command: list[str], health: int, files: dict[str, Path]
) -> list[str]:
    """The image's health check, over TLS exactly when the port is, with a client certificate
    when the port requires one. Parsed and its PEM files read; nothing dialed."""
    if command[:4] != ["python", "-m", "kvserve_launch.healthcheck", "grpc"]:
        return [f"{where}: {command} is not the gRPC health check"]
    asked: list[tuple[str, Dialer | None]] = []

    def check_grpc(address: str, timeout_s: float, dialer: Dialer | None = None) -> str | None:
        asked.append((address, dialer))  # and dial nothing
        return None

    real, healthcheck.check_grpc = healthcheck.check_grpc, check_grpc
    try:
        status = healthcheck.main(remap(command[3:], files))
    except SystemExit as e:
        status = int(e.code or 0)
    finally:
        healthcheck.check_grpc = real
    if status != 0 or not asked:
        return [f"{where}: the health check refused {command[3:]}"]
    (target, dialer), problems = asked[0], []
    if target != f"localhost:{health}":
        problems.append(f"{where}: asks {target}; health is on {health}")
    prefix = SERVICES[pod.name][1]
    tls = dialer is not None and dialer.credentials is not None
    if tls != bool(pod.env.get(prefix + "TLS_CERT")):
        problems.append(f"{where}: TLS {'on' if tls else 'off'}, unlike its port")
    if tls and dialer is not None and dialer.server_name != TLS_NAME:
        problems.append(f"{where}: expects server name {dialer.server_name!r}")
    if pod.env.get(prefix + "TLS_CLIENT_CA") and "--tls-cert" not in command:
        problems.append(f"{where}: its port requires a client certificate; the probe has none")
    return problems


# ---- certificates, as docs/deploy.md makes them ----


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA and the shared certificate (both key usages, the name the overlay dials), in the
    files docs/deploy.md's `kubectl create secret` commands read."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl CLI")
    d = tmp_path_factory.mktemp("certs")
    _make_ca(d, "ca")
    _make_leaf(
        d,
        "server",
        "ca",
        f"extendedKeyUsage=serverAuth,clientAuth\nsubjectAltName=DNS:{TLS_NAME}\n",
    )
    return d


def mounted_files(pod: Pod, certificates: Path, tmp: Path) -> dict[str, Path]:
    """Each Secret volume of ``pod`` as a directory of its keys, made from the files the docs'
    commands name: mount path -> directory."""
    made = documented_files()
    spec = pod.workload["spec"]["template"]["spec"]
    files = {}
    for m in pod.container.get("volumeMounts", []):
        (volume,) = [v for v in spec["volumes"] if v["name"] == m["name"]]
        if "secret" in volume:
            directory = tmp / pod.name / m["name"]
            directory.mkdir(parents=True, exist_ok=True)
            for key, source in made.get(volume["secret"]["secretName"], {}).items():
                shutil.copy(certificates / source, directory / key)
            files[m["mountPath"]] = directory
    return files


# ---- the tests ----


def test_kustomizations_render_as_kubectl_renders_them():
    if shutil.which("kubectl") is None:
        pytest.skip("no kubectl here: render() alone stands in for it")
    for name in OVERLAYS:
        out = subprocess.run(
            ["kubectl", "kustomize", str(KUBE / name)], capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr
        ours = render(KUBE / name)
        theirs = [o for o in yaml.safe_load_all(out.stdout) if o]
        key = lambda o: (o["kind"], o["metadata"]["name"])  # noqa: E731
        assert sorted(theirs, key=key) == sorted(ours, key=key), name


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_object_validates_against_the_kubernetes_schemas(overlay, version):
    objects = overlay
    assert {o["kind"] for o in objects} >= {"Deployment", "StatefulSet", "Service", "ConfigMap"}
    assert schema_problems(objects, version) == []


@pytest.mark.parametrize("service", list(WORKLOADS))
def test_environment_and_arguments_parse_with_the_real_flags(overlay, service):
    assert flag_problems(pods_of(overlay)[service]) == []


def test_objects_agree_with_each_other(overlay):
    assert wiring_problems(overlay) == []
    assert tls_problems(overlay) == []


@pytest.mark.parametrize("service", list(WORKLOADS))
def test_probes_ask_the_health_of_the_right_port(overlay, service, certificates, tmp_path):
    pod = pods_of(overlay)[service]
    assert probe_problems(pod, mounted_files(pod, certificates, tmp_path)) == []


def group_problems(objects: list[Object]) -> list[str]:
    """A worker group spread over pods (the multi-host overlay): every rank's pod parses with
    the worker's real flags; the ranks agree on the group (its hosts, its size) and each has
    its own rank; each host entry is that rank's pod name under its headless Service (names
    published before readiness) at the port its container opens for the group; the
    StatefulSets have as many pods each (one rank of every group); and a NetworkPolicy lets
    only the group's pods reach the group's port, the gateways still the serving rank's."""
    ranks = [
        dataclasses.replace(pod_of(objects, "StatefulSet", o["metadata"]["name"]), name="worker")
        for o in objects
        if o["kind"] == "StatefulSet" and o["metadata"]["name"].startswith("worker")
    ]
    problems = [p for pod in ranks for p in flag_problems(pod)]
    by_rank = {int(pod.env.get("KVWORKER_GROUP_RANK", "0")): pod for pod in ranks}
    hosts = {pod.env.get("KVWORKER_GROUP_HOSTS", "") for pod in ranks}
    if len(hosts) != 1 or len(by_rank) != len(ranks):
        return [*problems, f"the ranks disagree: hosts {hosts}, ranks {sorted(by_rank)}"]
    entries = hosts.pop().split(",")
    if sorted(by_rank) != list(range(len(entries))):
        problems.append(f"ranks {sorted(by_rank)} for {len(entries)} hosts")
    for rank, entry in enumerate(entries):
        pod = by_rank.get(rank)
        if pod is None:
            continue
        spec = pod.workload["spec"]
        if pod.env.get("KVWORKER_TENSOR_PARALLEL") != str(len(entries)):
            problems.append(f"rank {rank}: --tensor-parallel is not {len(entries)}")
        namespace = pod.workload["metadata"].get("namespace", "default")
        ports = {str(p["containerPort"]) for p in pod.container.get("ports", [])}
        name = f"{pod.workload['metadata']['name']}-{{ordinal}}.{spec['serviceName']}"
        host, _, port = entry.rpartition(":")
        if host != f"{name}.{namespace}.svc" or port not in ports:
            problems.append(f"rank {rank}: {entry} is not its pod's {name} at an open port")
        headless = find(objects, "Service", spec["serviceName"]) or {"spec": {}}
        if headless["spec"].get("clusterIP") != "None" or not selects(headless, pod.workload):
            problems.append(f"rank {rank}: no headless Service {spec['serviceName']} names it")
        if headless["spec"].get("publishNotReadyAddresses") is not True:
            problems.append(f"rank {rank}: its name resolves only once ready")
    if len({pod.workload["spec"].get("replicas", 1) for pod in ranks}) != 1:
        problems.append("the ranks' StatefulSets have different replicas")
    # The group's port (pickled calls, unauthenticated) reachable from the group's pods only;
    # the serving rank's gRPC port still reachable by the gateways.
    group_port = int(entries[0].rpartition(":")[2])
    labels = [pod.workload["spec"]["template"]["metadata"].get("labels", {}) for pod in ranks]
    for pod, own in zip(ranks, labels, strict=True):
        rules = [
            rule
            for o in objects
            if o["kind"] == "NetworkPolicy" and matches(o["spec"].get("podSelector", {}), own)
            for rule in o["spec"].get("ingress", [])
        ]
        to_group = [r for r in rules if group_port in {p.get("port") for p in r.get("ports", [])}]
        if not rules or not to_group:
            problems.append(f"{pod.workload['metadata']['name']}: port {group_port} open to all")
        for rule in to_group:
            froms = [f.get("podSelector") for f in rule.get("from", [])]
            if (
                not froms
                or None in froms
                or not all(any(matches(sel, lab) for sel in froms) for lab in labels)
            ):
                problems.append(f"{pod.workload['metadata']['name']}: {rule} is not the group")
        grpc = int(pod.env.get("KVWORKER_PORT", "0"))
        if rules and pod.env.get("KVWORKER_GROUP_RANK", "0") == "0":
            open_to_all = [r for r in rules if not r.get("from")]
            if not any(grpc in {p.get("port") for p in r.get("ports", [])} for r in open_to_all):
                problems.append(f"{pod.workload['metadata']['name']}: gateways cannot dial {grpc}")
    return problems


def matches(selector: dict, labels: dict) -> bool:
    """A label selector (matchLabels, matchExpressions In/NotIn/Exists) on ``labels``."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for e in selector.get("matchExpressions", []):
        value = labels.get(e["key"])
        op = e["operator"]
        ok = {
            "In": value in e.get("values", []),
            "NotIn": value not in e.get("values", []),
            "Exists": value is not None,
            "DoesNotExist": value is None,
        }[op]
        if not ok:
            return False
    return True


def test_a_group_over_pods_names_each_rank_where_it_listens():
    objects = render(KUBE / "multi-host")
    assert len([o for o in objects if o["kind"] == "StatefulSet"]) == 2
    assert group_problems(objects) == []
    for name in ("base", "tls", "tensor-parallel"):  # no group over pods: nothing to check
        assert not any(o["metadata"]["name"] == "worker-rank1" for o in render(KUBE / name))


def test_the_overlay_turns_tls_on_everywhere_and_the_base_nowhere():
    base, tls = pods_of(render(KUBE / "base")), pods_of(render(KUBE / "tls"))
    for name in WORKLOADS:
        assert not any("_TLS_" in k for k in base[name].env), name
        assert tls[name].env.get(SERVICES[name][1] + "TLS_CERT"), name
    # Mutual TLS on the internal ports; the gateway's clients are not asked for certificates.
    assert tls["kvcache"].env.get("KVCACHE_TLS_CLIENT_CA")
    assert tls["worker"].env.get("KVWORKER_TLS_CLIENT_CA")
    assert "KVGATEWAY_TLS_CLIENT_CA" not in tls["gateway"].env


@pytest.mark.parametrize("name", OVERLAYS)
async def test_the_cache_service_answers_its_own_probes(name, certificates, tmp_path):
    """The cache service started with its pod's environment (PEM paths pointed at files made
    as the docs make them; any free port on loopback), asked by its own probes as the kubelet
    would ask them. Under mutual TLS, the same probe without a client certificate fails."""
    pod = pods_of(render(KUBE / name))["kvcache"]
    files = mounted_files(pod, certificates, tmp_path)
    env = {k: remap([v], files)[0] for k, v in pod.env.items()}
    with environment("KVCACHE_", env):
        config = ServiceConfig.from_args(["--host", "127.0.0.1", "--port", "0"])
    listens = f"localhost:{pod.env['KVCACHE_PORT']}"
    async with running(config) as service:
        for kind in ("readinessProbe", "livenessProbe"):
            probe = pod.container[kind]
            if "grpc" in probe:  # the kubelet's: grpc.health.v1 Check, service "", plaintext
                command = [
                    "python",
                    "-m",
                    "kvserve_launch.healthcheck",
                    "grpc",
                    f"localhost:{probe['grpc']['port']}",
                ]
            else:
                command = probe["exec"]["command"]
            command = [a.replace(listens, f"localhost:{service.port}") for a in command]
            assert await exit_status(remap(command, files)) == 0, (kind, command)
        if config.tls_client_ca:
            assert await exit_status(remap(without(command, "--tls-cert", "--tls-key"), files)) == 1


def without(command: list[str], *flags: str) -> list[str]:
    """``command`` less each of ``flags`` and its value."""
    out: list[str] = []
    for arg in command:
        if out and out[-1] in flags:
            out.pop()
        else:
            out.append(arg)
    return out


async def exit_status(command: list[str]) -> int:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, *command[1:], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    return await asyncio.wait_for(proc.wait(), timeout=60)


def test_docs_tell_how_to_make_every_secret_and_link_from_the_readme():
    text = DEPLOY_DOC.read_text()
    secrets = documented_secrets()
    assert secrets.keys() == {"kvserve-tokens", "kvserve-tls"}
    assert secrets["kvserve-tokens"] >= {"admin-token", "service-token"}
    assert documented_files()["kvserve-tls"].keys() == {"tls.crt", "tls.key", "ca.crt"}
    assert "api-key" in text  # the optional key
    for name in OVERLAYS:
        assert f"kubectl apply -k deploy/kubernetes/{name}" in text
    assert "(docs/deploy.md)" in (ROOT / "README.md").read_text()


# ---- negative controls: each kind of mistake, made on purpose, must be caught ----


def _container(objects: list[Object], service: str) -> Object:
    return get(objects, WORKLOADS[service], service)["spec"]["template"]["spec"]["containers"][0]


def _data(objects: list[Object], name: str) -> dict[str, str]:
    return get(objects, "ConfigMap", name)["data"]


def _env(objects: list[Object], service: str, name: str) -> Object:
    return next(v for v in _container(objects, service)["env"] if v["name"] == name)


def _api_key_in_a_configmap(objects: list[Object]) -> None:
    _data(objects, "gateway")["KVGATEWAY_API_KEY"] = "k"
    env = _container(objects, "gateway")["env"]
    env.remove(_env(objects, "gateway", "KVGATEWAY_API_KEY"))


MUTATIONS: dict[str, tuple[str, Callable[[list[Object]], object]]] = {
    "a misspelled field": ("schema", lambda o: _container(o, "worker").update(readinessProbes={})),
    "a port as a string": (
        "schema",
        lambda o: _container(o, "kvcache")["livenessProbe"]["grpc"].update(port="50051"),
    ),
    "a variable no flag reads": (
        "flags",
        lambda o: _data(o, "worker").update(KVWORKER_KV_MEMORY="512"),
    ),
    "a value the flag refuses": (
        "flags",
        lambda o: _data(o, "worker").update(KVWORKER_BLOCK_SIZE="0"),
    ),
    "an expansion of nothing": (
        "flags",
        lambda o: _env(o, "worker", "KVWORKER_ADVERTISE_ADDRESS").update(value="$(POD_IP):50061"),
    ),
    "a port moved in one place": (
        "wiring",
        lambda o: _data(o, "worker").update(KVWORKER_PORT="50062"),
    ),
    "the gateway dialing no Service": (
        "wiring",
        lambda o: _data(o, "gateway").update(KVGATEWAY_CACHE_SERVICE="kvcache-0:50051"),
    ),
    "a Secret key nobody makes": (
        "wiring",
        lambda o: _env(o, "worker", "KVWORKER_CACHE_TOKEN")["valueFrom"]["secretKeyRef"].update(
            key="service_token"
        ),
    ),
    "a ConfigMap that does not exist": (
        "wiring",
        lambda o: _container(o, "gateway")["envFrom"][0]["configMapRef"].update(name="gateways"),
    ),
    "a token in a ConfigMap": ("wiring", _api_key_in_a_configmap),
    "two cache services": (
        "wiring",
        lambda o: get(o, "Deployment", "kvcache")["spec"].update(replicas=2),
    ),
    "a Service selecting nothing": (
        "wiring",
        lambda o: get(o, "Service", "kvcache")["spec"]["selector"].update(app="x"),
    ),
    "a probe on the wrong port": (
        "probes",
        lambda o: _container(o, "gateway")["livenessProbe"]["grpc"].update(port=8000),
    ),
    "/health probed on the gRPC port": (
        "probes",
        lambda o: _container(o, "gateway")["readinessProbe"]["httpGet"].update(port="grpc"),
    ),
    "TLS for the cache service only": (
        "tls",
        lambda o: _data(o, "kvcache").update(KVCACHE_TLS_CERT="/c", KVCACHE_TLS_KEY="/k"),
    ),
}


def _rank1_env(objects: list[Object], name: str) -> Object:
    env = get(objects, "StatefulSet", "worker-rank1")["spec"]["template"]["spec"]
    return next(e for e in env["containers"][0]["env"] if e["name"] == name)


GROUP_MUTATIONS: dict[str, Callable[[list[Object]], object]] = {
    "two ranks 0": lambda o: _rank1_env(o, "KVWORKER_GROUP_RANK").update(value="0"),
    "a rank named under another Service": lambda o: _rank1_env(o, "KVWORKER_GROUP_HOSTS").update(
        value=_rank1_env(o, "KVWORKER_GROUP_HOSTS")["value"].replace(".worker-rank1.", ".worker.")
    ),
    "a follower's name resolving only once ready": lambda o: get(o, "Service", "worker-rank1")[
        "spec"
    ].pop("publishNotReadyAddresses"),
    "more followers than leaders": lambda o: get(o, "StatefulSet", "worker-rank1")["spec"].update(
        replicas=3
    ),
    "the group's port open to every pod": lambda o: get(o, "NetworkPolicy", "worker-group")["spec"][
        "ingress"
    ][0].pop("from"),
    "the gateways shut out": lambda o: get(o, "NetworkPolicy", "worker-group")["spec"][
        "ingress"
    ].pop(1),
}


@pytest.mark.parametrize("mutation", list(GROUP_MUTATIONS))
def test_a_mistake_in_a_group_over_pods_is_caught(mutation):
    objects = render(KUBE / "multi-host")
    GROUP_MUTATIONS[mutation](objects)
    assert group_problems(objects), f"{mutation}: not caught"


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_a_mistake_is_caught(mutation):
    check, mutate = MUTATIONS[mutation]
    objects = render(KUBE / "base")
    mutate(objects)
    pods = pods_of(objects).values()
    found = {
        "schema": lambda: schema_problems(objects, KUBERNETES_VERSIONS[0]),
        "flags": lambda: [p for pod in pods for p in flag_problems(pod)],
        "wiring": lambda: wiring_problems(objects),
        "probes": lambda: [p for pod in pods for p in probe_problems(pod, {})],
        "tls": lambda: tls_problems(objects),
    }[check]()
    assert found, f"{mutation}: not caught by the {check} check"
