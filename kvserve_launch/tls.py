"""TLS for every process's gRPC channels and ports, from PEM files named in config.

Off unless configured: a server serves TLS when both its certificate and key are set, a
client verifies its server against a CA bundle when one is set. Each process passes its own
flags' values in; a PEM that cannot be read is a :class:`StartupError` naming the flag, read
once at startup (gRPC copies the bytes, so a rotated file needs a restart).

The services import this module; it imports nothing of theirs.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from kvserve_launch.startup import StartupError, setting

ChannelOptions = Sequence[tuple[str, Any]]


def read_pem(path: str, env_prefix: str, name: str) -> bytes:
    """The bytes of the PEM file at ``path``; ``name`` is its config field (for the hint)."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise StartupError(
            f"cannot read {path}: {e.strerror or e}", f"check {setting(env_prefix, name)}"
        ) from e
    if b"-----BEGIN" not in data:
        raise StartupError(f"{path} is not a PEM file", f"check {setting(env_prefix, name)}")
    return data


def server_credentials(cert: str, key: str, env_prefix: str) -> grpc.ServerCredentials | None:
    """Credentials for a port serving TLS; None (plaintext) when cert and key are unset. The
    configs refuse one without the other."""
    if not (cert and key):
        return None
    pair = (read_pem(key, env_prefix, "tls_key"), read_pem(cert, env_prefix, "tls_cert"))
    return grpc.ssl_server_credentials([pair])


def channel(
    address: str,
    ca: str = "",
    server_name: str = "",
    options: ChannelOptions = (),
    env_prefix: str = "",
) -> grpc.aio.Channel:
    """A channel to ``address``: TLS verified against the CA bundle ``ca`` when set (the
    server's certificate must name ``server_name``, default the host dialed), else plaintext."""
    if not ca:
        return grpc.aio.insecure_channel(address, options=list(options))
    credentials = grpc.ssl_channel_credentials(root_certificates=read_pem(ca, env_prefix, "tls_ca"))
    if server_name:
        options = [*options, ("grpc.ssl_target_name_override", server_name)]
    return grpc.aio.secure_channel(address, credentials, options=list(options))


def check_pair(cert: str, key: str) -> str | None:
    """What is wrong with a server's TLS settings, for its config's parser; None if fine."""
    if bool(cert) != bool(key):
        return "--tls-cert and --tls-key go together: set both to serve TLS, or neither"
    return None
