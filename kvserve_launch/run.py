"""A service process, from its parsed config to its exit: what every ``__main__`` shares.

``python -m kvcache_service``, ``python -m worker`` and ``python -m gateway`` each call
:func:`run_until_signal` with a function that starts the service. It returns an async context
manager that serves while it is entered and yields the process's ready line, the line
launchers and tests wait for (``kvserve_launch.process``)::

    KVCACHE_READY 127.0.0.1:50051
    WORKER_READY 127.0.0.1:50061
    GATEWAY_READY http=127.0.0.1:8000 grpc=127.0.0.1:50050

The service runs until SIGINT or SIGTERM, then leaves its context (a graceful stop). A
:class:`~kvserve_launch.startup.StartupError` raised on the way up is printed as its one line
and the process exits with its status (``kvserve_launch.startup``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import NoReturn

from kvserve_launch.startup import StartupError, report

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Set by a launcher (``kvserve_launch.process.Child``) in each child's environment: its pid.
PARENT_ENV = "KVSERVE_PARENT_PID"
PARENT_POLL_S = 0.5

Service = AbstractAsyncContextManager[str]


def run_until_signal(
    name: str, log_level: str, start: Callable[[], Service], exit_hard: bool = False
) -> NoReturn:
    """Log at ``log_level`` on stderr, call ``start`` (outside the event loop: it may load
    what takes a while, or re-execute the process), serve what it returns until a signal, and
    exit: 0 after a signal, the :class:`StartupError`'s status if one was raised.

    ``exit_hard``: leave with ``os._exit`` once logs and output are flushed, skipping
    interpreter and C++ teardown (the worker: MLX 0.32 sometimes aborts at exit, status 134,
    after running on a thread other than the main one, as the model does there)."""
    logging.basicConfig(level=log_level.upper(), format=LOG_FORMAT, stream=sys.stderr)
    watch_launcher(name)
    try:
        asyncio.run(_serve(name, start()))
        status = 0
    except StartupError as e:
        status = report(name, e)
    if not exit_hard:
        sys.exit(status)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def watch_launcher(name: str) -> None:
    """Ends this process (SIGTERM to itself: the graceful stop, or the default exit while it
    starts) once the launcher that started it is gone, however it went: ``kill -9``, the OOM
    killer, a runtime that signals only the main pid. The children of a launcher killed so
    kept serving, reparented, holding their ports, and the next launch found them taken.

    Only a direct child of the pid in ``KVSERVE_PARENT_PID`` watches it: a process that
    inherited the variable from a child of the launcher (its parent is that child, and the
    launcher lives) does not; one whose launcher is already gone stops at once."""
    try:
        parent = int(os.environ.get(PARENT_ENV, ""))
    except ValueError:
        return
    if os.getppid() != parent and _alive(parent):
        return  # a grandchild: its own parent minds it

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        logging.getLogger(name).warning("the launcher (pid %d) is gone: stopping", parent)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


async def _serve(name: str, service: Service) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with service as ready_line:
        print(ready_line, flush=True)
        await stop.wait()
        logging.getLogger(name).info("shutting down")
