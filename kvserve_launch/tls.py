"""TLS for every process's gRPC channels and ports, from PEM files named in config.

Off unless configured. One scheme in every process, as in Consul or etcd's peer TLS:

- ``tls_cert`` + ``tls_key``: the process's own identity. Its ports serve TLS with it, and
  when it dials over TLS it presents it as its client certificate (so the certificate needs
  both ``serverAuth`` and ``clientAuth`` in its extended key usage, or none).
- ``tls_ca``: dial over TLS, verifying the server against this CA bundle (the server's
  certificate must name ``tls_server_name``, default the host dialed). Unset: plaintext.
- ``tls_client_ca``: mutual TLS on the ports it serves: a client must present a certificate
  signed by this bundle, else the handshake fails (the client sees UNAVAILABLE).

Each process passes its own flags' values in; a PEM that cannot be read is a
:class:`StartupError` naming the flag, read once at startup (gRPC copies the bytes, so a
rotated file needs a restart). This module is the one place credentials are built.

The services import this module; it imports nothing of theirs.
"""

from __future__ import annotations

import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvserve_launch.startup import StartupError, setting

if TYPE_CHECKING:  # grpc itself is imported where a credential or channel is made: the
    import grpc  # launcher reads PEMs and builds an ssl context here and holds no grpc (10 MiB)

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


def server_credentials(
    cert: str, key: str, env_prefix: str, client_ca: str = ""
) -> grpc.ServerCredentials | None:
    """Credentials for a port serving TLS; None (plaintext) when cert and key are unset. With
    ``client_ca``, every client must present a certificate it signed. The configs refuse a
    cert without a key, and a client CA without both (:func:`check_server`)."""
    if not (cert and key):
        return None
    import grpc

    pair = (read_pem(key, env_prefix, "tls_key"), read_pem(cert, env_prefix, "tls_cert"))
    if not client_ca:
        return grpc.ssl_server_credentials([pair])
    roots = read_pem(client_ca, env_prefix, "tls_client_ca")
    return grpc.ssl_server_credentials([pair], root_certificates=roots, require_client_auth=True)


@dataclass(frozen=True, slots=True)
class Dialer:
    """Builds every channel of one process the same way: plaintext, TLS, or TLS presenting
    the process's own certificate. Build it once at startup (:meth:`from_files` reads the
    PEMs, so a bad path fails then, not on the first channel to a new worker)."""

    credentials: grpc.ChannelCredentials | None = None  # None: plaintext
    server_name: str = ""

    @classmethod
    def from_files(
        cls,
        ca: str = "",
        server_name: str = "",
        cert: str = "",
        key: str = "",
        env_prefix: str = "",
    ) -> Dialer:
        """Plaintext without ``ca``; with it, TLS verified against it, presenting ``cert`` and
        ``key`` when both are set (a server that requires client certificates needs them)."""
        if not ca:
            return cls()
        identity: dict[str, bytes] = {}
        if cert and key:
            identity = {
                "private_key": read_pem(key, env_prefix, "tls_key"),
                "certificate_chain": read_pem(cert, env_prefix, "tls_cert"),
            }
        roots = read_pem(ca, env_prefix, "tls_ca")
        import grpc

        return cls(grpc.ssl_channel_credentials(root_certificates=roots, **identity), server_name)

    def _options(self, options: ChannelOptions) -> list[tuple[str, Any]]:
        if self.credentials is not None and self.server_name:
            return [*options, ("grpc.ssl_target_name_override", self.server_name)]
        return list(options)

    def aio(self, address: str, options: ChannelOptions = ()) -> grpc.aio.Channel:
        import grpc

        if self.credentials is None:
            return grpc.aio.insecure_channel(address, options=list(options))
        return grpc.aio.secure_channel(address, self.credentials, options=self._options(options))

    def blocking(self, address: str, options: ChannelOptions = ()) -> grpc.Channel:
        """A synchronous channel (the admin CLI, the container health check)."""
        import grpc

        if self.credentials is None:
            return grpc.insecure_channel(address, options=list(options))
        return grpc.secure_channel(address, self.credentials, options=self._options(options))


def client_ssl_context(ca: str, cert: str = "", key: str = "") -> ssl.SSLContext:
    """The same client side for HTTPS (the gateway's HTTP port): verify against ``ca``,
    present ``cert``/``key`` when both are set."""
    try:
        context = ssl.create_default_context(cafile=ca)
        if cert and key:
            context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as e:
        raise StartupError(f"cannot load TLS files {ca!r}, {cert!r}, {key!r}: {e}") from e
    return context


def channel(
    address: str,
    ca: str = "",
    server_name: str = "",
    options: ChannelOptions = (),
    env_prefix: str = "",
    cert: str = "",
    key: str = "",
) -> grpc.aio.Channel:
    """One channel to ``address`` (:class:`Dialer`): TLS verified against the CA bundle
    ``ca`` when set, presenting ``cert``/``key`` when set; else plaintext."""
    return Dialer.from_files(ca, server_name, cert, key, env_prefix).aio(address, options)


def check_pair(cert: str, key: str) -> str | None:
    """What is wrong with a server's TLS pair, for its config's parser; None if fine."""
    if bool(cert) != bool(key):
        return "--tls-cert and --tls-key go together: set both to serve TLS, or neither"
    return None


def check_server(cert: str, key: str, client_ca: str = "") -> str | None:
    """What is wrong with a server's TLS settings (pair and client CA); None if fine."""
    if problem := check_pair(cert, key):
        return problem
    if client_ca and not cert:
        return (
            "--tls-client-ca verifies the client certificates of a TLS port: "
            "set --tls-cert and --tls-key too"
        )
    return None
