"""`python -m worker`: an MLX compute worker, until SIGINT/SIGTERM.

``mlx_lm`` is registered first with its ``__init__`` deferred (``worker.model.mlx_lm_light``):
importing ``worker.server`` then imports mlx-lm's models but not ``transformers`` (14 s on a GPU
machine with PyTorch installed), which only the tokenizer needs, and which loads on a thread of
its own beside the weights and the self-check (``worker.model.loader``)."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import AsyncIterator

from kvserve_launch.run import Service, run_until_signal
from kvserve_model.blas import describe, ensure_fast_blas, measure_gflops
from kvserve_model.errors import ModelLoadError
from kvserve_model.resolve import resolve_model
from kvserve_model.torchless import keep_torch_out
from worker import precompile
from worker.config import WorkerConfig
from worker.device_defaults import apply_mlx_env
from worker.model import mlx_lm_light
from worker.model.device import cuda_available

mlx_lm_light.register_package()  # before anything imports mlx_lm
keep_torch_out()  # before the tokenizer's transformers import (kvserve_model/torchless.py)
log = logging.getLogger("worker")


def start(config: WorkerConfig) -> Service:
    """The worker, once the process runs with the fastest BLAS it can have."""
    # Before anything runs on the GPU (MLX reads them once) and before a re-exec (which keeps
    # the environment).
    apply_mlx_env()
    if cuda_available():
        graphs = os.environ["MLX_USE_CUDA_GRAPHS"]
        log.info("MLX_USE_CUDA_GRAPHS=%s (the worker's default: 0; docs/configuration.md)", graphs)
    blas = ensure_fast_blas()  # may re-exec this process with LD_PRELOAD set
    # On a GPU the CPU BLAS is not on the model's path: say so, and measure nothing.
    log.info(describe(blas, measure_gflops() if blas.library or not blas.fast else None))
    if config.tensor_parallel > 1 and "MLX_RANK" not in os.environ:
        # After any re-exec: the other ranks of the group, started once (docs/tensor-parallel.md).
        from worker.group_launch import start_followers

        start_followers(config.tensor_parallel, config.group_backend, sys.argv[1:])
    return serving(config, start_precompile(config))


def start_precompile(config: WorkerConfig) -> precompile.Precompile | None:
    """Children that compile the model's kernels beside this process's own (``worker.precompile``);
    None off CUDA, or where the model does not resolve (the load then says why), with
    ``--no-precompile``, or where attention is not the CUDA backend's."""
    if not config.precompile or config.attention not in ("auto", "cuda"):
        return None
    try:
        return precompile.start(resolve_model(config.model, log=log.info), config.block_size)
    except ModelLoadError:
        return None


@contextlib.asynccontextmanager
async def serving(
    config: WorkerConfig, pre: precompile.Precompile | None = None
) -> AsyncIterator[str]:
    """The worker, running; yields its ready line."""
    from worker.server import running

    try:
        async with running(config, self_checked=lambda: precompile.finish(pre)) as w:
            yield f"WORKER_READY {w.address}"
    finally:
        precompile.finish(pre)  # where the start failed before its self-check ended


if __name__ == "__main__":
    cfg = WorkerConfig.from_args()
    if cfg.group_hosts and "MLX_RANK" not in os.environ:
        # Ranks that start on their own (several machines): this one's group environment,
        # as mlx.launch would have set it (kept through a BLAS re-exec).
        from worker.group_launch import join_env, resolve_backend

        os.environ.update(
            join_env(cfg.group_hosts, cfg.group_rank, resolve_backend(cfg.group_backend))
        )
    if cfg.tensor_parallel > 1 and os.environ.get("MLX_RANK", "0") != "0":
        # A rank other than 0 of a group that mlx.launch started: it follows rank 0.
        from worker.follower import main as follow

        os._exit(follow())
    # exit_hard: MLX sometimes aborts in its C++ static destructors at exit (kvserve_launch.run).
    run_until_signal("worker", cfg.log_level, lambda: start(cfg), exit_hard=True)
