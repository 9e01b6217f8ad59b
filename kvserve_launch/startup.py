"""How a service that cannot start says so, and how its launcher learns which failure it was.

A service that meets a failure it expects (its port is taken, its model is missing or of a
type mlx-lm cannot load) raises :class:`StartupError` where it finds it. The process's
``__main__`` prints it as one line, with no traceback::

    worker: cannot start: port 50061 is in use (set --port or KVWORKER_PORT)

and exits with the error's :class:`Failure` status. The status, not the wording of the line,
is what the launcher reads (``kvserve_launch.diagnosis``): it knows its own flags for the
child's port and model, which are not the child's. Anything unexpected is a bug and keeps
its traceback.

The services import this module; it imports nothing of theirs, nor grpc.
"""

from __future__ import annotations

import enum
import errno
import socket
import sys
from typing import TYPE_CHECKING, ClassVar

from kvserve_launch.settings import flag_of, variable_of

if TYPE_CHECKING:
    import grpc


class Failure(enum.IntEnum):
    """Exit statuses of expected startup failures, from sysexits.h: they collide with neither
    Python's 1 (an uncaught exception) nor argparse's 2 (a bad flag)."""

    MODEL = 66  # EX_NOINPUT: the model is missing, not a model, or of an unsupported type
    PORT_IN_USE = 69  # EX_UNAVAILABLE: another process holds the port
    OTHER = 78  # EX_CONFIG: any other expected failure (an address not on this host)

    @property
    def meaning(self) -> str:
        return _MEANING[self]


_MEANING = {
    Failure.MODEL: "model unavailable",
    Failure.PORT_IN_USE: "port in use",
    Failure.OTHER: "cannot start",
}


class StartupError(Exception):
    """An expected reason a process cannot start. ``hint`` says what to change, in terms of
    the process's own flags."""

    status: ClassVar[Failure] = Failure.OTHER

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def line(self, service: str) -> str:
        text = f"{self.message} ({self.hint})" if self.hint else self.message
        return f"{service}: cannot start: " + " ".join(text.split())  # one line, always


class PortInUse(StartupError):
    status = Failure.PORT_IN_USE


class ModelUnavailable(StartupError):
    status = Failure.MODEL


def report(service: str, error: StartupError) -> int:
    """Print ``error`` as its one line on stderr; return the exit status to leave with."""
    print(error.line(service), file=sys.stderr, flush=True)
    return int(error.status)


def setting(env_prefix: str, name: str) -> str:
    """How a user sets config field ``name``: ``--http-port or KVGATEWAY_HTTP_PORT``. Every
    process names its flags and variables by this one rule (``kvserve_launch.settings``)."""
    return f"{flag_of(name)} or {variable_of(env_prefix, name)}"


# Off, where gRPC's default on Linux is on: with SO_REUSEPORT a second server binds a port
# that a running one holds and the kernel splits connections between the two, so a second
# `make run` would silently share the first one's cache service instead of failing.
EXCLUSIVE_PORT = ("grpc.so_reuseport", 0)


def add_port(
    server: grpc.aio.Server,
    host: str,
    port: int,
    env_prefix: str,
    name: str,
    credentials: grpc.ServerCredentials | None = None,
) -> int:
    """``server.add_insecure_port(host:port)``, or ``add_secure_port`` with ``credentials``
    (``kvserve_launch.tls``); the bound port, or a :class:`StartupError` saying why not.
    ``name`` is the config field of the port (for the hint)."""
    # A plain socket first: gRPC says only "Failed to bind", after logging a line of its own.
    problem = bind_probe(host, port)
    if problem is not None:
        raise listen_error(host, port, problem, env_prefix, name)
    try:
        if credentials is not None:
            return server.add_secure_port(grpc_address(host, port), credentials)
        return server.add_insecure_port(grpc_address(host, port))
    except RuntimeError as e:  # taken since the probe, or a reason the probe did not meet
        raise listen_error(host, port, bind_probe(host, port), env_prefix, name) from e


def listen_error(
    host: str, port: int, cause: OSError | None, env_prefix: str, name: str
) -> StartupError:
    """The startup error for a port that could not be bound because of ``cause``."""
    if cause is not None and cause.errno == errno.EADDRINUSE:
        return PortInUse(f"port {port} is in use", f"set {setting(env_prefix, name)}")
    why = f": {cause.strerror or cause}" if cause is not None else ""
    return StartupError(
        f"cannot listen on {host}:{port}{why}",
        f"check {setting(env_prefix, 'host')} and {setting(env_prefix, name)}",
    )


def bind_probe(host: str, port: int) -> OSError | None:
    """Why no listening socket on ``host:port`` can be bound now; None where one can. Like
    gRPC, one address of several that ``host`` resolves to is enough."""
    try:
        infos = socket.getaddrinfo(
            host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except OSError as e:
        return e
    problems: list[OSError] = []
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC and uvicorn do
            try:
                s.bind(address)
            except OSError as e:
                problems.append(e)
                continue
        return None
    in_use = [e for e in problems if e.errno == errno.EADDRINUSE]
    return (in_use or problems)[0]  # getaddrinfo answers at least one address or raises


def grpc_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
