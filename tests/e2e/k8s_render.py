"""Kubernetes manifests as ``kubectl kustomize`` renders them and the kubelet starts them, for
tests/e2e/test_kubernetes.py: no cluster, no kubectl needed.

:func:`render` does the few kustomize features deploy/kubernetes uses and refuses any other,
so that it cannot quietly drift from kustomize (the test compares the two where kubectl
exists). :func:`pod_of` resolves a container's environment the kubelet's way.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

Object = dict[str, Any]
EXPANSION = re.compile(r"\$\((\w+)\)")


def render(directory: Path) -> list[Object]:
    """The objects of a kustomization: its resources (files or kustomizations), JSON patches
    (RFC 6902) on targets by kind and name, then its namespace."""
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(k) - {"apiVersion", "kind", "namespace", "resources", "patches"}
    assert not unknown, f"{directory}: render() does not do {unknown}"
    objects: list[Object] = []
    for entry in k.get("resources", []):
        path = (directory / entry).resolve()
        if path.is_dir():
            objects += render(path)
        else:
            objects += [o for o in yaml.safe_load_all(path.read_text()) if o]
    for patch in k.get("patches", []):
        assert set(patch) == {"path", "target"}, patch
        target = find(objects, patch["target"]["kind"], patch["target"]["name"])
        assert target is not None, f"{directory}: no target {patch['target']}"
        json_patch(target, yaml.safe_load((directory / patch["path"]).read_text()))
    for o in objects:
        if "namespace" in k and o["kind"] != "Namespace":
            o["metadata"]["namespace"] = k["namespace"]
    return objects


def json_patch(document: Object, operations: list[dict[str, Any]]) -> None:
    """RFC 6902's add, replace, remove and test, in place."""
    for op in operations:
        keys = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        node: Any = document
        for key in keys[:-1]:
            node = node[int(key)] if isinstance(node, list) else node[key]
        last: Any = keys[-1]
        if isinstance(node, list):
            last = len(node) if last == "-" else int(last)
        value = copy.deepcopy(op.get("value"))
        if op["op"] == "test":
            assert node[last] == value, f"patch test failed at {op['path']}"
        elif op["op"] == "add" and isinstance(node, list):
            node.insert(last, value)
        elif op["op"] == "add":
            node[last] = value
        elif op["op"] == "replace":
            assert last in node if isinstance(node, dict) else last < len(node), op["path"]
            node[last] = value
        elif op["op"] == "remove":
            del node[last]
        else:
            raise AssertionError(f"render() does not do patch op {op['op']}")


def find(objects: list[Object], kind: str, name: str) -> Object | None:
    return next((o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name), None)


def get(objects: list[Object], kind: str, name: str) -> Object:
    o = find(objects, kind, name)
    assert o is not None, f"no {kind} {name}"
    return o


@dataclass
class Pod:
    """A workload's first pod: its one container, and that container's environment."""

    name: str  # the workload's
    workload: Object
    container: Object
    env: dict[str, str]  # resolved; a Secret's key stands in as "secret-<key>"
    # Where each variable came from: ("secret", name, key[, "optional"]), ("configmap", name,
    # key), ("field", path) or ("value",).
    source: dict[str, tuple[str, ...]]
    problems: list[str]  # found while resolving: a missing ConfigMap, key, or variable


def expand(value: str, env: dict[str, str]) -> str:
    """$(VAR) as the kubelet expands it: from the variables defined before, else left as is."""
    return EXPANSION.sub(lambda m: env.get(m.group(1), m.group(0)), value)


def pod_name(workload: Object) -> str:
    """Its first pod's name: a StatefulSet's are <name>-<ordinal>, a Deployment's random."""
    name = workload["metadata"]["name"]
    return f"{name}-0" if workload["kind"] == "StatefulSet" else f"{name}-5d8f7c6b9d-x2x7q"


def pod_of(objects: list[Object], kind: str, name: str) -> Pod:
    """The environment as the kubelet builds it: envFrom's ConfigMaps, then env in order, each
    value's $(VAR) expanded from those before it, ConfigMap keys and the downward API looked
    up."""
    workload = get(objects, kind, name)
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    pod = Pod(name, workload, container, {}, {}, [])
    downward = {
        "metadata.name": pod_name(workload),
        "metadata.namespace": workload["metadata"].get("namespace", "default"),
        "status.podIP": "10.0.0.7",
    }
    for source in container.get("envFrom", []):
        cm = source["configMapRef"]["name"]
        data = (find(objects, "ConfigMap", cm) or {}).get("data")
        if data is None:
            pod.problems.append(f"{name}: envFrom names no ConfigMap {cm}")
        for key, value in (data or {}).items():
            pod.env[key], pod.source[key] = str(value), ("configmap", cm, key)
    for var in container.get("env", []):
        key, ref = var["name"], var.get("valueFrom", {})
        if "value" in var:
            pod.env[key], pod.source[key] = expand(str(var["value"]), pod.env), ("value",)
        elif s := ref.get("secretKeyRef"):
            optional = ("optional",) if s.get("optional") else ()
            pod.env[key] = f"secret-{s['key']}"
            pod.source[key] = ("secret", s["name"], s["key"], *optional)
        elif c := ref.get("configMapKeyRef"):
            value = ((find(objects, "ConfigMap", c["name"]) or {}).get("data") or {}).get(c["key"])
            if value is None:
                pod.problems.append(f"{name}: {key}: ConfigMap {c['name']} has no {c['key']}")
            pod.env[key], pod.source[key] = str(value), ("configmap", c["name"], c["key"])
        elif f := ref.get("fieldRef"):
            pod.env[key], pod.source[key] = downward[f["fieldPath"]], ("field", f["fieldPath"])
        else:
            pod.problems.append(f"{name}: {key}: a value this test cannot resolve")
    for key, value in pod.env.items():
        if EXPANSION.search(value):
            pod.problems.append(f"{name}: {key}={value!r}: $(...) names no earlier variable")
    return pod
