"""`python -m worker.follower`: rank 1..N-1 of a worker group (``--tensor-parallel N``), started
by rank 0 (``worker.group_launch``) with the worker's own flags and the group's environment. It
joins the group, waits for rank 0 to say what to build (the model, the pool's block count, the
attention), then makes every model and pool call rank 0 makes (``worker.model.group``), until
rank 0 stops it or is gone."""

from __future__ import annotations

import logging
import os
import sys

from kvserve_launch.run import LOG_FORMAT
from kvserve_model.blas import ensure_fast_blas
from worker.config import WorkerConfig
from worker.device_defaults import apply_mlx_env
from worker.engine.stall_watch import ping_interval
from worker.group_launch import discard_hostfile, watch_leader, watch_messages

log = logging.getLogger("worker.follower")


def main() -> int:
    config = WorkerConfig.from_args()
    logging.basicConfig(level=config.log_level.upper(), format=LOG_FORMAT, stream=sys.stderr)
    parent = os.getppid()
    apply_mlx_env()
    ensure_fast_blas()  # the same BLAS as rank 0 (may re-execute this process once)
    watch_leader(parent)
    from worker.model.group import Channel, init_group, serve_follower

    group = init_group(os.environ.get("KVSERVE_GROUP_BACKEND", "any"))
    log.info("worker group: rank %d of %d joined", group.rank(), group.size())
    discard_hostfile()  # every rank has joined: the ring's hosts file is read by nobody now
    channel = Channel(group)

    def built() -> None:  # from here on rank 0 sends a job or a ping at least this often
        if config.group_timeout_s > 0:
            every = ping_interval(config.group_timeout_s)
            watch_messages(channel, config.group_timeout_s + 2 * every)

    calls = serve_follower(channel, on_built=built)
    log.info("worker group: rank %d stopped after %d calls", group.rank(), calls)
    return 0


if __name__ == "__main__":
    status = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # MLX may abort in its C++ destructors at exit (as the worker's exit_hard)
