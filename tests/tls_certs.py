"""Test certificates made with the openssl CLI: two CAs, a certificate every process can use
both ways (server and client), a client-only one, and a client certificate of the other CA."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
from pathlib import Path

import pytest

needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")


@dataclasses.dataclass(frozen=True)
class Certs:
    ca: str  # the CA that signed cert and client_cert
    cert: str  # for localhost and 127.0.0.1, serverAuth and clientAuth: a process's identity
    key: str
    other_ca: str  # a CA that signed only stranger_cert
    client_cert: str  # clientAuth only, signed by ca (an operator, a test's client)
    client_key: str
    stranger_cert: str  # a client certificate signed by other_ca
    stranger_key: str


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _make_ca(d: Path, name: str) -> None:
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "1", "-subj", f"/CN={name}",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        cwd=d,
    )  # fmt: skip


def _make_leaf(d: Path, name: str, ca: str, ext: str) -> None:
    (d / f"{name}.cnf").write_text(
        "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\n" + ext
    )
    _openssl(
        "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}",
        cwd=d,
    )  # fmt: skip
    _openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
        "-CAcreateserial", "-out", f"{name}.pem", "-days", "1", "-extfile", f"{name}.cnf",
        cwd=d,
    )  # fmt: skip


def make_certs(d: Path) -> Certs:
    """The files in directory ``d`` (what docs/configuration.md tells operators to run)."""
    _make_ca(d, "ca")
    _make_ca(d, "other-ca")
    both = "extendedKeyUsage=serverAuth,clientAuth\nsubjectAltName=DNS:localhost,IP:127.0.0.1\n"
    _make_leaf(d, "server", "ca", both)
    _make_leaf(d, "client", "ca", "extendedKeyUsage=clientAuth\n")
    _make_leaf(d, "stranger", "other-ca", "extendedKeyUsage=clientAuth\n")
    return Certs(
        *(str(d / f) for f in ("ca.pem", "server.pem", "server.key", "other-ca.pem")),
        *(str(d / f) for f in ("client.pem", "client.key", "stranger.pem", "stranger.key")),
    )
