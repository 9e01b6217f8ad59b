"""`python -m worker`: an MLX compute worker, until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys

from kvserve_launch.startup import StartupError, report
from kvserve_model.blas import describe, ensure_fast_blas, measure_gflops
from worker.config import WorkerConfig
from worker.server import running

log = logging.getLogger("worker")


async def main(config: WorkerConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with running(config) as w:
        print(f"WORKER_READY {w.address}", flush=True)
        await stop.wait()
        log.info("shutting down")


if __name__ == "__main__":
    cfg = WorkerConfig.from_args()
    logging.basicConfig(
        level=cfg.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    blas = ensure_fast_blas()  # may re-exec this process with LD_PRELOAD set
    # On a GPU the CPU BLAS is not on the model's path: say so, and measure nothing.
    log.info(describe(blas, measure_gflops() if blas.library or not blas.fast else None))
    try:
        asyncio.run(main(cfg))
        status = 0
    except StartupError as e:
        status = report("worker", e)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # Everything is stopped. Skip C++ static destructors: MLX 0.32 sometimes aborts at exit
    # (status 134) after running on a thread other than the main one, as the model does here.
    os._exit(status)
