"""Starting a worker group on one machine (``--tensor-parallel N``): this process becomes rank 0
and starts ranks 1..N-1 as ``python -m worker.follower`` children, with the environment
``mx.distributed`` reads (what ``mlx.launch`` would set), and watches them: a rank that dies
takes the group down (``docs/tensor-parallel.md``).

The ring backend (CPU processes, loopback TCP) gets a hosts file of free loopback ports; NCCL
(NVIDIA GPUs) a rendezvous address and port, and one GPU a rank (``CUDA_VISIBLE_DEVICES``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

# How often rank 0 looks at its followers, and a follower at rank 0.
WATCH_S = 0.5
OWN_HOSTFILE_ENV = "KVSERVE_GROUP_OWN_HOSTFILE"  # the ring hosts file rank 0 wrote


def resolve_backend(backend: str) -> str:
    """``any``: NCCL where MLX runs on an NVIDIA GPU, else the ring."""
    if backend != "any":
        return backend
    from worker.model.device import cuda_available

    return "nccl" if cuda_available() else "ring"


@dataclass
class Followers:
    """Ranks 1..N-1, started by rank 0."""

    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    stopping: bool = False

    def watch(self) -> None:
        """A daemon thread: a follower that exits (not while stopping) ends this process, so
        its leases expire and whatever supervises the worker restarts the group."""

        def loop() -> None:
            while not self.stopping:
                for rank, p in enumerate(self.procs, start=1):
                    code = p.poll()
                    if code is not None and not self.stopping:
                        log.error("worker group: rank %d exited (%s): the group stops", rank, code)
                        logging.shutdown()
                        os._exit(1)
                time.sleep(WATCH_S)

        threading.Thread(target=loop, name="group-watch", daemon=True).start()

    def stop(self) -> None:
        self.stopping = True
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()


def start_followers(size: int, backend: str, argv: list[str]) -> Followers:
    """Sets this process up as rank 0 of a group of ``size`` over ``backend`` (its environment)
    and starts the other ranks as ``python -m worker.follower`` with ``argv`` (the worker's own
    flags: the same model and settings). Returns them, watched."""
    env = group_env(size, resolve_backend(backend))
    os.environ.update(env[0])
    followers = Followers()
    for rank in range(1, size):
        child_env = {**os.environ, **env[rank]}
        followers.procs.append(
            subprocess.Popen([sys.executable, "-m", "worker.follower", *argv], env=child_env)
        )
    followers.watch()
    backend_name = env[0]["KVSERVE_GROUP_BACKEND"]
    log.info("worker group: %d ranks over %s; this process is rank 0", size, backend_name)
    return followers


def group_env(size: int, backend: str) -> list[dict[str, str]]:
    """Each rank's environment for ``mx.distributed.init`` over ``backend`` on this machine."""
    base = {"MLX_WORLD_SIZE": str(size), "KVSERVE_GROUP_BACKEND": backend}
    if backend == "ring":
        path = _hostfile([f"127.0.0.1:{p}" for p in free_ports(size)])
        base["MLX_HOSTFILE"] = path
        ranks = [{**base, "MLX_RANK": str(r)} for r in range(size)]
        ranks[0][OWN_HOSTFILE_ENV] = path  # rank 0 deletes it once every rank joined
        return ranks
    if backend == "nccl":
        base |= _nccl_env("127.0.0.1", str(free_ports(1)[0]))
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        gpus = visible.split(",") if visible else [str(r) for r in range(size)]
        if len(gpus) < size:
            raise ValueError(f"--tensor-parallel {size} needs {size} GPUs, {len(gpus)} visible")
        return [{**base, "MLX_RANK": str(r), "CUDA_VISIBLE_DEVICES": gpus[r]} for r in range(size)]
    raise ValueError(f"a worker group on one machine runs over ring or nccl, not {backend}")


def ordinal(hostname: str | None = None) -> str:
    """The number ending this host's name (a StatefulSet pod ``worker-3``: ``3``); "" if none."""
    name = hostname if hostname is not None else socket.gethostname()
    digits = len(name) - len(name.rstrip("0123456789"))
    return name[len(name) - digits :] if digits else ""


def join_env(hosts: str, rank: int, backend: str, hostname: str | None = None) -> dict[str, str]:
    """The environment ``mx.distributed.init`` reads for rank ``rank`` of a group whose ranks
    start on their own (``--group-hosts``), as ``mlx.launch`` would set it: the ring gets a
    hosts file of ``hosts`` (names resolve), NCCL rank 0's host and port as its rendezvous.
    ``{ordinal}`` in ``hosts`` becomes the number ending this host's name."""
    if "{ordinal}" in hosts:
        number = ordinal(hostname)
        if not number:
            name = hostname or socket.gethostname()
            raise ValueError(f"--group-hosts has {{ordinal}} but host name {name!r} ends in none")
        hosts = hosts.replace("{ordinal}", number)
    entries = hosts.split(",")
    base = {
        "MLX_WORLD_SIZE": str(len(entries)),
        "MLX_RANK": str(rank),
        "KVSERVE_GROUP_BACKEND": backend,
    }
    if backend == "ring":
        path = _hostfile(entries)
        return {**base, "MLX_HOSTFILE": path, OWN_HOSTFILE_ENV: path}
    if backend == "nccl":
        host, _, port = entries[0].rpartition(":")
        return {**base, **_nccl_env(socket.gethostbyname(host), port)}
    raise ValueError(f"--group-hosts runs over ring or nccl, not {backend}")


def _hostfile(entries: list[str]) -> str:
    """A ring hosts file (``mlx.launch``'s form: one ``[host:port]`` a rank); its path."""
    fd, path = tempfile.mkstemp(prefix="kvserve-group-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump([[entry] for entry in entries], f)
    return path


def _nccl_env(host_ip: str, port: str) -> dict[str, str]:
    """NCCL's rendezvous at rank 0's address (NVLink multicast off: KINDS.md)."""
    return {"NCCL_HOST_IP": host_ip, "NCCL_PORT": port, "NCCL_NVLS_ENABLE": "0"}


def discard_hostfile() -> None:
    """On rank 0, once every rank has joined (after the group's first collective): the ring's
    hosts file this process wrote is read by nobody any more; delete it (a start leaves no
    file behind). A group started by ``mlx.launch`` owns its own: kept."""
    path = os.environ.pop(OWN_HOSTFILE_ENV, None)
    if path:
        with contextlib.suppress(OSError):
            os.unlink(path)


def watch_leader(parent: int) -> None:
    """On a follower: a daemon thread that ends this process once rank 0 (``parent``) is
    gone (its collectives would otherwise wait forever)."""

    def loop() -> None:
        while os.getppid() == parent:
            time.sleep(WATCH_S)
        os._exit(1)

    threading.Thread(target=loop, name="leader-watch", daemon=True).start()


def watch_messages(channel: Any, bound_s: float) -> None:
    """On a follower: a daemon thread that ends this process (status 1) once nothing has come
    from rank 0 for ``bound_s`` seconds. Rank 0 pings while idle (``stall_watch.pings``) and
    exits itself when one job runs past its own bound, so a silence this long means rank 0
    is gone without closing its sockets (its machine lost, its process stopped): this rank
    would wait in the next collective forever, and a restarted rank 0 could not form the
    group without it."""

    def loop() -> None:
        while True:
            time.sleep(min(1.0, bound_s / 4))
            silent = time.monotonic() - channel.received_at
            if silent > bound_s:
                log.critical(
                    "worker group: nothing from rank 0 for %.0f s (bound %.0f s): it is gone; "
                    "this rank exits so the group can start again",
                    silent,
                    bound_s,
                )
                logging.shutdown()
                os._exit(1)

    threading.Thread(target=loop, name="leader-silence", daemon=True).start()


def free_ports(n: int) -> list[int]:
    """``n`` loopback ports free now (a rank binds them next; another process could take one
    in between: the group then fails to form, and the worker restarts)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()
