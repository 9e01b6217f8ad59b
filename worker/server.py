"""Builds a running worker: model on its thread (``worker.model_setup``), engine, gRPC server
with health and reflection.

The assembly: the one place the worker's config becomes the plain values the engine takes
(``EngineLimits``, the pool's registration) and its edge is wired to it (the gRPC servicer, the
cache service's client, which the engine knows only as ``worker.engine.lease.LeaseService``).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import shutil
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import mlx.core as mx
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvserve_launch.malformed import MalformedRequests
from kvserve_launch.startup import EXCLUSIVE_PORT, StartupError, add_port
from kvserve_launch.tls import Dialer, server_credentials
from kvserve_model.blas import trim_heap
from kvserve_model.context import context_length
from kvserve_proto.worker.v1 import worker_pb2 as pb
from kvserve_proto.worker.v1 import worker_pb2_grpc as pb_grpc
from worker.config import ENV_PREFIX, WorkerConfig
from worker.device_defaults import WorkerLimits
from worker.engine.executor import ModelExecutor, Runner
from worker.engine.lease import PoolRegistration
from worker.engine.loop import Engine, EngineLimits
from worker.lease_client import LeaseClient
from worker.model.device import cuda_available
from worker.model.loader import LoadedModel, load_model
from worker.model.spec import LayerSpec
from worker.model_setup import build_executor, group_sharding, model_errors_as_startup_errors
from worker.pool_claim import PoolClaim
from worker.servicer import WorkerServicer
from worker.tier.disk import DiskTier
from worker.tier.host import HostTier
from worker.tier.store import BlockFormat, TierStore
from worker.warmup import warm_up_between_requests

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Worker"].full_name


@dataclass
class RunningWorker:
    server: grpc.aio.Server
    engine: Engine
    port: int
    address: str
    worker_id: str
    loaded: LoadedModel
    # The background warm-up (None when --no-warmup): done once every shape has run.
    warming: asyncio.Task[None] | None = None


@contextlib.asynccontextmanager
async def running(
    config: WorkerConfig,
    loaded: LoadedModel | None = None,
    self_checked: Callable[[], None] | None = None,
) -> AsyncIterator[RunningWorker]:
    """Loads the model (unless given), binds the port, registers the pool, serves. Raises
    StartupError (``kvserve_launch.startup``) for a model it cannot serve or a port it cannot
    bind. ``self_checked``: see :func:`build_executor`."""
    # Its port and its disk tier first: a taken port or an unwritable directory is said at
    # once, not after seconds of loading and self-checking the model.
    server, port = _bound_server(config)
    if config.offload_dir:
        usable_offload_dir(Path(config.offload_dir))
    with model_errors_as_startup_errors(config.model):
        loaded = loaded or load_model(
            config.model, dequantize=config.dequantize, shard=group_sharding(config)
        )
        executor, chosen = build_executor(config, loaded, self_checked)
        tokenizer = loaded.tokenizer  # loaded on its own thread meanwhile (worker.model.loader)
    runner = executor.runner
    worker_id = config.pool_id(port)
    address = config.address(port)
    tiers = _tier_store(config, loaded, runner)
    if tiers is not None:
        await asyncio.to_thread(tiers.start)  # scans what an earlier run left
    registration = _registration(config, loaded, runner, chosen, worker_id, address, tiers)
    max_context = context_length(loaded.config)
    engine = Engine(
        executor,
        _lease_client(config, worker_id),
        registration,
        _engine_limits(config, executor, chosen, max_context),
        tokenizer,
        tiers,
        config.tier_load,
    )
    health_servicer = _add_services(
        server, WorkerServicer(engine, worker_id, config.model, runner.kind, config.stream_interval)
    )
    await engine.start()
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info(
        "worker %s serving %s on %s: %d blocks of %d tokens (%s), device %s, %s runner",
        worker_id,
        config.model,
        address,
        runner.num_blocks,
        runner.block_size,
        registration.dtype,
        mx.default_device(),
        runner.kind,
    )
    warming = None
    if config.warmup:
        warming = asyncio.create_task(
            _settle(
                engine,
                warm_up_between_requests(engine, chosen, max_context, config.num_draft_tokens),
            )
        )
    else:
        await _settle(engine)
    try:
        yield RunningWorker(server, engine, port, address, worker_id, loaded, warming)
    finally:
        log.debug("stopping worker %s", worker_id)
        if warming is not None:
            warming.cancel()
            await asyncio.gather(warming, return_exceptions=True)
        await health_servicer.enter_graceful_shutdown()
        await server.stop(grace=1.0)
        log.debug("server stopped")
        await engine.stop()
        log.debug("engine stopped")
        if tiers is not None:
            await asyncio.to_thread(tiers.close)
        executor.shutdown()
        log.debug("worker %s stopped", worker_id)


def _bound_server(config: WorkerConfig) -> tuple[grpc.aio.Server, int]:
    """The gRPC server, bound to its port (TLS as configured); raises StartupError if it
    cannot bind."""
    server = grpc.aio.server(
        interceptors=[MalformedRequests()],
        options=[("grpc.max_receive_message_length", 64 * 1024 * 1024), EXCLUSIVE_PORT],
    )
    tls = server_credentials(config.tls_cert, config.tls_key, ENV_PREFIX, config.tls_client_ca)
    return server, add_port(server, config.host, config.port, ENV_PREFIX, "port", tls)


def _lease_client(config: WorkerConfig, pool_id: str) -> LeaseClient:
    """The cache service's client (TLS as configured): the engine's ``LeaseService``, keeping
    the pool's incarnation for a restart of this worker (``worker.pool_claim``)."""
    dialer = Dialer.from_files(
        config.tls_ca, config.tls_server_name, config.tls_cert, config.tls_key, ENV_PREFIX
    )
    channel = dialer.aio(config.cache_service)
    claim = PoolClaim(config.cache_service, pool_id)
    return LeaseClient(config.cache_service, config.cache_token, channel, claim)


def _registration(
    config: WorkerConfig,
    loaded: LoadedModel,
    runner: Runner,
    chosen: WorkerLimits,
    worker_id: str,
    address: str,
    tiers: TierStore | None = None,
) -> PoolRegistration:
    """What the pool registers with the cache service: its blocks and their layout."""
    # A pure SSM has no attention layer: its pool layout is all zeros (the cache service only
    # records it).
    layer = runner.spec.layers[0] if runner.spec.layers else LayerSpec(0, 0, 0)
    return PoolRegistration(
        pool_id=worker_id,
        num_blocks=chosen.num_blocks,  # not the warm-up's scratch blocks: no lease gets them
        block_size=runner.block_size,
        model=config.model,
        model_fingerprint=loaded.fingerprint,
        worker_address=address,
        num_layers=len(runner.spec.layers),
        num_kv_heads=layer.n_kv_heads,
        head_dim=layer.k_head_dim,
        dtype=str(runner.spec.dtype),
        bytes_per_block=runner.bytes_per_block,
        tiers=_tier_specs(tiers),
    )


async def _settle(engine: Engine, warm_up: Awaitable[None] | None = None) -> None:
    """The end of start-up: the warm-up (if any), then the memory start-up freed (loading,
    the self-check, the warm-up) given back to the kernel, on the model thread between steps
    (``kvserve_model.blas.trim_heap``; the heap keeps what steps free, by design, and would
    keep this too)."""
    if warm_up is not None:
        await warm_up
    freed = await engine.executor.call(trim_heap)
    if freed:
        log.info("start-up over: %d MiB of freed memory given back (malloc_trim)", freed >> 20)


def _tier_specs(tiers: TierStore | None) -> tuple[tuple[str, int], ...]:
    if tiers is None:
        return ()
    specs = []
    if tiers.host is not None:
        specs.append(("host", tiers.host.capacity_blocks))
    if tiers.disk is not None:
        specs.append(("disk", tiers.disk.capacity_blocks))
    return tuple(specs)


def usable_offload_dir(root: Path) -> Path:
    """``root``, made if missing, once a file could be written in it; StartupError naming
    the problem otherwise (a read-only or full file system, a file in the way): the worker
    crashed with a traceback there, after loading its model."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".kvserve-write-check-{os.getpid()}"
        try:
            with open(probe, "wb") as f:
                f.write(b"\0" * 4096)
        finally:
            probe.unlink(missing_ok=True)
    except OSError as err:
        raise StartupError(
            f"--offload-dir {root} cannot hold the disk tier: {err.strerror or err}",
            "give a writable directory, or leave the disk tier off",
        ) from None
    _hold_offload_dir(root)
    return root


# The lock files of the disk tiers this process holds: open for its life (a closed file
# releases its lock).
_HELD: dict[Path, Any] = {}
OFFLOAD_LOCK = ".kvserve.lock"


def _hold_offload_dir(root: Path) -> None:
    """Locks ``root`` for this worker: two workers on one directory (two systems given one
    --offload-dir) deleted each other's blocks as their services evicted or flushed them.
    StartupError naming the directory where another process holds it."""
    if root.resolve() in _HELD:  # checked before the model loads, then used
        return
    lock = open(root / OFFLOAD_LOCK, "a+")  # noqa: SIM115 (held for the process's life)
    try:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.close()
        raise StartupError(
            f"--offload-dir {root} is in use by another worker (it holds {OFFLOAD_LOCK} there)",
            "give each worker a directory of its own; two systems need two --offload-dir",
        ) from None
    lock.seek(0)
    lock.truncate()
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    _HELD[root.resolve()] = lock


def _tier_store(config: WorkerConfig, loaded: LoadedModel, runner: Runner) -> TierStore | None:
    """The tiers ``--offload-dir`` and ``--host-offload-gb`` ask for (not scanned yet); None
    without one. Only the paged runner's blocks hold K/V to spill; a host tier only where the
    device has memory of its own (CUDA: elsewhere the pool already is host memory)."""
    host_gb = config.host_offload_gb
    if host_gb and not cuda_available():
        log.warning(
            "--host-offload-gb ignored: this device's pool is in host memory already "
            "(a host tier is for a GPU with memory of its own)"
        )
        host_gb = 0.0
    if not config.offload_dir and not host_gb:
        return None
    pool = getattr(runner, "pool", None)
    if runner.kind != "paged" or pool is None:
        log.warning("KV tiers ignored: the %s runner's blocks hold no K/V", runner.kind)
        return None
    fmt = BlockFormat(loaded.fingerprint, pool.describe_layout(), pool.bytes_per_block)
    host = None
    if host_gb:
        host = HostTier(max(1, int(host_gb * 1e9 // pool.bytes_per_block)))
        log.info("host tier: %d blocks (%.1f GB)", host.capacity_blocks, host_gb)
    if not config.offload_dir:
        return TierStore(runner.block_size, fmt, host=host)
    root = usable_offload_dir(Path(config.offload_dir))
    free = shutil.disk_usage(root).free
    size = config.offload_gb * 1e9 or free / 2
    if size > free:
        log.warning(
            "--offload-gb %g is more than the %.1f GB free under %s: the tier stops spilling "
            "when the disk is full",
            config.offload_gb,
            free / 1e9,
            root,
        )
    capacity = int(size // pool.bytes_per_block)
    if capacity < 1:
        raise StartupError(
            f"--offload-gb {config.offload_gb:g} holds no block of {pool.bytes_per_block} bytes"
        )
    disk = DiskTier(root, fmt.fingerprint, fmt.layout, fmt.payload_len, capacity)
    log.info(
        "disk tier %s: %d blocks (%.1f GB) of %d bytes",
        disk.dir,
        capacity,
        capacity * pool.bytes_per_block / 1e9,
        pool.bytes_per_block,
    )
    return TierStore(runner.block_size, fmt, disk=disk, host=host)


def _engine_limits(
    config: WorkerConfig, executor: ModelExecutor, chosen: WorkerLimits, max_context: int
) -> EngineLimits:
    """The config and the chosen limits as the plain values the engine runs under."""
    dense = executor.runner.kind == "dense"
    return EngineLimits(
        max_batch_size=chosen.max_batch_size,
        max_step_tokens=chosen.max_step_tokens,
        max_pending_requests=chosen.max_pending_requests,
        max_context=max_context,
        vocab_size=executor.runner.spec.vocab_size,
        reserve_tokens=config.reserve_tokens,
        extend_ahead_tokens=config.extend_ahead_tokens,
        # The dense runner's blocks hold no K/V: no prefix to match or to publish.
        prefix_caching=config.prefix_caching and not dense,
        publish_blocks=not dense,
        num_draft_tokens=config.num_draft_tokens,
        speculation=not dense,
        draft_model=config.draft_model if executor.draft is not None else "",
        admission_timeout_s=config.admission_timeout_s,
        cache_outage_timeout_s=config.cache_outage_timeout_s,
        itl_ratio=config.itl_ratio,
    )


def _add_services(server: grpc.aio.Server, servicer: WorkerServicer) -> health.aio.HealthServicer:
    """The Worker service, health (not serving until the caller says so) and reflection."""
    pb_grpc.add_WorkerServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME), server)
    return health_servicer
