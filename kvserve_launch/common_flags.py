"""The TLS and logging fields every process's config has, declared once.

A config dataclass inherits them: :class:`ServerFlags` where the process only serves (the
cache service), :class:`ServerClientFlags` where it also dials our other services over TLS
(the gateway, the workers, and the launcher, which passes them on to its children). Each
process says in its own words what the flags mean for it (which ports, which peers), so the
help rows are the process's; :func:`tls_help` lays them out in one order, with the rows that
read the same everywhere. The flags are checked by ``kvserve_launch.tls.check_server``.

Standard library only, like ``settings``: every process imports it.
"""

from __future__ import annotations

from dataclasses import dataclass

LOG_LEVEL_HELP = "DEBUG, INFO, WARNING or ERROR"


@dataclass(frozen=True, slots=True)
class ServerFlags:
    """TLS on the process's port(s) (kvserve_launch.tls): PEM certificate and key, both or
    neither; ``tls_client_ca``, a CA bundle: set, callers must present a certificate it signed
    (mutual TLS). And the process's log level."""

    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    log_level: str = "INFO"


@dataclass(frozen=True, slots=True)
class ServerClientFlags(ServerFlags):
    """:class:`ServerFlags`, and TLS on what the process dials: ``tls_ca``, a CA bundle to
    verify its peers with (set: TLS; the process's own pair is its client certificate), and
    ``tls_server_name``, the name their certificates must carry when not the host dialed."""

    tls_ca: str = ""
    tls_server_name: str = ""


def tls_help(
    cert: str, client_ca: str, ca: str | None = None, server_name: str | None = None
) -> dict[str, str]:
    """The settings-table rows of the TLS flags (``kvserve_launch.settings``), in the order
    every process lists them: cert, key, [ca, server name,] client CA. ``ca`` and
    ``server_name`` are for a :class:`ServerClientFlags` config."""
    rows = {"tls_cert": cert, "tls_key": "PEM private key of --tls-cert"}
    if ca is not None:
        rows["tls_ca"] = ca
    if server_name is not None:
        rows["tls_server_name"] = server_name
    rows["tls_client_ca"] = client_ca
    return rows
