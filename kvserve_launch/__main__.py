"""`python -m kvserve_launch` (`make run`): the whole system on one machine until Ctrl-C."""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path
from types import FrameType

from kvserve_launch.config import LaunchConfig
from kvserve_launch.process import ChildFailed
from kvserve_launch.supervisor import Supervisor
from kvserve_launch.system import System, launch
from kvserve_model.errors import ModelLoadError


def admin_cli() -> str:
    """How to run the admin CLI from any directory and shell: the ``kvserve-admin`` script
    next to this interpreter (its environment's), else this interpreter with ``-m``."""
    script = Path(sys.executable).parent / "kvserve-admin"
    return str(script) if script.exists() else f"{sys.executable} -m kvcache_service.admin_cli"


def banner(s: System) -> str:
    cfg = s.config
    # A wildcard address is where the gateway listens, not an address to send requests to.
    host = s.http_address.replace("0.0.0.0", "localhost").replace("[::]", "localhost")
    http = ("https://" if cfg.tls else "http://") + host
    curl = f"curl --cacert {cfg.tls_ca}" if cfg.tls else "curl"
    admin_tls = ""
    if cfg.tls:
        admin_tls = f" --tls-ca {cfg.tls_ca}"
        if cfg.tls_server_name:
            admin_tls += f" --tls-server-name {cfg.tls_server_name}"
        if cfg.tls_client_ca:
            admin_tls += f" --tls-cert {cfg.tls_cert} --tls-key {cfg.tls_key}"
    n = len(s.workers)
    if len(s.cache_addresses) == 1:
        cache = f"cache service {s.cache_address}"
    else:  # the admin CLI speaks to one shard; /admin/cache/* on the gateway covers them all
        cache = f"cache shards  {', '.join(s.cache_addresses)}"
    return f"""
kvserve is up: {n} worker{"s" if n != 1 else ""} serving {cfg.model}

  OpenAI API    {http}/v1        (health {http}/health, metrics {http}/metrics, docs {http}/docs)
  Dashboard     {http}/dashboard (the cache, live; asks for the admin token below)
  gRPC          {s.grpc_address}            (worker.v1.Worker/Generate, the workers' own service)
  {cache}            admin token: {cfg.admin_token}

Try:
  {curl} {http}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{cfg.model}", "messages": [{{"role": "user", "content": "Hello!"}}], "max_tokens": 32}}'

  {curl} {http}/admin/cache/stats -H 'Authorization: Bearer {cfg.admin_token}'
  {admin_cli()} --address {s.cache_address} --token={cfg.admin_token}{admin_tls} stats

Ctrl-C stops everything.
"""


def main(argv: list[str] | None = None, cfg: LaunchConfig | None = None) -> int:
    """Run the system until Ctrl-C or SIGTERM: ``cfg``, or the config ``argv`` gives."""
    cfg = cfg or LaunchConfig.from_args(argv)
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    try:
        system = launch(cfg)
    except ChildFailed as e:
        print(f"kvserve: startup failed: {e}", file=sys.stderr)
        return 1
    except (ModelLoadError, OSError) as e:  # the model (not a file it can serve), a directory
        print(f"kvserve: cannot start: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("kvserve: interrupted during startup", file=sys.stderr)
        return 130
    signal.signal(signal.SIGINT, on_signal)
    print(banner(system), flush=True)
    pids = ",".join(str(c.pid) for c in system.children())
    print(
        f"KVSERVE_READY http={system.http_address} grpc={system.grpc_address} "
        f"cache={','.join(system.cache_addresses)} pids={pids}",
        flush=True,
    )
    code = Supervisor(
        system,
        backoff_s=cfg.restart_backoff_s,
        give_up_after=cfg.max_restarts + 1,
        window_s=cfg.restart_window_s,
    ).run(stop)
    print("kvserve: stopping (gateway, workers, cache service) ...", file=sys.stderr, flush=True)
    system.stop()
    print("kvserve: stopped", file=sys.stderr, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
